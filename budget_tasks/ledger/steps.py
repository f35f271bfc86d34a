"""Labelled calls (``spend()`` blocks, calls through the guarded transport) and side
effects (``once()``) of an operation's run: each call its own attempt, admitted in one
transaction and settled with its stored result in another, replayed by position."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from .. import _validate as check
from . import statements as sql
from .base import Found
from .driver import Cursor
from .holds import CallPlan
from .operations import Operations, _decode, _operation_ref
from .records import AttemptRef, CallAdmission, CallAsk, CallEnd

__all__ = ["Steps"]

log = logging.getLogger("budget_tasks.ledger")


def _step_of(cur: Cursor, operation_id: int, step: str) -> tuple[AttemptRef | None, int]:
    row = cur.one(sql.STEP_ATTEMPT, {"operation_id": operation_id, "step": step})
    if row is None:
        return None, 0
    akey, state, amount, reason, answer, recorded, count = row
    return AttemptRef(akey, state, amount, reason, step, answer, recorded), int(count)


class Steps(Operations):
    """The labelled-call and side-effect methods of :class:`~budget_tasks.Ledger`."""

    def admit_call(
        self, operation_id: int, call: CallAsk, *, record: str, plan: CallPlan
    ) -> CallAdmission:
        """A labelled call's admission in one transaction, as the main call's is in
        :meth:`admit`: its stored answer if it completed before (under ``record``);
        else what its position holds (its latest attempt, how many it has had) and,
        where ``plan`` names the attempt to make, that attempt reserved, granted and
        described. A refusal raises and writes nothing."""
        check.row_id(operation_id, "operation_id")
        if call.step is None:
            raise ValueError("a labelled call names its step")
        check.text(record, "side effect name")
        chain = self._admission_chain(call.budget)
        step = call.step

        def admission(cur: Cursor, found: Found | None, now: datetime) -> CallAdmission:
            assert found is not None  # a chain has its periods
            stored = cur.one(sql.SIDE_EFFECT, {"operation_id": operation_id, "name": record})
            if stored is not None and stored[0] == "done":
                return CallAdmission(operation_id, stored=(stored[0], _decode(stored[1])))
            latest, count = _step_of(cur, operation_id, step)
            here = CallAdmission(operation_id, latest, count)
            return self._admit_call_in(cur, call, here, chain, found, now, plan)

        return self._admitting(chain, admission)

    def side_effect(self, operation_id: int, name: str) -> tuple[str, Any] | None:
        """``(state, result)`` of a side effect, or None if it never started."""
        with self._driver.transaction() as cur:
            row = cur.one(sql.SIDE_EFFECT, {"operation_id": operation_id, "name": name})
        if row is None:
            return None
        state, result = row
        return state, None if result is None else json.loads(result)

    def start_side_effect(self, operation_id: int, name: str) -> bool:
        """Claim the side effect; False if it was claimed before (done or not)."""
        check.text(name, "side effect name")
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            row = cur.one(
                sql.START_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "now": stamp},
            )
        return row is not None

    def finish_side_effect(self, operation_id: int, name: str, result: Any) -> None:
        encoded = self._kept(json.dumps(result))
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            cur.run(
                sql.FINISH_SIDE_EFFECT,
                {"operation_id": operation_id, "name": name, "result": encoded, "now": stamp},
            )

    def forget_side_effect(self, operation_id: int, name: str) -> None:
        """Drop a claim whose function raised, so that a later run may try again."""
        with self._driver.transaction() as cur:
            cur.run(sql.FORGET_SIDE_EFFECT, {"operation_id": operation_id, "name": name})

    def end_call(
        self,
        call: CallEnd,
        *,
        operation_id: int | str,
        owner: str,
        record: str | None = None,
        result: Any = None,
    ) -> bool:
        """Write what one ``call`` of ``owner``'s run came to, the main call or a
        labelled one, in one transaction; with ``record``, ``result`` is stored under
        it for replay. ``operation_id``: the operation's id, or its key where its
        admission's answer was lost before it had an id.

        A write kept through an outage may land after the run's lease moved on. A
        settlement lands all the same (it is what the provider billed: an attempt
        resolved meanwhile keeps the larger charge), and so does its result; a release
        or an unknown lands only while ``owner`` still holds the lease: once another
        run has taken the operation, that run or reconciliation decides the hold, and
        False is returned. False too where nothing changed."""
        where = _operation_ref(operation_id)
        check.text(owner, "lease owner")
        encoded = None if record is None else self._kept(json.dumps(result))
        stamp = self._driver.ts(self.now())
        with self._driver.transaction() as cur:
            row, ended = self._call_and_operation_in(cur, call, owner, stamp, **where)
            if ended is None:
                return False
            if record is not None:
                cur.run(
                    sql.STORE_SIDE_EFFECT,
                    {"operation_id": row.id, "name": record, "result": encoded, "now": stamp},
                )
            changed = self._apply_call(cur, ended)
        self._log_call(ended)
        return changed
