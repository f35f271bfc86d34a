"""budget-tasks: spend-safe Celery tasks for LLM work.

Reserve a conservative estimate in a ledger before any billable call, settle with the
provider's real usage, and replay instead of resending on redelivery.
"""

from .errors import (
    BudgetExceeded,
    BudgetExists,
    BudgetFrozen,
    BudgetTasksError,
    IdempotencyConflict,
    InvalidTransition,
    LedgerError,
    LedgerUnavailable,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
)
from .ledger import Attempt, AuditFinding, Balance, BudgetInfo, Hold, Ledger, Reservation

__version__ = "0.1.0"

__all__ = [
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetExceeded",
    "BudgetExists",
    "BudgetFrozen",
    "BudgetInfo",
    "BudgetTasksError",
    "Hold",
    "IdempotencyConflict",
    "InvalidTransition",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "Reservation",
    "SettlementConflict",
    "UnknownAttempt",
    "UnknownBudget",
]
