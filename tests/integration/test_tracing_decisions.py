"""The decisions a real worker rarely shows on demand, drawn in process: a call that
times out (its span ends ``unknown``), the next delivery held by that unknown outcome,
and a delivery that finds another one's live lease (``in_progress``, nested in the
span of the run it was made from). A PostgreSQL ledger, the official openai SDK
against the fake provider, the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import Iterator
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
