"""The delivery's one voice to the hooks: every event a delivery reports about money
is said here, once, whichever call (the main one or a labelled one) it concerns."""

from __future__ import annotations

from ..errors import BudgetExceeded, BudgetFrozen
from ..hooks import Hooks
from .fates import HoldFate


class Told:
    """Tells ``sink`` what the deliveries of ``task`` did."""

    def __init__(self, sink: Hooks, task: str) -> None:
        self._sink = sink
        self._task = task

    def admitted(self, budget: str, attempt: str, amount: int) -> None:
        self._sink.admitted(budget=budget, attempt=attempt, amount=amount)

    def denied(self, exc: BudgetExceeded | BudgetFrozen, amount: int) -> None:
        reason = "exceeded" if isinstance(exc, BudgetExceeded) else "frozen"
        self._sink.denied(budget=exc.budget, reason=reason, amount=amount)

    def replayed(self, operation: str) -> None:
        self._sink.replayed(task=self._task, operation=operation)

    def unknown(self, attempt: str) -> None:
        self._sink.unknown(task=self._task, attempt=attempt)

    def ended(self, budget: str, attempt: str, amount: int, fate: HoldFate) -> None:
        """What a call's hold came to."""
        if fate.untrusted:
            self._sink.untrusted(budget=budget, attempt=attempt, reason=fate.note, by="task")
        if fate.action == "unknown":
            self.unknown(attempt)
        elif fate.action == "settle":
            self._sink.settled(
                budget=budget, attempt=attempt, amount=amount, actual=fate.actual, by="task"
            )
        else:
            self._sink.released(budget=budget, attempt=attempt, amount=amount, by="task")
