"""The reservation ledger (SQL only; this package never imports Celery)."""

from .calls import CallLedger
from .operator import Ledger
from .oversight import OperationHistory
from .periods import Period
from .records import (
    Attempt,
    AuditFinding,
    Balance,
    BudgetInfo,
    BudgetReport,
    CallFacts,
    Hold,
    Reservation,
)
from .upkeep import Upkeep
from .views import Views

__all__ = [
    "Attempt",
    "AuditFinding",
    "Balance",
    "BudgetInfo",
    "BudgetReport",
    "CallFacts",
    "CallLedger",
    "Hold",
    "Ledger",
    "OperationHistory",
    "Period",
    "Reservation",
    "Upkeep",
    "Views",
]
