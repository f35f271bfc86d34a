"""budget-tasks: spend-safe Celery tasks for LLM work.

Reserve a conservative estimate in a ledger before any billable call, settle with the
provider's real usage, and replay instead of resending on redelivery.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    BudgetExceeded,
    BudgetExists,
    BudgetFrozen,
    BudgetTasksError,
    CapBelowCommitted,
    IdempotencyConflict,
    InvalidTransition,
    LedgerError,
    LedgerUnavailable,
    NotBilled,
    OperationFailed,
    OutcomeUnknown,
    PoisonMessage,
    SettlementConflict,
    SideEffectUncertain,
    UnknownAttempt,
    UnknownBudget,
)
from .ledger import Attempt, AuditFinding, Balance, BudgetInfo, Hold, Ledger, Reservation

if TYPE_CHECKING:
    from .task import BudgetTask

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # BudgetTask needs Celery; importing the ledger alone must not.
    if name == "BudgetTask":
        from .task import BudgetTask

        return BudgetTask
    raise AttributeError(f"module 'budget_tasks' has no attribute {name!r}")


__all__ = [
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetExceeded",
    "BudgetExists",
    "BudgetFrozen",
    "BudgetInfo",
    "BudgetTask",
    "BudgetTasksError",
    "CapBelowCommitted",
    "Hold",
    "IdempotencyConflict",
    "InvalidTransition",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "NotBilled",
    "OperationFailed",
    "OutcomeUnknown",
    "PoisonMessage",
    "Reservation",
    "SettlementConflict",
    "SideEffectUncertain",
    "UnknownAttempt",
    "UnknownBudget",
]
