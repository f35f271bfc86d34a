"""Ledger writes that must land, kept back while the ledger is down: this process
writes them before its run's end or at its next delivery. Each carries the lease owner
it was made under, and the ledger checks it where that matters (see
:meth:`~budget_tasks.ledger.CallLedger.end_call`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BudgetTasksError, LedgerUnavailable
from ..ledger import CallLedger
from ..ledger.records import CallEnd
from .fates import HoldFate
from .scope import Recorded

log = logging.getLogger("budget_tasks.delivery")

#: Pauses between tries of a write that must land after a provider call.
PERSIST_DELAYS = (0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Write:
    """One ledger write kept back while the ledger was down."""

    name: str
    kwargs: dict[str, Any]

    def apply(self, ledger: CallLedger) -> Any:
        return getattr(ledger, self.name)(**self.kwargs)


#: (ledger URL, operation key, lease owner) -> the writes this process still owes. The
#: lease names this process, which is alive: no other delivery may run the operation
#: until the lease expires, so this process writes them at its next delivery instead.
_owed: dict[tuple[str, str, str], list[Write]] = {}
_owed_lock = threading.Lock()


#: How the log names each kind of write kept back.
_WRITTEN = {
    "finish_operation": "succeeded",
    "fail_operation": "failed",
    "end_run": "lease given back",
    "end_call": "a call's outcome",
}


def ledger_id(ledger: CallLedger) -> str:
    """Which ledger a write is owed to: its database, by URL."""
    return str(ledger.url)


def owe(ledger: CallLedger, key: str, owner: str, writes: list[Write]) -> None:
    """Keep ``writes`` back for operation ``key``, made under ``owner``'s lease."""
    with _owed_lock:
        _owed.setdefault((ledger_id(ledger), key, owner), []).extend(writes)


def catch_up(ledger: CallLedger) -> int:
    """Write what this process kept back while the ledger was down (holds to resolve,
    leases to give back, outcomes of calls that were answered); returns how many
    operations were written. Stops at the first LedgerUnavailable and keeps the rest."""
    if not _owed:
        return 0
    found = ledger_id(ledger)
    with _owed_lock:
        pending = [(k, v) for k, v in _owed.items() if k[0] == found]
    written = 0
    for slot, writes in pending:
        done: list[str] = []
        while writes:
            try:
                writes[0].apply(ledger)
            except LedgerUnavailable:
                return written
            except BudgetTasksError as exc:  # moved on since (an operator): theirs stands
                log.error("operation %s: dropped %s kept back: %s", slot[1], writes[0].name, exc)
            else:
                done.append(_WRITTEN.get(writes[0].name, writes[0].name))
            writes.pop(0)
        written += 1
        log.info("operation %s: wrote what the outage kept back (%s)", slot[1], ", ".join(done))
        with _owed_lock:
            if _owed.get(slot) is writes:
                del _owed[slot]
    return written


def persist(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a ledger write that must land, waiting out a short outage."""
    for delay in PERSIST_DELAYS:
        try:
            return fn(*args, **kwargs)
        except LedgerUnavailable:
            log.warning("ledger unavailable; retrying %s in %.1fs", fn.__name__, delay)
            time.sleep(delay)
    return fn(*args, **kwargs)


def owes(ledger: CallLedger) -> bool:
    """Whether this process keeps writes back for ``ledger``."""
    found = ledger_id(ledger)
    with _owed_lock:
        return any(slot[0] == found for slot in _owed)


def forget(ledger: CallLedger) -> None:
    """Drop what this process keeps back for ``ledger`` (tests that empty its tables)."""
    found = ledger_id(ledger)
    with _owed_lock:
        for slot in [slot for slot in _owed if slot[0] == found]:
            del _owed[slot]


def call_end(call: Recorded, fate: HoldFate) -> CallEnd:
    """What ``call`` came to, as the ledger writes it."""
    return CallEnd(
        call.attempt_key,
        fate.action,
        fate.actual,
        fate.estimate_only,
        fate.note or None,
        call.answered,
        fate.untrusted,
    )


def call_write(
    call: Recorded,
    fate: HoldFate,
    *,
    operation_id: int,
    owner: str,
    record: str | None = None,
    result: Any = None,
) -> Write:
    """The one write of what a call came to (the main call or a labelled one), made
    under ``owner``'s lease: kept through an outage, it still knows which run made it."""
    return end_call_write(
        call_end(call, fate), operation_id=operation_id, owner=owner, record=record, result=result
    )


def end_call_write(
    end: CallEnd,
    *,
    operation_id: int | str,
    owner: str,
    record: str | None = None,
    result: Any = None,
) -> Write:
    """The ledger's ``end_call`` of ``end`` as a write (see :func:`call_write`)."""
    kwargs: dict[str, Any] = {"call": end, "operation_id": operation_id, "owner": owner}
    if record is not None:
        kwargs.update(record=record, result=result)
    return Write("end_call", kwargs)


def end_write(
    operation: int | str, owner: str, status: str, error: str, next_reason: str | None = None
) -> Write:
    """Giving ``owner``'s lease on ``operation`` back (its id; its key where the
    admission's answer was lost), with why it runs next where that is kept."""
    ending = {"operation": operation, "owner": owner, "status": status, "error": error}
    return Write("end_run", {**ending, "next_reason": next_reason})


def unsent_write(key: str, operation: int | str, owner: str) -> Write:
    """Undoing a grant of ``key`` whose answer was lost: the run sent nothing under it
    (released if it committed and is still ``owner``'s, else nothing). ``operation``:
    its id, or its key where the admission's answer was lost before it had an id."""
    return end_call_write(CallEnd(key, "unsent"), operation_id=operation, owner=owner)
