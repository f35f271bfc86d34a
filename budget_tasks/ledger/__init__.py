"""The reservation ledger (SQL only; this package never imports Celery)."""

from .faces import CallLedger, Ledger, Upkeep
from .oversight import OperationHistory
from .periods import PERIODS, RENEWALS, Period, Renewal, period_start
from .records import (
    Attempt,
    AttemptRef,
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
    Purged,
    Reservation,
    Resolved,
)

__all__ = [
    "PERIODS",
    "RENEWALS",
    "Attempt",
    "AttemptRef",
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
    "Period",
    "Purged",
    "Renewal",
    "Reservation",
    "Resolved",
    "Upkeep",
    "period_start",
]
