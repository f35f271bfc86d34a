"""OpenTelemetry traces of what budget-tasks does: another hooks sink, like metrics.

- one span per delivery, ``budget_tasks.deliver``, with its decision (``admitted``,
  ``replay``, ``in_progress``, ``denied``, ``unknown``, ``failed``, ``poisoned``,
  ``unavailable``), budget, operation key, main attempt key, estimate, and what its
  calls came to (reserved, actual, overrun);
- a child span per provider call (kind CLIENT, named ``chat gpt-4o-mini``) with the
  GenAI semantic-convention attributes: ``gen_ai.provider.name`` (and the older
  ``gen_ai.system``), ``gen_ai.operation.name``, ``gen_ai.request.model``,
  ``gen_ai.response.model``, ``gen_ai.response.id``, ``gen_ai.usage.input_tokens``
  (cache reads and writes included, as the conventions say), ``gen_ai.usage.output_tokens``
  and the cache and reasoning details;
- one span per beat job, ``budget_tasks.<job>``, with its counts.

Spans start in the current context, so a delivery nests under
opentelemetry-instrumentation-celery's task span when that is installed. Spans go to
the global TracerProvider (or the one given to :func:`install`); until an app sets
one, the API's no-op tracer makes them cost next to nothing. ``budget_tasks.configure``
installs this sink when the ``otel`` extra is installed (``BUDGET_TASKS_OTEL=0`` turns
it off; ``=1`` requires it). The flow never imports this module.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

from .hooks import Hooks, add_sink, remove_sink

DELIVER = "budget_tasks.deliver"
#: A Usage field -> the GenAI attribute it is (input_tokens is added up apart).
_USAGE_DETAILS = {
    "cached_input_tokens": "gen_ai.usage.cache_read.input_tokens",
    "reasoning_tokens": "gen_ai.usage.reasoning.output_tokens",
}
#: What a provider bills as input: its plain input, cache reads and cache writes.
_INPUT_PARTS = (
    "input_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "cache_write_1h_tokens",
)


@dataclass(frozen=True)
class _Open:
    """A span this sink made current, and how to give the context back."""

    name: str
    span: Span
    token: object


#: The delivery and beat spans open in this context, innermost last.
_open: ContextVar[tuple[_Open, ...]] = ContextVar("budget_tasks_spans", default=())


class TracingHooks(Hooks):
    """The hooks sink that draws spans (see the module)."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        # a proxy until the app sets a provider: spans go to whichever it sets later
        self._tracer = trace.get_tracer("budget_tasks", tracer_provider=tracer_provider)
        #: (attempt, send) -> its call's span, ended maybe in another thread (a stream)
        self._calls: dict[tuple[str, int], tuple[Span, bool]] = {}
        self._calls_lock = threading.Lock()

    # -- spans made current: a delivery, a beat job --------------------------------------

    def _enter(self, name: str, span_name: str, attributes: dict[str, Any]) -> None:
        span = self._tracer.start_span(span_name, attributes=attributes)
        token = otel_context.attach(trace.set_span_in_context(span))
        _open.set((*_open.get(), _Open(name, span, token)))

    def _top(self, name: str) -> Span | None:
        stack = _open.get()
        return stack[-1].span if stack and stack[-1].name == name else None

    def _leave(self, name: str) -> Span | None:
        """The innermost span opened as ``name``, no longer current (the caller ends
        it); spans opened inside it and never closed are ended first."""
        stack = _open.get()
        if not any(o.name == name for o in stack):
            return None
        while stack:
            *rest, last = stack
            stack = tuple(rest)
            _open.set(stack)
            otel_context.detach(last.token)  # type: ignore[arg-type]
            if last.name == name:
                return last.span
            last.span.end()
        return None

    def delivery_started(self, *, task: str, operation: str, budget: str) -> None:
        attributes = {
            "budget_tasks.task": task,
            "budget_tasks.operation.key": operation,
            "budget_tasks.budget": budget,
        }
        self._enter(f"delivery:{operation}", DELIVER, attributes)

    def delivery_decided(
        self,
        *,
        task: str,
        operation: str,
        decision: str,
        attempt: str | None = None,
        estimate: int | None = None,
    ) -> None:
        span = self._top(f"delivery:{operation}")
        if span is None:
            return
        span.set_attribute("budget_tasks.decision", decision)
        if attempt is not None:
            span.set_attribute("budget_tasks.attempt.key", attempt)
        if estimate is not None:
            span.set_attribute("budget_tasks.estimate", estimate)

    def delivery_ended(
        self,
        *,
        task: str,
        operation: str,
        outcome: str,
        reserved: int,
        actual: int,
        overrun: int,
        error: str | None = None,
    ) -> None:
        span = self._leave(f"delivery:{operation}")
        if span is None:
            return
        span.set_attributes(
            {
                "budget_tasks.outcome": outcome,
                "budget_tasks.reserved": reserved,
                "budget_tasks.actual": actual,
                "budget_tasks.overrun": overrun,
            }
        )
        if error is not None:
            span.set_attribute("error.type", error)
        if outcome == "error":
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def beat_started(self, *, job: str) -> None:
        self._enter(f"beat:{job}", f"budget_tasks.{job}", {"budget_tasks.job": job})

    def beat_ended(self, *, job: str, counts: Mapping[str, int], error: str | None = None) -> None:
        span = self._leave(f"beat:{job}")
        if span is None:
            return
        span.set_attributes({f"budget_tasks.count.{k}": int(v) for k, v in counts.items()})
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    # -- provider calls: children of the current span, ended wherever they end ------------

    def call_started(
        self,
        *,
        budget: str,
        attempt: str,
        send: int,
        amount: int,
        system: str | None,
        operation_name: str | None,
        model: str | None,
    ) -> None:
        attributes: dict[str, Any] = {
            "budget_tasks.budget": budget,
            "budget_tasks.attempt.key": attempt,
            "budget_tasks.send": send,
            "budget_tasks.estimate": amount,
        }
        # An SDK that draws its own GenAI span for the call (Anthropic's does) is the
        # call's span: ours, inside it, carries the money only, or every token total
        # that sums gen_ai.usage counts the call twice.
        inside_sdk = _is_gen_ai(trace.get_current_span())
        described = {"gen_ai.operation.name": operation_name, "gen_ai.request.model": model}
        attributes.update(_gen_ai(inside_sdk, system, described))
        # the conventions' span name: "{gen_ai.operation.name} {gen_ai.request.model}"
        words = () if inside_sdk else (operation_name, model)
        name = " ".join(p for p in words if p) or "budget_tasks.call"
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        with self._calls_lock:
            self._calls[(attempt, send)] = (span, inside_sdk)

    def call_ended(
        self,
        *,
        attempt: str,
        send: int,
        outcome: str,
        system: str | None = None,
        model: str | None = None,
        usage: Mapping[str, int] | None = None,
        actual: int | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
    ) -> None:
        with self._calls_lock:
            found = self._calls.pop((attempt, send), None)
        if found is None:
            return
        span, inside_sdk = found
        attributes: dict[str, Any] = {"budget_tasks.call.outcome": outcome}
        answered: dict[str, Any] = {
            "gen_ai.response.model": model,
            "gen_ai.response.id": response_id,
        }
        if usage is not None:
            answered.update(_usage_attributes(usage))
        attributes.update(_gen_ai(inside_sdk, system, answered))
        if request_id is not None:
            attributes["budget_tasks.request_id"] = request_id
        if actual is not None:
            attributes["budget_tasks.actual"] = actual
        span.set_attributes(attributes)
        if outcome in ("unknown", "untrusted"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()

    # -- money events, as events on the span they happen in -----------------------------

    def _event(self, name: str, **attributes: Any) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(f"budget_tasks.{name}", {k: v for k, v in attributes.items()})

    def denied(self, *, budget: str, reason: str, amount: int) -> None:
        self._event("denied", budget=budget, reason=reason, amount=amount)

    def unknown(self, *, task: str, attempt: str) -> None:
        self._event("unknown", attempt=attempt)

    def settled(self, *, budget: str, attempt: str, amount: int, actual: int, by: str) -> None:
        self._event("settled", budget=budget, attempt=attempt, amount=amount, actual=actual)

    def released(self, *, budget: str, attempt: str, amount: int, by: str) -> None:
        self._event("released", budget=budget, attempt=attempt, amount=amount)

    def stale(self, *, hold: Any) -> None:
        self._event("stale", budget=hold.budget, attempt=hold.key, amount=hold.amount)

    def reconciled(self, *, attempt: str, outcome: str) -> None:
        self._event("reconciled", attempt=attempt, outcome=outcome)

    def untrusted(self, *, budget: str, attempt: str, reason: str, by: str) -> None:
        self._event("untrusted", budget=budget, attempt=attempt, reason=reason)


def _gen_ai(inside_sdk: bool, system: str | None, found: Mapping[str, Any]) -> dict[str, Any]:
    """A call's GenAI attributes that are known (the provider's two names among them);
    inside an SDK's own GenAI span, which says them, under ``budget_tasks.`` instead."""
    named = {"gen_ai.provider.name": system, "gen_ai.system": system, **found}
    known = {k: v for k, v in named.items() if v is not None}
    if not inside_sdk:
        return known
    return {f"budget_tasks.{k.removeprefix('gen_ai.')}": v for k, v in known.items()}


def _is_gen_ai(span: Any) -> bool:
    """Whether ``span`` is a GenAI call's own span (an SDK's), by the conventions'
    operation attribute. A span this process cannot read is not one."""
    attributes = getattr(span, "attributes", None) or {}
    return "gen_ai.operation.name" in attributes


def _usage_attributes(usage: Mapping[str, int]) -> dict[str, int]:
    """A call's usage (Usage fields) as the GenAI attributes."""
    found = {
        "gen_ai.usage.input_tokens": sum(usage.get(k, 0) for k in _INPUT_PARTS),
        "gen_ai.usage.output_tokens": usage.get("output_tokens", 0),
    }
    writes = usage.get("cache_write_tokens", 0) + usage.get("cache_write_1h_tokens", 0)
    if writes:
        found["gen_ai.usage.cache_creation.input_tokens"] = writes
    for name, attribute in _USAGE_DETAILS.items():
        if usage.get(name):
            found[attribute] = usage[name]
    return found


_installed: TracingHooks | None = None
_install_lock = threading.Lock()


def install(tracer_provider: TracerProvider | None = None) -> TracingHooks:
    """Start drawing spans in this process (once; ``tracer_provider``: where they go,
    else the global one, set now or later)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = TracingHooks(tracer_provider)
            add_sink(_installed)
        return _installed


def uninstall() -> None:
    """Stop drawing spans in this process."""
    global _installed
    with _install_lock:
        if _installed is not None:
            remove_sink(_installed)
            _installed = None


__all__ = ["TracingHooks", "install", "uninstall"]
