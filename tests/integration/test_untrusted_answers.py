"""Answers from a provider, or a gateway in front of it, are outside the ledger's trust:
the official SDKs call a gateway that answers falsely (tests/hostile_gateway.py), over
HTTP, inside BudgetTask runs (eager here) on a real ledger (SQLite and PostgreSQL), and
beat looks the calls up there."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetTask, Ledger
from budget_tasks.beat import look_up, reconcile_unknown
from budget_tasks.errors import UsageUnreadable
from budget_tasks.hooks import Hooks, add_sink, remove_sink
from budget_tasks.metrics import UNTRUSTED_ANSWERS
from budget_tasks.providers import Unknowable
from budget_tasks.providers.estimates import openai_chat, openai_response
from budget_tasks.providers.registry import openai_client
from budget_tasks.transport import guarded_anthropic_client, guarded_openai_client
from tests.support.sdk_calls import openai_chat as call_openai_chat

from ..hostile_gateway import HostileGateway

PROMPT = [{"role": "user", "content": "What is the tide doing?"}]
MAX_TOKENS = 16
#: the bound the guarded client computes for the chat request the tasks send
CHAT_BOUND = openai_chat(
    {"model": "gpt-4o-mini", "max_completion_tokens": MAX_TOKENS, "messages": PROMPT}
)


class Alerts(Hooks):
    """A sink that keeps every untrusted-answer alert."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def untrusted(self, *, budget: str, attempt: str, reason: str, by: str) -> None:
        self.seen.append({"budget": budget, "attempt": attempt, "reason": reason, "by": by})


@pytest.fixture
def alerts() -> Iterator[Alerts]:
    sink = Alerts()
    add_sink(sink)
    yield sink
    remove_sink(sink)


@pytest.fixture
def app(backend_url: str, gateway: HostileGateway) -> Any:
    prefix = f"hostile{uuid.uuid4().hex[:8]}"
    app = Celery("hostile-tests", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    client = guarded_openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    claude = guarded_anthropic_client(base_url=gateway.url, api_key="x", timeout=5.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.chat",
        budget="team",
        idempotency_key=lambda mode, n=0: f"chat:{mode}:{n}",
        estimate_cost=lambda mode, n=0: 0,
    )
    def chat(self: BudgetTask, mode: str, n: int = 0) -> str:
        answer = client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=MAX_TOKENS,
            messages=PROMPT,
            extra_headers={"x-hostile": mode},
        )
        return str(answer.choices[0].message.content)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.claude",
        budget="team",
        idempotency_key=lambda mode: f"claude:{mode}",
        estimate_cost=lambda mode: 0,
    )
    def ask_claude(self: BudgetTask, mode: str) -> str:
        message = claude.messages.create(
            model="claude-haiku-4-5",
            max_tokens=MAX_TOKENS,
            messages=PROMPT,
            extra_headers={"x-hostile": mode},
        )
        return str(message.content[0].text)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.background",
        budget="team",
        idempotency_key=lambda mode: f"background:{mode}",
        estimate_cost=lambda mode: 0,
    )
    def background(self: BudgetTask, mode: str) -> str:
        response = client.responses.create(
            model="gpt-4o-mini",
            input="What is the tide doing?",
            max_output_tokens=MAX_TOKENS,
            background=True,
            extra_headers={"x-hostile": mode},
        )
        return str(response.id)

    plain = openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    request = {"model": "gpt-4o-mini", "max_completion_tokens": MAX_TOKENS, "messages": PROMPT}

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.helper",
        budget="team",
        idempotency_key=lambda mode: f"helper:{mode}",
        estimate_cost=lambda mode: openai_chat(request).amount,
    )
    def helper(self: BudgetTask, mode: str) -> str:
        sent = call_openai_chat(
            plain, attempt=self.attempt, extra_headers={"x-hostile": mode}, **request
        )
        return str(sent.result["content"])

    app.jobs = {"chat": chat, "claude": ask_claude, "background": background, "helper": helper}
    Ledger(backend_url).create_budget("team", 10_000_000)
    return app


def calls_of(ledger: Ledger, operation: str) -> list[Any]:
    return [a for a in ledger.attempts() if a.key.startswith(f"{operation}:")]


def test_an_absurd_usage_is_never_charged_and_raises_an_alert(
    app: Any, gateway: HostileGateway, backend_url: str, alerts: Alerts
) -> None:
    """10**18 tokens claimed (750,000,000,000,000,000 micro-USD at list price, past the
    ledger's ceiling of 10**15): the hold stays unknown at its estimate, nothing is
    charged, the budget keeps admitting, and the alert fires once, as a hook and a
    metric."""
    before = UNTRUSTED_ANSWERS.labels("team", "task")._value.get()
    assert app.jobs["chat"].delay(f"usage={10**18},{10**18}").get() == "fine"
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, f"chat:usage={10**18},{10**18}:0")
    assert call.state == "unknown" and call.actual is None
    assert call.note.startswith("untrusted usage: its cost")
    assert call.lookup == "untrusted"
    balance = ledger.balance("team")
    assert (balance.spent, balance.held) == (0, call.amount)
    assert call.amount == CHAT_BOUND.amount
    assert [a["attempt"] for a in alerts.seen] == [call.key]
    assert alerts.seen[0]["by"] == "task"
    assert UNTRUSTED_ANSWERS.labels("team", "task")._value.get() == before + 1
    # the next call is admitted as usual, and charged at what it reports
    assert app.jobs["chat"].delay("usage=10,5").get() == "fine"
    [honest] = calls_of(ledger, "chat:usage=10,5:0")
    assert honest.state == "settled" and 0 < honest.actual <= honest.amount
    # beat does not charge it: no lookup finds it; an operator resolves it
    lookups = openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    counts = reconcile_unknown(ledger, lambda kind: lookups, margin=timedelta(0))
    assert counts["unknowable"] == 1 and counts["found"] == 0
    assert ledger.attempt(call.key).state == "unknown"
    ledger.resolve_attempt(call.key, 40, note="invoice line 7", by="operator", actor="ana")
    assert ledger.attempt(call.key).state == "settled"
    assert ledger.audit() == []


def test_a_main_call_through_a_helper_past_its_bound_is_not_charged(
    app: Any, gateway: HostileGateway, backend_url: str, alerts: Alerts
) -> None:
    """The same rule for the main call (call 0) under ``attempt=self.attempt``: the
    run returns its answer, the main attempt stays unknown at its estimate, and a
    redelivery replays the stored result without a second call."""
    mode = f"usage=10,{MAX_TOKENS + 1}"
    assert app.jobs["helper"].delay(mode).get() == "fine"
    ledger = Ledger(backend_url)
    main = ledger.attempt(f"helper:{mode}#1")
    assert main.state == "unknown" and main.lookup == "untrusted"
    assert (ledger.balance("team").spent, ledger.balance("team").held) == (0, main.amount)
    assert [a["attempt"] for a in alerts.seen] == [main.key]
    assert app.jobs["helper"].delay(mode).get() == "fine"  # replayed
    assert len(gateway.posts()) == 1
    assert ledger.operation(f"helper:{mode}").status == "succeeded"
    assert ledger.audit() == []


@pytest.mark.parametrize(
    ("extra_in", "extra_out", "charged"),
    [(0, 0, True), (1, 0, False), (0, 1, False)],
    ids=["exactly-the-bound", "one-input-past", "one-output-past"],
)
def test_usage_exactly_at_the_requests_bound_is_charged_one_token_past_it_is_not(
    app: Any, backend_url: str, alerts: Alerts, extra_in: int, extra_out: int, charged: bool
) -> None:
    tokens_in = CHAT_BOUND.input_tokens + extra_in
    tokens_out = CHAT_BOUND.output_tokens + extra_out
    mode = f"usage={tokens_in},{tokens_out}"
    assert tokens_out == MAX_TOKENS + extra_out  # n=1: the maximum is the bound
    app.jobs["chat"].delay(mode).get()
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, f"chat:{mode}:0")
    if charged:
        assert call.state == "settled" and 0 < call.actual <= CHAT_BOUND.amount
        assert alerts.seen == []
    else:
        assert call.state == "unknown" and call.lookup == "untrusted"
        kind = "input" if extra_in else "output"
        assert f"{tokens_in if extra_in else tokens_out} {kind} tokens" in call.note
        assert len(alerts.seen) == 1
        assert ledger.balance("team").spent == 0
    assert ledger.audit() == []


def test_an_anthropic_answer_past_its_max_tokens_is_not_charged(
    app: Any, backend_url: str, alerts: Alerts
) -> None:
    app.jobs["claude"].delay(f"usage=10,{MAX_TOKENS + 1}").get()
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, f"claude:usage=10,{MAX_TOKENS + 1}")
    assert call.state == "unknown" and "output tokens" in call.note
    assert ledger.balance("team").spent == 0
    assert len(alerts.seen) == 1


@pytest.mark.parametrize("mode", ["negative", "non-json", "truncated-gzip"])
def test_a_negative_a_non_json_or_a_truncated_answer_keeps_its_hold_unknown(
    app: Any, gateway: HostileGateway, backend_url: str, mode: str
) -> None:
    """As before: the provider may have billed, and the answer says nothing that can be
    charged; the hold stays for reconciliation or an operator, nothing is charged."""
    # the SDK cannot read a body that is not JSON (or is cut off): its own JSON error
    with pytest.raises(UsageUnreadable if mode == "negative" else ValueError):
        app.jobs["chat"].delay(mode).get()
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, f"chat:{mode}:0")
    assert call.state == "unknown"
    assert call.lookup == "openai.chat"  # still found by a lookup, if the provider kept it
    assert ledger.balance("team").spent == 0
    assert len(gateway.posts()) == 1
    assert ledger.audit() == []


def test_beat_does_not_charge_a_found_answer_past_its_requests_bound(
    app: Any, gateway: HostileGateway, backend_url: str, alerts: Alerts
) -> None:
    """A background Response answered queued; when beat looks it up, the gateway
    claims more output than the request allowed. The bound was written with the
    attempt, so beat vets what it finds: not charged, kept for an operator, and never
    looked up again."""
    bound = openai_response(
        {"model": "gpt-4o-mini", "input": "What is the tide doing?", "max_output_tokens": 16}
    )
    mode = f"usage=12,{bound.output_tokens + 1}"
    app.jobs["background"].delay(mode).get()
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, f"background:{mode}")
    assert call.state == "unknown"  # answered without usage: settled when it is read
    assert (call.input_bound, call.output_bound) == (bound.input_tokens, bound.output_tokens)
    lookups = openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    counts = reconcile_unknown(ledger, lambda kind: lookups, margin=timedelta(0))
    assert counts["untrusted"] == 1 and counts["found"] == 0
    found = ledger.attempt(call.key)
    assert found.state == "unknown" and found.lookup == "untrusted"
    assert found.note.startswith("untrusted usage:")
    assert [(a["attempt"], a["by"]) for a in alerts.seen] == [(call.key, "reconcile")]
    assert ledger.balance("team").spent == 0
    gets = len([r for r in gateway.requests if r.method == "GET"])
    # whenever it is due again, the lookup does not ask the provider: it names none
    assert isinstance(look_up(found, lambda kind: lookups), Unknowable)
    assert len([r for r in gateway.requests if r.method == "GET"]) == gets


def test_beat_charges_a_found_answer_within_its_bound(
    app: Any, gateway: HostileGateway, backend_url: str
) -> None:
    app.jobs["background"].delay("usage=12,16").get()
    ledger = Ledger(backend_url)
    [call] = calls_of(ledger, "background:usage=12,16")
    lookups = openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    counts = reconcile_unknown(ledger, lambda kind: lookups, margin=timedelta(0))
    assert counts["found"] == 1
    settled = ledger.attempt(call.key)
    assert settled.state == "settled" and 0 < settled.actual <= settled.amount
    assert ledger.audit() == []
