"""The reservation ledger (SQL only; this package never imports Celery)."""

from .core import Ledger
from .periods import PERIODS, RENEWALS, Period, Renewal, period_start
from .records import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    BudgetReport,
    CallEnd,
    CallFacts,
    Hold,
    Reservation,
    Resolved,
)

__all__ = [
    "PERIODS",
    "RENEWALS",
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetInfo",
    "BudgetReport",
    "CallEnd",
    "CallFacts",
    "Hold",
    "Ledger",
    "Period",
    "Renewal",
    "Reservation",
    "Resolved",
    "period_start",
]
