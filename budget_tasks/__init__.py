"""budget-tasks: spend-safe Celery tasks for LLM work.

Reserve a conservative estimate in a ledger before any billable call, settle with the
provider's real usage, and replay instead of resending on redelivery.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from .errors import (
    AnswerNotKept,
    BudgetExceeded,
    BudgetExists,
    BudgetFrozen,
    BudgetTasksError,
    CallConflict,
    CannotReopen,
    CapBelowCommitted,
    IdempotencyConflict,
    InvalidTransition,
    LedgerConfigError,
    LedgerError,
    LedgerUnavailable,
    MissingApiKey,
    NotBilled,
    OperationFailed,
    OutcomeUnknown,
    PoisonMessage,
    ResendRefused,
    RetentionRefused,
    SchemaMissing,
    SettlementConflict,
    SideEffectUncertain,
    UnguardedCall,
    UnknownAttempt,
    UnknownBudget,
    UnusableApiKey,
)
from .ledger import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    CallFacts,
    Hold,
    Ledger,
    Reservation,
)

if _TYPE_CHECKING:
    from .task import BudgetTask
    from .wiring import configure

__version__ = "0.1.0"


def __getattr__(name: str) -> _Any:
    # BudgetTask and configure need Celery; importing the ledger alone must not.
    if name == "BudgetTask":
        from .task import BudgetTask

        return BudgetTask
    if name == "configure":
        from .wiring import configure

        return configure
    raise AttributeError(f"module 'budget_tasks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


__all__ = [
    "AnswerNotKept",
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetExceeded",
    "BudgetExists",
    "BudgetFrozen",
    "BudgetInfo",
    "BudgetTask",
    "BudgetTasksError",
    "CallConflict",
    "CallFacts",
    "CannotReopen",
    "CapBelowCommitted",
    "Hold",
    "IdempotencyConflict",
    "InvalidTransition",
    "Ledger",
    "LedgerConfigError",
    "LedgerError",
    "LedgerUnavailable",
    "MissingApiKey",
    "NotBilled",
    "OperationFailed",
    "OutcomeUnknown",
    "PoisonMessage",
    "ResendRefused",
    "Reservation",
    "RetentionRefused",
    "SchemaMissing",
    "SettlementConflict",
    "SideEffectUncertain",
    "UnguardedCall",
    "UnknownAttempt",
    "UnknownBudget",
    "UnusableApiKey",
    "configure",
]
