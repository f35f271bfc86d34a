"""The tracing sink on its own (the real-worker tests are in
tests/integration/test_tracing.py): spans nest in the current context, a call ended
in another thread stays its delivery's child, the GenAI usage counts every input
token, and the library works without the ``otel`` extra."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from budget_tasks.hooks import Hooks, add_sink, hooks, remove_sink
from budget_tasks.tracing import TracingHooks
from budget_tasks.wiring import _install_tracing


@pytest.fixture
def traced() -> Iterator[tuple[TracingHooks, InMemorySpanExporter, trace.Tracer]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = add_sink(TracingHooks(provider))
    assert isinstance(sink, TracingHooks)
    yield sink, exporter, provider.get_tracer("test")
    remove_sink(sink)


def test_a_call_ended_in_another_thread_is_a_child_of_its_delivery(
    traced: tuple[TracingHooks, InMemorySpanExporter, trace.Tracer],
) -> None:
    _, exporter, tracer = traced
    with tracer.start_as_current_span("celery task") as outer:
        hooks.delivery_started(task="t", operation="op", budget="b")
        hooks.call_started(
            budget="b",
            attempt="op#1",
            send=1,
            amount=500,
            system="anthropic",
            operation_name="chat",
            model="claude-x",
        )
        usage = {
            "input_tokens": 10,
            "cached_input_tokens": 5,
            "cache_write_tokens": 2,
            "output_tokens": 7,
        }
        # a stream read to its end by another thread reports there
        ended = threading.Thread(
            target=lambda: hooks.call_ended(
                attempt="op#1", send=1, outcome="answered", usage=usage, actual=420
            )
        )
        ended.start()
        ended.join()
        hooks.delivery_decided(task="t", operation="op", decision="admitted", attempt="op#1")
        hooks.delivery_ended(
            task="t",
            operation="op",
            outcome="error",
            reserved=500,
            actual=420,
            overrun=0,
            error="ValueError",
        )
        assert trace.get_current_span() is outer  # the context is given back
    call, delivery, task = exporter.get_finished_spans()
    assert call.parent is not None and delivery.parent is not None
    assert call.parent.span_id == delivery.context.span_id
    assert delivery.parent.span_id == task.context.span_id
    assert call.attributes is not None and delivery.attributes is not None
    assert call.attributes["gen_ai.usage.input_tokens"] == 17  # cache reads and writes too
    assert call.attributes["gen_ai.usage.cache_read.input_tokens"] == 5
    assert call.attributes["gen_ai.usage.cache_creation.input_tokens"] == 2
    assert call.attributes["gen_ai.usage.output_tokens"] == 7
    assert delivery.attributes["budget_tasks.decision"] == "admitted"
    assert delivery.status.status_code is trace.StatusCode.ERROR


def test_a_sink_that_raises_never_reaches_the_flow(
    traced: tuple[TracingHooks, InMemorySpanExporter, trace.Tracer],
) -> None:
    class Broken(Hooks):
        def delivery_started(self, **_: object) -> None:
            raise RuntimeError("a broken exporter")

    broken = add_sink(Broken())
    try:
        hooks.delivery_started(task="t", operation="op2", budget="b")
        hooks.delivery_ended(
            task="t", operation="op2", outcome="ok", reserved=0, actual=0, overrun=0
        )
    finally:
        remove_sink(broken)
    [delivery] = traced[1].get_finished_spans()  # the other sinks heard it all
    assert delivery.name == "budget_tasks.deliver"


def test_budget_tasks_otel_turns_the_sink_off_or_requires_it() -> None:
    assert _install_tracing({"BUDGET_TASKS_OTEL": "0"}) is False
    assert _install_tracing({"BUDGET_TASKS_OTEL": "1"}) is True


WITHOUT_OTEL = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(name)
sys.meta_path.insert(0, Absent())
import os
from celery import Celery
import budget_tasks
from budget_tasks.hooks import sinks
budget_tasks.configure(Celery("x", set_as_current=False))
print(sorted(type(s).__name__ for s in sinks()))
os.environ["BUDGET_TASKS_OTEL"] = "1"
try:
    budget_tasks.configure(Celery("y", set_as_current=False))
except RuntimeError as exc:
    print(exc)
"""


def test_the_library_works_without_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "['PrometheusHooks', 'SignalHooks']"  # no tracing sink
    assert "pip install 'budget-tasks[otel]'" in out[1]
