"""What happens to money, told to whoever listens: metrics, tracing, alerts.

The flow (tasks, beat, the CLI) calls :data:`hooks`; sinks subclass :class:`Hooks`,
override what they observe, and are added with :func:`add_sink`. The flow never
imports a sink, and a sink that raises is logged and never breaks the flow.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("budget_tasks.hooks")


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


_sinks: list[Hooks] = []
_sinks_lock = threading.Lock()


def add_sink(sink: Hooks) -> Hooks:
    """Start telling ``sink`` about every event in this process (once per sink)."""
    with _sinks_lock:
        if sink not in _sinks:
            _sinks.append(sink)
    return sink


def remove_sink(sink: Hooks) -> None:
    with _sinks_lock:
        if sink in _sinks:
            _sinks.remove(sink)


def sinks() -> tuple[Hooks, ...]:
    with _sinks_lock:
        return tuple(_sinks)


class _Fanout(Hooks):
    """Tells every sink; a sink's failure is logged, never raised into the flow."""

    def _tell(self, event: str, facts: dict[str, Any]) -> None:
        for sink in sinks():
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


#: What the flow calls: every added sink hears it.
hooks: Hooks = _Fanout()
