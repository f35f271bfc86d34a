"""The ledger's core: reserve before sending, settle with real usage.

No Celery here. Every method runs in one short transaction; a failure to reach the
database raises :class:`LedgerUnavailable` and writes nothing (fail closed). The core
is put together from its parts, one module each: budgets, holds, operations, steps
(labelled calls and side effects), maintenance, reports (and the views a dashboard
reads), oversight (an operator's view of operations), audits, retention, on a shared
base. Callers use it through its faces (see
:mod:`.faces`), each the API of one kind of caller.
"""

from __future__ import annotations

from .audits import Audits
from .base import CLOCK_AGREEMENT, CLOCK_CHECK_SECONDS, Clock
from .budgets import Budgets
from .maintenance import Maintenance
from .oversight import Oversight
from .reports import Views
from .retention import Retention
from .steps import Steps

__all__ = ["CLOCK_AGREEMENT", "CLOCK_CHECK_SECONDS", "Clock", "LedgerCore"]


class LedgerCore(Budgets, Maintenance, Steps, Oversight, Views, Audits, Retention):
    """Every method of a budget ledger on PostgreSQL or SQLite, behind its faces
    (:class:`~.faces.Ledger`, :class:`~.faces.CallLedger`, :class:`~.faces.Upkeep`).

    ``clock`` returns the current time as an aware datetime; tests pass their own to
    move between periods. ``server_functions=False`` sends a delivery's admission and
    a run's settlement on PostgreSQL statement by statement, as on SQLite, instead of
    as one server-side function call each (the same rows; a comparison baseline).
    """
