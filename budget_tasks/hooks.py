"""What happens to money, told to whoever listens: metrics, tracing, alerts.

The flow (tasks, beat, the CLI) calls :data:`hooks`; sinks subclass :class:`Hooks`,
override what they observe, and are added with :func:`add_sink`. The flow never
imports a sink, and a sink that raises is logged and never breaks the flow.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("budget_tasks.hooks")


#: What a refusal's ``reason`` may be, a reconciliation's ``outcome``, and who found an
#: answer untrusted (``by``): the labels the metrics keep, each known before its first event.
DENIAL_REASONS = ("exceeded", "frozen")
RECONCILE_OUTCOMES = ("found", "not_found", "pending", "unknowable", "untrusted", "failed")
UNTRUSTED_BY = ("task", "reconcile")
RATE_LIMITED_BY = ("ledger", "provider")


class Hooks:
    """No-op base class of every sink: override the events you want."""

    def admitted(self, *, budget: str, attempt: str, amount: int) -> None:
        """A hold of ``amount`` was placed for ``attempt``."""

    def denied(self, *, budget: str, reason: str, amount: int) -> None:
        """Admission refused by ``budget``: ``reason`` is ``exceeded`` or ``frozen``."""

    def replayed(self, *, task: str, operation: str) -> None:
        """A delivery was answered from the operation's stored result."""

    def unknown(self, *, task: str, attempt: str) -> None:
        """An attempt's outcome became unknown: its hold stays."""

    def settled(self, *, budget: str, attempt: str, amount: int, actual: int, by: str) -> None:
        """A hold of ``amount`` was replaced by the charge ``actual``; ``by`` is who
        settled it: ``task``, ``reconcile`` or ``operator``."""

    def released(self, *, budget: str, attempt: str, amount: int, by: str) -> None:
        """A hold was dropped without a charge (the call was certainly not billed)."""

    def stale(self, *, hold: Any) -> None:
        """A hold was flagged stale (a :class:`~budget_tasks.Hold`)."""

    def reconciled(self, *, attempt: str, outcome: str) -> None:
        """A provider lookup of an unknown attempt answered ``outcome`` (found,
        not_found, pending, unknowable, untrusted, failed)."""

    def untrusted(self, *, budget: str, attempt: str, reason: str, by: str) -> None:
        """An answer reported usage past what its request allowed, or a cost past the
        ledger's ceiling (``reason``): it was not charged, its hold stays ``unknown``
        for an operator. ``by`` is who read the answer: ``task`` or ``reconcile``.
        Alert on it: a provider or a gateway in front of it answered falsely."""

    def drift_checked(self, *, report: Any) -> None:
        """The ledger was compared with a vendor's usage and cost reports (a
        :class:`~budget_tasks.drift.DriftReport`; ``report.drifted`` are the lines
        beyond the thresholds)."""

    def rate_limited(self, *, provider: str, scope: str, kind: str, wait: float, by: str) -> None:
        """A call waits for a rate limit: ``by`` ``ledger``, a window of ``scope`` was
        full and the call was booked ``wait`` seconds ahead; ``provider``, the provider
        answered 429 (``wait``: its retry-after, 0 where it gave none)."""

    # -- a delivery's life, a provider call's, a beat job's (what tracing draws) --------
    # Told from the one place that knows each: the delivery flow (delivery/told.py) and
    # the beat jobs. Every delivery_started is followed by one delivery_ended in the same
    # thread and context; every call_started by one call_ended (maybe in another thread:
    # a stream read elsewhere), matched by ``attempt`` and ``send``.

    def delivery_started(self, *, task: str, operation: str, budget: str) -> None:
        """A delivery of ``operation`` began (before the ledger is read)."""

    def delivery_decided(
        self,
        *,
        task: str,
        operation: str,
        decision: str,
        attempt: str | None = None,
        estimate: int | None = None,
    ) -> None:
        """What the delivery's admission decided: ``admitted`` (``attempt``, the main
        call, granted its send at ``estimate``), ``replay``, ``in_progress``, ``denied``,
        ``unknown`` (an earlier attempt's outcome holds the operation), ``failed``,
        ``poisoned`` or ``unavailable`` (the ledger did not answer)."""

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
        """The delivery ended: ``outcome`` is ``ok``, ``retry_later`` or ``error``
        (``error`` names the exception). ``reserved``, ``actual`` and ``overrun`` add
        up the holds this delivery's calls came to (main and labelled): what they
        reserved, what was charged, and the charge above their reservations."""

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
        """A provider call was granted its send under ``attempt`` (its ``send``-th:
        an attempt reported may send again), whose hold is ``amount``. ``system``
        (``openai``), ``operation_name`` (``chat``) and ``model`` where known before."""

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
        """The call came back: ``outcome`` is ``answered`` (its ``usage``, token
        counts by :class:`~budget_tasks.pricing.Usage` field, priced at ``actual``),
        ``reported`` (only a cost was recorded), ``awaiting_usage``, ``untrusted``, or,
        where an error ended it, what its hold became: ``settled``, ``released``,
        ``unknown``. ``model`` is the one that answered, where known."""

    def beat_started(self, *, job: str) -> None:
        """A beat job (``flag_stale_holds``, ``reconcile_unknown``, ...) began."""

    def beat_ended(self, *, job: str, counts: Mapping[str, int], error: str | None = None) -> None:
        """A beat job ended with ``counts`` (what it did, by name), or raised ``error``."""


#: replaced whole, never changed in place: every event reads it without a lock
_sinks: tuple[Hooks, ...] = ()
_sinks_lock = threading.Lock()


def add_sink(sink: Hooks) -> Hooks:
    """Start telling ``sink`` about every event in this process (once per sink)."""
    global _sinks
    with _sinks_lock:
        if sink not in _sinks:
            _sinks = (*_sinks, sink)
    return sink


def remove_sink(sink: Hooks) -> None:
    global _sinks
    with _sinks_lock:
        _sinks = tuple(s for s in _sinks if s is not sink)


def sinks() -> tuple[Hooks, ...]:
    return _sinks


class _Fanout(Hooks):
    """Tells every sink; a sink's failure is logged, never raised into the flow."""

    def _tell(self, event: str, facts: dict[str, Any]) -> None:
        for sink in _sinks:
            try:
                getattr(sink, event)(**facts)
            except Exception:
                log.exception("hook sink %r failed on %s", sink, event)

    def admitted(self, **facts: Any) -> None:
        self._tell("admitted", facts)

    def denied(self, **facts: Any) -> None:
        self._tell("denied", facts)

    def replayed(self, **facts: Any) -> None:
        self._tell("replayed", facts)

    def unknown(self, **facts: Any) -> None:
        self._tell("unknown", facts)

    def settled(self, **facts: Any) -> None:
        self._tell("settled", facts)

    def released(self, **facts: Any) -> None:
        self._tell("released", facts)

    def stale(self, **facts: Any) -> None:
        self._tell("stale", facts)

    def reconciled(self, **facts: Any) -> None:
        self._tell("reconciled", facts)

    def untrusted(self, **facts: Any) -> None:
        self._tell("untrusted", facts)

    def drift_checked(self, **facts: Any) -> None:
        self._tell("drift_checked", facts)

    def rate_limited(self, **facts: Any) -> None:
        self._tell("rate_limited", facts)

    def delivery_started(self, **facts: Any) -> None:
        self._tell("delivery_started", facts)

    def delivery_decided(self, **facts: Any) -> None:
        self._tell("delivery_decided", facts)

    def delivery_ended(self, **facts: Any) -> None:
        self._tell("delivery_ended", facts)

    def call_started(self, **facts: Any) -> None:
        self._tell("call_started", facts)

    def call_ended(self, **facts: Any) -> None:
        self._tell("call_ended", facts)

    def beat_started(self, **facts: Any) -> None:
        self._tell("beat_started", facts)

    def beat_ended(self, **facts: Any) -> None:
        self._tell("beat_ended", facts)


#: What the flow calls: every added sink hears it.
hooks: Hooks = _Fanout()
