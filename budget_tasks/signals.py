"""Celery signals for what the ledger decides, to alert on in Celery's own way::

    from budget_tasks.signals import budget_denied

    @budget_denied.connect
    def page(sender, budget, reason, amount, **kw): ...

They are sent by a hooks sink that ``budget_tasks.configure(app)`` installs (importing
this module installs it too), in the process where the event happened: a worker's
pool process for a delivery, the worker that runs the beat job for a stale hold. A
receiver that raises is logged by Celery and never breaks a task.
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

from .hooks import Hooks, add_sink

__all__ = [
    "answer_untrusted",
    "budget_denied",
    "delivery_replayed",
    "drift",
    "outcome_unknown",
    "rate_limited",
    "stale_hold",
]

#: A reservation refused: ``sender`` is the budget that refused; ``budget``, ``reason``
#: (``exceeded`` or ``frozen``), ``amount``.
budget_denied = Signal(name="budget_tasks.budget_denied")
#: A delivery answered from its operation's stored result (no call, no charge):
#: ``sender`` is the task's name; ``task``, ``operation``.
delivery_replayed = Signal(name="budget_tasks.delivery_replayed")
#: An attempt's outcome became unknown (its hold stays for reconciliation): ``sender``
#: is the task's name; ``task``, ``attempt``.
outcome_unknown = Signal(name="budget_tasks.outcome_unknown")
#: An answer's usage was past what its request allowed: not charged, held unknown for
#: an operator: ``budget``, ``attempt``, ``reason``, ``by`` (``task`` or ``reconcile``).
answer_untrusted = Signal(name="budget_tasks.answer_untrusted")
#: Sent once per hold when beat flags it stale, with ``hold=`` (a Hold).
stale_hold = Signal(name="budget_tasks.stale_hold")
#: A drift check found lines beyond its thresholds: ``sender`` is the provider's name;
#: ``report`` (a DriftReport), ``lines`` (the drifted DriftLines).
drift = Signal(name="budget_tasks.drift")
#: a call waits for a rate limit (``by``: ``ledger``, its window was full and it was
#: booked ahead; ``provider``, a 429): provider, scope, kind, wait (seconds), by
rate_limited = Signal(name="budget_tasks.rate_limited")


class SignalHooks(Hooks):
    """The hooks sink that sends the signals above."""

    def denied(self, *, budget: str, reason: str, amount: int) -> None:
        budget_denied.send(sender=budget, budget=budget, reason=reason, amount=amount)

    def replayed(self, *, task: str, operation: str) -> None:
        delivery_replayed.send(sender=task, task=task, operation=operation)

    def unknown(self, *, task: str, attempt: str) -> None:
        outcome_unknown.send(sender=task, task=task, attempt=attempt)

    def untrusted(self, *, budget: str, attempt: str, reason: str, by: str) -> None:
        answer_untrusted.send(sender=by, budget=budget, attempt=attempt, reason=reason, by=by)

    def drift_checked(self, *, report: Any) -> None:
        if report.drifted:
            drift.send(sender=report.provider, report=report, lines=report.drifted)

    def stale(self, *, hold: Any) -> None:
        stale_hold.send(sender="flag_stale_holds", hold=hold)

    def rate_limited(self, *, provider: str, scope: str, kind: str, wait: float, by: str) -> None:
        rate_limited.send(sender=provider, scope=scope, kind=kind, wait=wait, by=by)


#: The one signals sink of this process: importing this module installs it.
SINK = add_sink(SignalHooks())
