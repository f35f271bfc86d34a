"""Parity of the two paths on PostgreSQL: a delivery's admission and a run's settlement
as one server-side function call each (``budget_tasks.ledger.functions``), and as the
statements alone (``server_functions=False``, SQLite's path). A hypothesis state
machine drives two ledgers, one of each, each on its own database, with the same
operations at the same clock: first deliveries, redeliveries (replays, other owners,
another request under the same key), settlements (under, at and over the hold, by the
run and by a run whose lease moved on), failures that release, freezes, period changes
and grant returns, on budgets alone, under a parent, escrowed and sliced. Every answer
and every row (by natural key: ids may differ where a declined function used a
sequence value) must be the same; the function path must have run, and declined, in
the run.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from budget_tasks import Ledger
from budget_tasks.errors import BudgetTasksError
from budget_tasks.ledger.driver import Declined
from budget_tasks.ledger.functions import FUNCTION_NAMES
from budget_tasks.ledger.records import (
    Answered,
    CallAdmission,
    CallAsk,
    CallEnd,
    CallFacts,
    RateAsk,
    RateClaim,
    RateSeen,
    SettledCall,
)
from budget_tasks.migrations import upgrade
from budget_tasks.testing import ManualClock

from ..services import check_postgres, pg_conninfo, scratch_database

# name -> (cap, period, parent, renewal, escrow, slices), in creation (= budget id) order
BUDGETS: dict[str, tuple[int, str, str | None, str, bool, int]] = {
    "org": (400, "none", None, "reset", False, 1),
    "team": (150, "day", "org", "rollover", False, 1),
    "crew": (120, "day", "org", "reset", True, 1),
    "solo": (100, "week", None, "reset", False, 1),
    "pool": (200, "day", None, "rollover", False, 3),
}
NAMES = list(BUDGETS)
OWNERS = ("w1", "w2")
#: what an answer said: ids, vendor, key hint and tokens, written with the settlement
SAID = Answered(
    "req_1",
    "resp_1",
    "openai",
    "sk-abc...wxyz",
    120,
    30,
    "gpt-4o-mini-2024-07-18",
    counted=RateAsk(1, 150),
)

#: What the function path did over the whole run, counted by the instrumented driver.
SEEN = {"ran": 0, "declined": 0}

# Each table's rows by natural key (ids replaced by what they name), of one run's prefix.
DUMPS = {
    "budgets": """
        SELECT b.name, b.cap, b.period, b.renewal, b.rollover_ceiling, b.frozen, b.escrow,
               b.slices, p.name, s.name
        FROM budgets b LEFT JOIN budgets p ON p.id = b.parent_id
        LEFT JOIN budgets s ON s.id = b.slice_of
        WHERE b.name LIKE %(prefix)s ORDER BY b.name""",
    "periods": """
        SELECT b.name, p.period_start, p.cap, p.spent, p.held, p.overrun, p.carried_out,
               p.closed_at, p.granted, p.drawn, p.drawn_at
        FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
        WHERE b.name LIKE %(prefix)s ORDER BY b.name, p.period_start""",
    "operations": """
        SELECT key, fingerprint, task, payload, status, result, error, lease_owner,
               lease_expires_at, runs, deliveries, replays, created_at, updated_at,
               completed_at, next_reason
        FROM operations WHERE key LIKE %(prefix)s ORDER BY key""",
    "attempts": """
        SELECT a.key, b.name, p.period_start, a.fingerprint, a.reason, a.amount, a.actual,
               a.state, a.price_version, o.key, a.label, a.step, a.created_at, a.sending_at,
               a.resolved_at, a.note, a.estimate_only, a.answer, a.request_id, a.response_id,
               a.lookup, a.model, a.timeout_ms, a.request_digest, a.input_bound,
               a.output_bound, a.recorded_actual, a.provider, a.credential, a.input_tokens,
               a.output_tokens, a.answered_by
        FROM attempts a JOIN budgets b ON b.id = a.budget_id
        JOIN budget_periods p ON p.id = a.period_id
        LEFT JOIN operations o ON o.id = a.operation_id
        WHERE a.key LIKE %(prefix)s ORDER BY a.key""",
    # in the order written (ids may have gaps where a function declined, never swaps)
    "journal": """
        SELECT a.key, b.name, j.period_start, j.kind, j.held_delta, j.spent_delta,
               j.drawn_delta, j.granted_delta, j.cap_delta, j.note, j.ref, j.created_at,
               j.actor
        FROM journal j JOIN budget_periods p ON p.id = j.period_id
        JOIN budgets b ON b.id = p.budget_id
        LEFT JOIN attempts a ON a.id = j.attempt_id
        WHERE b.name LIKE %(prefix)s ORDER BY j.id""",
    # each machine's windows are its own provider's (named after its prefix)
    "rate_windows": """
        SELECT scope, kind, per_minute, level, refilled_ms, booked, vtime, arrivals
        FROM rate_windows WHERE provider LIKE %(prefix)s ORDER BY scope, kind""",
    "rate_takes": """
        SELECT t.key, w.scope, w.kind, t.taken, t.back_ms, t.own, t.tag, t.arrival
        FROM rate_takes t
        JOIN rate_windows w ON w.id = t.window_id
        WHERE t.key LIKE %(prefix)s ORDER BY t.key, w.scope, w.kind""",
    "side_effects": """
        SELECT o.key, s.name, s.state, s.result, s.created_at, s.completed_at
        FROM side_effects s JOIN operations o ON o.id = s.operation_id
        WHERE o.key LIKE %(prefix)s ORDER BY o.key, s.name""",
}


def _counted(ledger: Ledger) -> None:
    """Count what the function path does on this ledger (an instrument on the real
    driver: every call still goes to PostgreSQL)."""
    driver = ledger._store.driver
    call = driver.call

    def counting(statement: str, params: Any) -> Any:
        try:
            row = call(statement, params)
        except Declined as declined:
            SEEN["declined"] += 1
            code = f"declined {declined.sqlstate}"
            SEEN[code] = SEEN.get(code, 0) + 1
            raise
        SEEN["ran"] += 1
        return row

    driver.call = counting  # type: ignore[method-assign]


class ParityMachine(RuleBasedStateMachine):
    urls: tuple[str, str]

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.prefix = uuid.uuid4().hex[:8] + "-"
        self.ledgers = [
            Ledger(url, clock=self.clock, server_functions=one_call)
            for url, one_call in zip(self.urls, (True, False), strict=True)
        ]
        _counted(self.ledgers[0])
        for ledger in self.ledgers:
            for name, (cap, period, parent, renewal, escrow, slices) in BUDGETS.items():
                ledger.create_budget(
                    self.prefix + name,
                    cap,
                    period=period,  # type: ignore[arg-type]
                    parent=None if parent is None else self.prefix + parent,
                    renewal=renewal,
                    escrow=escrow,
                    slices=slices,
                )
        # rate windows the granted calls take from: small enough to fill and book
        self.provider = self.prefix + "openai"
        for ledger in self.ledgers:
            ledger.rates.set_limit(self.provider, "m-1", "requests", 4)
            ledger.rates.set_limit(self.provider, "*", "tokens", 1_500)
        self.count = 0
        self.side = 0
        #: operation key -> its id in each ledger (ids may differ: not compared)
        self.ids: dict[str, list[int]] = {}
        #: operation key -> (budget, owner of its last run, its main call's attempt keys)
        self.ops: dict[str, tuple[str, str, list[str]]] = {}
        self.step = 0
        #: the keys of reservations alone
        self.reserved: list[str] = []

    def teardown(self) -> None:
        for ledger in self.ledgers:
            ledger.dispose()

    def both(self, act: Any) -> Any:
        """``act(ledger)`` on each ledger, the same random choices (a sliced budget's
        slice) for each; their answers, which must be the same."""
        self.step += 1
        answers = []
        for side, ledger in enumerate(self.ledgers):
            random.seed(self.step)
            self.side = side
            try:
                answers.append(("ok", act(ledger)))
            except BudgetTasksError as exc:  # the typed errors are part of what must match
                answers.append((type(exc).__name__, str(exc)))
        assert answers[0] == answers[1]
        if answers[0][0] == "RateWindowFull":
            SEEN["booked"] += 1
        return answers[0]

    def now_ms(self) -> int:
        return int(self.clock().timestamp() * 1000)

    def claim(self, amount: int) -> RateClaim:
        """A granted call's rate claim: a request, and tokens as its amount goes."""
        return RateClaim(self.provider, ("m-1", "*"), RateAsk(1, amount * 5), own=("m-1",))

    def plan_for(self, key: str) -> Any:
        """The plan a BudgetTask's delivery gives (``CallPath._at_once``)."""

        def plan(here: CallAdmission) -> tuple[str, str] | None:
            latest = here.latest
            if here.others_open or (latest is not None and latest.state != "released"):
                return None
            return f"{key}:call:{here.count}", "first" if latest is None else "retry"

        return plan

    # -- rules ---------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), amount=st.integers(0, 160), owner=st.sampled_from(OWNERS))
    def deliver(self, name: str, amount: int, owner: str) -> None:
        self.count += 1
        self.redeliver_as(f"{self.prefix}op{self.count}", name, amount, owner, "f")

    @rule(
        name=st.sampled_from(NAMES),
        amount=st.integers(0, 160),
        actual=st.integers(0, 200),
        owner=st.sampled_from(OWNERS),
    )
    def deliver_and_finish(self, name: str, amount: int, actual: int, owner: str) -> None:
        """The common case: a first delivery whose run settles its call and ends."""
        self.deliver(name, amount, owner)
        key = f"{self.prefix}op{self.count}"
        if self.ops.get(key, (None, None, []))[2]:
            self.finish_as(key, actual, True)

    @rule(
        name=st.sampled_from(NAMES),
        amount=st.integers(0, 160),
        actual=st.integers(0, 200),
        owner=st.sampled_from(OWNERS),
    )
    def deliver_with_its_first_call(self, name: str, amount: int, actual: int, owner: str) -> None:
        """The Quick start's run: a first delivery whose main call reserves nothing,
        admitted with its first labelled call (no main attempt), that call settled with
        the run's end and its answer stored for replay."""
        self.count += 1
        key = f"{self.prefix}op{self.count}"
        step = f"{key}:openai.chat:1"
        facts = CallFacts(
            lookup="resp", model="m-1", timeout=30, request="e" * 64, rate=self.claim(amount)
        )
        labelled = CallAsk(
            self.prefix + name,
            amount,
            fingerprint=f"req-{amount}",
            price_version="v1",
            facts=facts,
            label="openai.chat",
            step=step,
        )
        main = CallAsk(self.prefix + name, 0, fingerprint="req-0", price_version="v1")
        record = "spend:openai.chat:1"

        def first_plan(here: CallAdmission) -> tuple[str, str] | None:
            return (step, "first") if here.latest is None else None

        def admit(ledger: Ledger) -> Any:
            start = ledger.calls.admit(
                key,
                fingerprint="f",
                owner=owner,
                lease=timedelta(minutes=10),
                max_runs=3,
                task="parity",
                payload={"n": amount},
                call=main,
                plan=self.plan_for(key),
                first=(labelled, record, first_plan),
            )
            self.ids.setdefault(key, [0, 0])[self.side] = start.operation_id
            made = None if start.first is None else start.first.reservation
            return (
                start.decision.value,
                start.call,
                start.created,
                None if made is None else (made.key, made.budget, made.amount, made.state),
            )

        kind, answer = self.both(admit)
        if kind != "ok":
            return
        self.ops[key] = (name, owner, [])  # redeliveries may meet it; no main call to end
        if answer[3] is None:
            return

        def finish(ledger: Ledger) -> Any:
            end = ledger.calls.finish_operation(
                self.ids[key][self.side],
                result={"k": key},
                call=None,
                owner=owner,
                settled=[
                    SettledCall(
                        CallEnd(
                            step,
                            "settle",
                            actual=actual,
                            answered=Answered(
                                "req_1",
                                "resp_1",
                                "openai",
                                "sk-abc...wxyz",
                                120,
                                30,
                                counted=RateAsk(1, actual * 3),
                            ),
                        ),
                        record,
                        {"answer": actual},
                    )
                ],
            )
            return (end.status, end.result, end.error, end.applied)

        self.both(finish)

    @rule(
        data=st.data(),
        amount=st.integers(0, 160),
        owner=st.sampled_from(OWNERS),
        fingerprint=st.sampled_from(["f", "f", "other"]),
    )
    def redeliver(self, data: st.DataObject, amount: int, owner: str, fingerprint: str) -> None:
        if not self.ops:
            return
        key = data.draw(st.sampled_from(sorted(self.ops)))
        self.redeliver_as(key, self.ops[key][0], amount, owner, fingerprint)

    def redeliver_as(self, key: str, name: str, amount: int, owner: str, fp: str) -> None:
        ask = CallAsk(
            self.prefix + name,
            amount,
            fingerprint=f"req-{amount}",
            price_version="v1",
            facts=CallFacts(
                lookup="resp", model="m-1", timeout=30, request="d" * 64, rate=self.claim(amount)
            ),
        )

        def admit(ledger: Ledger) -> Any:
            start = ledger.calls.admit(
                key,
                fingerprint=fp,
                owner=owner,
                lease=timedelta(minutes=10),
                max_runs=3,
                task="parity",
                payload={"n": amount},
                call=ask,
                plan=self.plan_for(key),
            )
            made = start.call.reservation if start.call is not None else None
            self.ids.setdefault(key, [0, 0])[self.side] = start.operation_id
            return (
                start.decision.value,
                start.result,
                start.error,
                start.runs,
                start.lease_expires_at,
                None if made is None else (made.key, made.budget, made.amount, made.state),
            )

        kind, answer = self.both(admit)
        if kind == "ok":
            made = answer[5]
            known = self.ops.get(key, (name, owner, []))[2]
            if made is not None:
                known.append(made[0])
            holder = owner if answer[0] == "run" else self.ops.get(key, (name, owner))[1]
            self.ops[key] = (name, holder, known)

    @rule(data=st.data(), actual=st.integers(0, 200), as_owner=st.booleans())
    def finish(self, data: st.DataObject, actual: int, as_owner: bool) -> None:
        ran = sorted(k for k, (_, _, calls) in self.ops.items() if calls)
        if not ran:
            return
        self.finish_as(data.draw(st.sampled_from(ran)), actual, as_owner)

    def finish_as(self, key: str, actual: int, as_owner: bool) -> None:
        _, holder, calls = self.ops[key]
        owner = holder if as_owner else next(o for o in OWNERS if o != holder)

        def finish(ledger: Ledger) -> Any:
            end = ledger.calls.finish_operation(
                self.ids[key][self.side],
                result={"k": key, "actual": actual},
                call=CallEnd(
                    calls[-1],
                    "settle",
                    actual=actual,
                    # what remains as the provider says, a second ago: it narrows
                    answered=replace(SAID, seen=RateSeen(self.now_ms() - 1000, 2, 300)),
                ),
                owner=owner,
            )
            return (end.status, end.result, end.error, end.applied)

        self.both(finish)

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        ran = sorted(k for k, (_, _, calls) in self.ops.items() if calls)
        if not ran:
            return
        key = data.draw(st.sampled_from(ran))
        _, holder, calls = self.ops[key]

        def fail(ledger: Ledger) -> Any:
            end = ledger.calls.fail_operation(
                self.ids[key][self.side],
                owner=holder,
                error="boom",
                call=CallEnd(calls[-1], "release"),
            )
            return (end.status, end.error, end.applied)

        self.both(fail)

    @rule(name=st.sampled_from(NAMES), amount=st.integers(0, 160), granted=st.booleans())
    def reserve(self, name: str, amount: int, granted: bool) -> None:
        """A reservation alone (no operation), granted at once or not."""
        self.count += 1
        key = f"{self.prefix}r{self.count}"
        facts = CallFacts(model="m-1", rate=self.claim(amount)) if granted else None

        def reserve(ledger: Ledger) -> Any:
            made = ledger.calls.reserve(
                self.prefix + name, key, amount, fingerprint="r", grant=facts
            )
            return (made.key, made.budget, made.amount, made.state, made.created)

        if self.both(reserve)[0] == "ok":
            self.reserved.append(key)

    @rule(data=st.data(), actual=st.integers(0, 200), note=st.sampled_from([None, "by hand"]))
    def settle(self, data: st.DataObject, actual: int, note: str | None) -> None:
        """A settlement alone, of a reservation alone (granted or not) or of a delivery's."""
        keys = self.reserved + [k for _, _, calls in self.ops.values() for k in calls]
        if not keys:
            return
        key = data.draw(st.sampled_from(sorted(keys)))
        self.both(lambda ledger: ledger.calls.settle(key, actual, note=note, request_id="req_2"))

    @rule(name=st.sampled_from(NAMES), frozen=st.booleans())
    def freeze(self, name: str, frozen: bool) -> None:
        if frozen:
            self.both(lambda ledger: ledger.freeze(self.prefix + name))
        else:
            self.both(lambda ledger: ledger.unfreeze(self.prefix + name))

    @rule(hours=st.sampled_from([1, 13, 30, 200]))
    def advance(self, hours: int) -> None:
        self.clock.advance(hours=hours)

    @rule(seconds=st.sampled_from([1, 5, 30]))
    def wait(self, seconds: int) -> None:
        """Time for the rate windows to refill and booked calls to fall due."""
        self.clock.advance(seconds=seconds)

    @rule()
    def return_grants(self) -> None:
        self.both(lambda ledger: ledger.upkeep.return_grants(timedelta(0)))

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def every_row_is_the_same(self) -> None:
        dumps = []
        for url in self.urls:
            with psycopg.connect(pg_conninfo(url)) as conn:
                dumps.append(
                    {
                        table: conn.execute(query, {"prefix": self.prefix + "%"}).fetchall()
                        for table, query in DUMPS.items()
                    }
                )
        for table in DUMPS:
            assert dumps[0][table] == dumps[1][table], table


@pytest.fixture(scope="module")
def two_databases() -> Iterator[tuple[str, str]]:
    check_postgres()
    with scratch_database() as first, scratch_database() as second:
        for url in (first, second):
            ledger = Ledger(url)
            ledger.create_schema()
            ledger.dispose()
        yield first, second


def test_the_function_path_and_the_statement_path_write_the_same_rows(
    two_databases: tuple[str, str],
) -> None:
    class Machine(ParityMachine):
        pass

    Machine.urls = two_databases
    SEEN.update(ran=0, declined=0, booked=0)
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=int(os.environ.get("BUDGET_TASKS_FUZZ_EXAMPLES", "25")),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    # the comparison says something only if the function ran, and declined, in it
    print("SEEN", SEEN)
    # ... and a rate window was short in it (the calls were booked ahead)
    assert SEEN["ran"] > 0 and SEEN["declined"] > 0 and SEEN["booked"] > 0, SEEN
    # every decline was the function's own (not its case: BT001) or a deadlock broken,
    # never an error in its text (a column renamed under it declines every call)
    declined = {k.split()[1] for k in SEEN if k.startswith("declined ") and SEEN[k]}
    assert declined <= {"BT001", "40P01"}, SEEN


def test_a_database_without_the_functions_runs_the_statements_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check_postgres()
    with scratch_database() as url:
        # a database whose functions are gone (dropped by hand, or never made by a role
        # that may not create them): its tables are this release's
        upgrade(url)
        engine = sqlalchemy.create_engine(url)
        with engine.begin() as conn:
            for name in FUNCTION_NAMES:
                conn.execute(sqlalchemy.text(f"DROP FUNCTION {name}"))
        engine.dispose()
        ledger = Ledger(url)
        try:
            ledger.create_budget("b", 1_000)
            with caplog.at_level(logging.WARNING, "budget_tasks.ledger"):
                for n in range(2):
                    key = f"op{n}"
                    start = ledger.calls.admit(
                        key,
                        fingerprint="f",
                        owner="w",
                        lease=timedelta(minutes=1),
                        max_runs=3,
                        call=CallAsk("b", 100),
                        plan=lambda here, key=key: (f"{key}:0", "first"),
                    )
                    assert start.call is not None and start.call.reservation is not None
                    end = ledger.calls.finish_operation(
                        start.operation_id,
                        result=n,
                        call=CallEnd(f"{key}:0", "settle", actual=40),
                        owner="w",
                    )
                    assert end.applied
            said = [r for r in caplog.records if "lacks its functions" in r.getMessage()]
            assert len(said) == 1
            assert ledger.balance("b").spent == 80
            assert ledger.audit() == []
        finally:
            ledger.dispose()
