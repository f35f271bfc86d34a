"""The decisions a real worker rarely shows on demand, drawn in process: a call that
times out (its span ends ``unknown``), the next delivery held by that unknown outcome,
and a delivery that finds another one's live lease (``in_progress``, nested in the
span of the run it was made from). A PostgreSQL ledger, the official openai SDK
against the fake provider, the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from budget_tasks import Ledger, OutcomeUnknown
from budget_tasks.delivery.flow import OperationManager, RetryLater
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.delivery.scope import AttemptScope
from budget_tasks.hooks import add_sink, remove_sink
from budget_tasks.testing import FakeProvider
from budget_tasks.tracing import TracingHooks

from .races import ESTIMATE, call, delivery


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = add_sink(TracingHooks(provider))
    yield exporter
    remove_sink(sink)


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_a_timeout_ends_its_call_unknown_and_holds_the_next_delivery(
    exporter: InMemorySpanExporter, pg_ledger: Ledger, fake: FakeProvider
) -> None:
    pg_ledger.create_budget("team", 1_000_000)
    manager = OperationManager(pg_ledger.calls, DeliveryOptions(task="t"))
    slow = delivery("op-slow", lambda s: call(fake.openai_base_url, s, "delay=2", timeout=0.3))
    with pytest.raises(Exception, match="timed out"):
        manager.deliver(slow)
    with pytest.raises(OutcomeUnknown):
        manager.deliver(delivery("op-slow", lambda s: call(fake.openai_base_url, s)))

    spans = exporter.get_finished_spans()
    [timed_out, held] = named(spans, "budget_tasks.deliver")
    [call_span] = named(spans, "chat gpt-4o-mini")
    assert call_span.parent is not None
    assert call_span.parent.span_id == timed_out.context.span_id
    assert attrs(call_span)["budget_tasks.call.outcome"] == "unknown"
    assert "gen_ai.usage.output_tokens" not in attrs(call_span)
    assert attrs(timed_out)["budget_tasks.decision"] == "admitted"
    assert attrs(timed_out)["budget_tasks.actual"] == 0  # held, not charged
    assert attrs(timed_out)["budget_tasks.reserved"] == ESTIMATE
    assert "budget_tasks.unknown" in [e.name for e in timed_out.events]
    assert attrs(held)["budget_tasks.decision"] == "unknown"
    assert attrs(held)["error.type"] == "OutcomeUnknown"
    assert pg_ledger.balance("team").held == ESTIMATE


def test_a_delivery_that_finds_a_live_lease_is_in_progress(
    exporter: InMemorySpanExporter, pg_ledger: Ledger, fake: FakeProvider
) -> None:
    pg_ledger.create_budget("team", 1_000_000)
    manager = OperationManager(pg_ledger.calls, DeliveryOptions(task="t"))
    seen: list[str] = []

    def run(scope: AttemptScope) -> Any:
        # another delivery of the same key while this run holds the lease
        try:
            manager.deliver(delivery("op-busy", lambda s: "never run"))
        except RetryLater as later:
            seen.append(later.why)
        return call(fake.openai_base_url, scope)

    manager.deliver(delivery("op-busy", run))
    assert seen == ["in_progress"]
    spans = exporter.get_finished_spans()
    inner, outer = named(spans, "budget_tasks.deliver")
    assert attrs(inner)["budget_tasks.decision"] == "in_progress"
    assert attrs(inner)["budget_tasks.outcome"] == "retry_later"
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert attrs(outer)["budget_tasks.decision"] == "admitted"
    assert attrs(outer)["budget_tasks.outcome"] == "ok"


def quick_start_task(ledger_url: str, budget: str, call: Callable[[], Any]) -> Any:
    """The Quick start's shape in eager mode: estimate 0, ``call`` (a guarded SDK call)
    its only billable request."""
    from celery import Celery

    from budget_tasks import BudgetTask

    app = Celery("quick-start-span", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=ledger_url
    )

    @app.task(base=BudgetTask, bind=True, budget=budget, estimate_cost=lambda: 0)
    def ask(self: BudgetTask) -> str:
        return str(call().id)

    return ask


def test_inside_the_anthropic_sdks_own_span_ours_keeps_the_money_and_not_the_tokens(
    exporter: InMemorySpanExporter, pg_ledger: Ledger, fake: FakeProvider, pg_url: str
) -> None:
    """The Anthropic SDK draws its own GenAI span around the request; ours, inside it,
    says what the call reserved and cost, its tokens under budget_tasks.usage: a sum
    of gen_ai.usage over the trace counts the call once."""
    from budget_tasks.transport import guarded_anthropic_client

    sdk_spans = TracerProvider()
    sdk_spans.add_span_processor(SimpleSpanProcessor(exporter))
    claude = guarded_anthropic_client(
        base_url=fake.url,
        api_key="sk-test",
        timeout=10,
        open_telemetry={"tracer_provider": sdk_spans},
    )
    pg_ledger.create_budget("team", 10_000_000)
    ask = quick_start_task(
        pg_url,
        "team",
        lambda: claude.messages.create(
            model="claude-3-5-haiku-latest",
            max_tokens=64,
            messages=[{"role": "user", "content": "one line on tides"}],
        ),
    )
    ask.delay().get()
    spans = exporter.get_finished_spans()
    [sdk] = [s for s in spans if s.name == "anthropic.messages.create"]
    [ours] = named(spans, "budget_tasks.call")
    assert ours.parent is not None and ours.parent.span_id == sdk.context.span_id
    billed = fake.state()["requests"][-1]["usage"]
    assert attrs(sdk)["gen_ai.usage.input_tokens"] == billed["input_tokens"] > 0
    assert not any(k.startswith("gen_ai.") for k in attrs(ours))
    assert attrs(ours)["budget_tasks.usage.output_tokens"] == billed["output_tokens"]
    assert attrs(ours)["budget_tasks.actual"] == pg_ledger.balance("team").spent > 0
    total = sum(attrs(s).get("gen_ai.usage.output_tokens", 0) for s in spans)
    assert total == billed["output_tokens"]  # once, not twice


def test_a_quick_start_run_refused_at_its_first_call_is_traced_denied(
    exporter: InMemorySpanExporter, pg_ledger: Ledger, fake: FakeProvider, pg_url: str
) -> None:
    from budget_tasks import BudgetExceeded
    from budget_tasks.transport import guarded_openai_client

    client = guarded_openai_client(base_url=fake.openai_base_url, api_key="sk-test", timeout=10)
    pg_ledger.create_budget("tiny", 10)
    ask = quick_start_task(
        pg_url,
        "tiny",
        lambda: client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
        ),
    )

    with pytest.raises(BudgetExceeded):
        ask.delay().get()
    spans = exporter.get_finished_spans()
    [deliver] = named(spans, "budget_tasks.deliver")
    assert attrs(deliver)["budget_tasks.decision"] == "denied"
    assert [s.name for s in spans if s.name.startswith("chat")] == []  # nothing sent
    assert fake.served() == []
