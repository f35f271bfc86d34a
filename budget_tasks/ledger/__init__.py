"""The reservation ledger (SQL only; this package never imports Celery)."""

from .calls import CallLedger
from .operator import Ledger
from .oversight import OperationHistory
from .periods import Period, Renewal
from .records import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    BudgetReport,
    CallAdmission,
    CallAsk,
    CallEnd,
    CallFacts,
    Hold,
    JournalEntry,
    OperationEvent,
    PartitionInfo,
    Purged,
    Reservation,
    Resolved,
    Retained,
    SettledStats,
)
from .upkeep import Upkeep
from .views import Views

__all__ = [
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetInfo",
    "BudgetReport",
    "CallAdmission",
    "CallAsk",
    "CallEnd",
    "CallFacts",
    "CallLedger",
    "Hold",
    "JournalEntry",
    "Ledger",
    "OperationEvent",
    "OperationHistory",
    "PartitionInfo",
    "Period",
    "Purged",
    "Renewal",
    "Reservation",
    "Resolved",
    "Retained",
    "SettledStats",
    "Upkeep",
    "Views",
]
