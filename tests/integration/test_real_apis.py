"""What the real provider APIs do that a kind fake does not, each through the guarded
transport with the official SDKs, against the fake provider in its realistic default
mode (the ways money was lost, sent twice or held forever when it was kinder)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetTask, Ledger
from budget_tasks.testing import FakeProvider, fake_wire
from budget_tasks.transport import guarded_anthropic_client, guarded_openai_client


@pytest.fixture
def app(backend_url: str) -> Celery:
    app = Celery(f"real-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    Ledger(backend_url).create_budget("team", 10_000_000)
    return app


def task(app: Celery, fn: Any, key: str) -> Any:
    """``fn`` as a BudgetTask on ``app``: zero main estimate, every call through the
    guarded transport reserves its own bound."""
    return app.task(
        base=BudgetTask,
        bind=True,
        name=f"{fn.__name__}-{uuid.uuid4().hex[:6]}",
        budget="team",
        idempotency_key=lambda *a, **k: key,
        estimate_cost=lambda *a, **k: 0,
    )(fn)


def posts(fake: FakeProvider) -> list[Any]:
    return [s for s in fake.served() if s.method == "POST"]


def settled_at_the_bill(ledger: Ledger, fake: FakeProvider) -> dict[str, int]:
    """Every metered call's attempt, checked against what the fake billed for its key."""
    sent = posts(fake)
    charged = {a.key: a for a in ledger.attempts() if "#" not in a.key}
    assert len(charged) == len(sent)
    for s in sent:
        attempt = charged[s.idempotency_key]
        assert (attempt.state, attempt.actual) == ("settled", s.billed), attempt
        assert s.billed > 0
    assert ledger.balance("team").held == 0 and ledger.audit() == []
    return {a.key: a.actual or 0 for a in charged.values()}


# -- 1. compressed answers ----------------------------------------------------------------


@pytest.mark.parametrize("encoding", [*fake_wire.available(), "identity"])
def test_compressed_answers_and_streams_settle_at_the_bill_in_every_encoding(
    app: Celery, fake: FakeProvider, backend_url: str, encoding: str
) -> None:
    """The real APIs compress whenever the client accepts it (httpx2 asks for gzip and
    deflate, and br and zstd where their packages are installed). The transport hands
    the SDK what it decoded, so the SDK must not decode it again, and a stream's usage
    is read from the decoded events."""
    fake.encodings = (encoding,)
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
    ask = [{"role": "user", "content": "Compressed, please."}]

    def calls(self: BudgetTask) -> list[Any]:
        plain = oai.chat.completions.create(
            model="gpt-4o-mini", max_completion_tokens=16, messages=ask
        )
        streamed = [
            chunk.choices[0].delta.content or ""
            for chunk in oai.chat.completions.create(
                model="gpt-4o-mini", max_completion_tokens=16, stream=True, messages=ask
            )
        ]
        message = claude.messages.create(model="claude-haiku-4-5", max_tokens=16, messages=ask)
        with claude.messages.stream(
            model="claude-haiku-4-5", max_tokens=16, messages=ask
        ) as events:
            told = "".join(events.text_stream)
        return [
            plain.usage.total_tokens,
            "".join(streamed).strip(),
            message.usage.output_tokens,
            told.strip(),
        ]

    tokens, streamed, output, told = task(app, calls, "zip:1").delay().get()
    assert tokens > 0 and output > 0
    assert streamed.startswith("fake") and told.startswith("fake")
    assert {s.encoding for s in posts(fake)} == {encoding}  # it went out compressed
    assert len(settled_at_the_bill(Ledger(backend_url), fake)) == 4


# -- 2. the SDKs' own retries ------------------------------------------------------------------


def _sdk_client(vendor: str, fake: FakeProvider, timeout: float) -> Any:
    """The SDK's own client over the guarded http client, its default 2 retries kept."""
    import anthropic
    import openai

    from budget_tasks.transport import guarded_http_client

    http = guarded_http_client(timeout=timeout)
    if vendor == "openai":
        return openai.OpenAI(base_url=fake.openai_base_url, api_key="x", http_client=http)
    return anthropic.Anthropic(base_url=fake.url, api_key="x", http_client=http)


def _ask(client: Any, vendor: str) -> Any:
    ask = [{"role": "user", "content": "Retry me."}]
    if vendor == "openai":
        return client.chat.completions.create(
            model="gpt-4o-mini", max_completion_tokens=16, messages=ask
        )
    return client.messages.create(model="claude-haiku-4-5", max_tokens=16, messages=ask)


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
@pytest.mark.parametrize("fault", ["hang=2", "status=500"])
def test_the_sdks_own_retry_is_refused_before_it_is_sent(
    app: Celery, fake: FakeProvider, backend_url: str, vendor: str, fault: str
) -> None:
    """A client built by hand over the guarded http client keeps the SDK's default of
    2 retries. After a timeout (billed, answered too late) or a 500, the SDK sends the
    same request again, marked by x-stainless-retry-count: refused before it leaves,
    so the provider sees it once and the first try keeps its hold."""
    from budget_tasks.errors import RetriesEnabled

    client = _sdk_client(vendor, fake, timeout=1.0)
    assert client.max_retries == 2
    fake.plan(fault)

    def once(self: BudgetTask) -> Any:
        return _ask(client, vendor)

    with pytest.raises(RetriesEnabled, match=r"x-stainless-retry-count=[12]"):
        task(app, once, f"retry:{vendor}").delay().get()
    [sent] = posts(fake)  # sent once, never again
    ledger = Ledger(backend_url)
    calls = [a for a in ledger.attempts() if "#" not in a.key]
    assert [a.key for a in calls] == [
        f"retry:{vendor}:{vendor}.{'chat' if vendor == 'openai' else 'messages'}:1"
    ]
    [first] = calls
    if fault.startswith("hang"):  # billed, answer lost: the hold stays for reconciliation
        assert sent.billed > 0 and first.state == "unknown"
        assert ledger.balance("team").held == first.amount
    else:
        assert sent.billed == 0 and sent.status == 500 and first.state == "unknown"


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_a_guarded_client_cannot_have_its_retries_turned_back_on(
    fake: FakeProvider, vendor: str
) -> None:
    import httpx2

    from budget_tasks.errors import RetriesEnabled

    build = guarded_openai_client if vendor == "openai" else guarded_anthropic_client
    client = build(base_url=fake.url, api_key="x", timeout=5.0)
    for turn_on in (
        lambda: client.with_options(max_retries=2),
        lambda: client.copy(max_retries=1),
        lambda: setattr(client, "max_retries", 3),
    ):
        with pytest.raises(RetriesEnabled):
            turn_on()
    with pytest.raises(ValueError, match="guarded http client"):
        client.with_options(http_client=httpx2.Client())
    other = client.with_options(timeout=2.0)  # other options still change
    assert (other.max_retries, other.timeout, type(other)) == (0, 2.0, type(client))
    with pytest.raises(RetriesEnabled):
        build(base_url=fake.url, api_key="x", max_retries=2)
