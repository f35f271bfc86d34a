"""Loaded by the tracing tests' worker (``-I``) beside worker_tasks: each pool process
sends its spans to the OpenTelemetry SDK's in-memory exporter, and a task hands back
what it holds. With ``BUDGET_TASKS_TEST_CELERY_OTEL=1`` the process also runs
opentelemetry-instrumentation-celery, whose task spans the deliveries nest under."""

from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_process_init
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers.app import app

EXPORTER = InMemorySpanExporter()


@worker_process_init.connect(weak=False)
def _trace(**_: Any) -> None:
    # in each pool process, as OpenTelemetry's docs ask of a prefork worker
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    if os.environ.get("BUDGET_TASKS_TEST_CELERY_OTEL") == "1":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument(tracer_provider=provider)


def _as_json(span: ReadableSpan) -> dict[str, Any]:
    context, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": context.trace_id if context else None,
        "span_id": context.span_id if context else None,
        "parent_id": parent.span_id if parent else None,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "events": [e.name for e in span.events],
    }


@app.task(name="tests.tracing.spans")
def spans() -> list[dict[str, Any]]:
    """Every span this pool process has finished, as JSON."""
    return [_as_json(s) for s in EXPORTER.get_finished_spans()]
