"""A call's rate windows are taken in the transaction that admits its money, on every
path (SQLite, PostgreSQL's statements, PostgreSQL's function): both have room or
neither is taken; a short window books the call ahead, in order of arrival, and tells
it when to come back; settlement gives back what the vendor did not count, a release
every token, an unknown outcome none; and eight processes at once take exactly what
the windows hold."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any
from unittest.mock import patch

import pytest

from budget_tasks import Ledger
from budget_tasks.errors import BudgetExceeded, RateAskTooLarge, RateWindowFull, UnknownAttempt
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger.records import (
    Answered,
    CallAsk,
    CallEnd,
    RateAsk,
    RateClaim,
    RateSeen,
    SettledCall,
)
from budget_tasks.testing.clock import ManualClock

from ..services import check_postgres

START = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
MINI = RateClaim(
    "openai", ("gpt-4o-mini", "*"), RateAsk(requests=1, tokens=600), own=("gpt-4o-mini",)
)


@pytest.fixture(params=["sqlite", "pg-statements", "pg-function"])
def rated(request: pytest.FixtureRequest) -> Iterator[Ledger]:
    from ..conftest import empty_ledger_tables

    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
    else:
        url = str(request.getfixturevalue("pg_url"))
        empty_ledger_tables(url)
    clock = ManualClock(START)
    ledger = Ledger(url, clock=clock, server_functions=request.param == "pg-function")
    ledger.clock = clock  # type: ignore[attr-defined]
    ledger.create_budget("team", 1_000_000)
    yield ledger
    ledger.dispose()


def send(ledger: Ledger, key: str, claim: RateClaim = MINI, amount: int = 100) -> None:
    ledger.calls.reserve("team", key, amount, grant=CallFacts(model="gpt-4o-mini", rate=claim))


def level(ledger: Ledger, kind: str) -> float:
    return {w.kind: w.available for w in ledger.rates.windows()}[kind]


def takes(ledger: Ledger) -> int:
    with ledger._store.driver.transaction() as cur:
        row = cur.one("SELECT count(*) FROM rate_takes", {})
    assert row is not None
    return int(row[0])


def test_a_window_admits_exactly_its_limit_and_books_the_next_call(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 3)
    for n in range(3):
        send(rated, f"k{n}")
    assert level(rated, "requests") == 0
    with pytest.raises(RateWindowFull) as full:
        send(rated, "k3")
    # 3 a minute: the fourth is booked for the next one, refilled in 20 s
    assert (full.value.scope, full.value.kind, full.value.wait_ms) == (
        "gpt-4o-mini",
        "requests",
        20_000,
    )
    # nothing was admitted for it: no attempt, no money held
    with pytest.raises(UnknownAttempt):
        rated.attempt("k3")
    assert rated.balance("team").held == 300
    # the window owes the booked request: it stands below 0
    assert level(rated, "requests") == -1
    # back 1 ms early: still booked, nothing taken again, told the time its last
    # thousandth of a request takes to refill (the level counts in thousandths: never
    # a wait shorter than the refill)
    rated.clock.advance(seconds=19.999)  # type: ignore[attr-defined]
    with pytest.raises(RateWindowFull) as early:
        send(rated, "k3")
    assert early.value.wait_ms == 20 and early.value.key == "k3"
    rated.clock.advance(seconds=0.001)  # type: ignore[attr-defined]
    send(rated, "k3")  # due: sent without taking again
    assert level(rated, "requests") == 0
    assert rated.balance("team").held == 400
    assert rated.attempt("k3").state == "sending"


def test_calls_are_booked_in_order_of_arrival(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 6)
    for n in range(6):
        send(rated, f"k{n}")
    waits = []
    for n in range(6, 9):
        with pytest.raises(RateWindowFull) as full:
            send(rated, f"k{n}")
        waits.append(full.value.wait_ms)
    # each arrival books the next 10 s of refill: 10, 20, 30 s
    assert waits == [10_000, 20_000, 30_000]
    rated.clock.advance(seconds=10)  # type: ignore[attr-defined]
    # a newcomer cannot jump the queue: the refill is the first booked call's
    with pytest.raises(RateWindowFull) as newcomer:
        send(rated, "late")
    assert newcomer.value.wait_ms == 30_000
    send(rated, "k6")
    with pytest.raises(RateWindowFull):
        send(rated, "k7")  # due at 20 s, not yet
    rated.clock.advance(seconds=20)  # type: ignore[attr-defined]
    send(rated, "k7")
    send(rated, "k8")
    with pytest.raises(RateWindowFull):
        send(rated, "late")  # booked at 10 s for 30 s on: due at 40 s
    rated.clock.advance(seconds=10)  # type: ignore[attr-defined]
    send(rated, "late")
    assert level(rated, "requests") == 0


def test_a_budget_refusal_takes_nothing_from_the_window(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 10)
    rated.rates.set_limit("openai", "*", "tokens", 6_000)
    rated.create_budget("small", 150)
    with pytest.raises(BudgetExceeded):
        rated.calls.reserve("small", "big", 151, grant=CallFacts(rate=MINI))
    assert (level(rated, "requests"), level(rated, "tokens")) == (10, 6_000)
    assert takes(rated) == 0
    # exactly what is left of both passes
    rated.calls.reserve("small", "fits", 150, grant=CallFacts(rate=MINI))
    assert (level(rated, "requests"), level(rated, "tokens")) == (9, 5_400)


def test_a_window_short_admits_no_money_and_takes_nothing_from_the_others(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 10)
    rated.rates.set_limit("openai", "*", "tokens", 1_000)
    send(rated, "a")  # 600 of 1,000 tokens
    with pytest.raises(RateWindowFull) as full:
        send(rated, "b")
    assert (full.value.scope, full.value.kind) == ("*", "tokens")
    # 200 tokens short at 1,000 a minute: 12 s; the request window was booked too
    assert full.value.wait_ms == 12_000
    assert rated.balance("team").held == 100
    assert level(rated, "requests") == 8 and level(rated, "tokens") == -200


def test_an_ask_larger_than_a_whole_limit_is_refused_for_good(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "*", "tokens", 599)
    with pytest.raises(RateAskTooLarge, match="asks 600 tokens"):
        send(rated, "a")
    assert level(rated, "tokens") == 599 and takes(rated) == 0
    assert rated.balance("team").held == 0


def test_settlement_gives_back_what_the_vendor_did_not_count(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 10)
    rated.rates.set_limit("openai", "*", "tokens", 6_000)
    send(rated, "a")
    send(rated, "b")
    send(rated, "c")
    assert level(rated, "tokens") == 6_000 - 3 * 600
    # a: counted 250 of the 600 taken; b: released (not billed); c: unknown
    rated.calls.settle("a", 80, answered=Answered(counted=RateAsk(1, 250)))
    rated.calls.release("b", "a 429")
    rated.calls.mark_unknown("c", "timed out")
    assert level(rated, "tokens") == 6_000 - 250 - 600
    # a request sent stays counted, whatever came of it
    assert level(rated, "requests") == 7
    assert takes(rated) == 0
    assert rated.balance("team").spent == 80


def test_a_settlement_never_gives_back_past_the_limit(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "*", "tokens", 1_000)
    send(rated, "a")
    rated.clock.advance(seconds=60)  # type: ignore[attr-defined]
    rated.calls.settle("a", 10, answered=Answered(counted=RateAsk(1, 0)))
    assert level(rated, "tokens") == 1_000


def _sender(
    url: str, functions: bool, who: int, barrier: Barrier, out: Queue[tuple[float, float, int]]
) -> None:
    ledger = Ledger(url, clock=ManualClock(START), server_functions=functions)
    barrier.wait()
    began, sent = time.time(), -1  # -1: this process failed (its error is on stderr)
    try:
        sent = 0
        for n in range(25):
            try:
                send(ledger, f"p{who}-{n}", amount=1)
                sent += 1
            except RateWindowFull:
                pass
    finally:
        out.put((began, time.time(), sent))
        ledger.dispose()


@pytest.mark.parametrize("functions", [True, False], ids=["function", "statements"])
def test_processes_at_once_send_exactly_what_the_windows_hold(pg_url: str, functions: bool) -> None:
    """Eight processes send 25 calls each at a clock that stands still against 60
    requests and 30,000 tokens (50 calls' worth) a minute: exactly 50 are admitted,
    with their money, and every other is booked, whoever wins."""
    check_postgres()
    from ..conftest import empty_ledger_tables

    empty_ledger_tables(pg_url)
    setup = Ledger(pg_url, clock=ManualClock(START))
    setup.create_budget("team", 1_000_000)
    setup.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    setup.rates.set_limit("openai", "*", "tokens", 30_000)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(8)
    out: Queue[tuple[float, float, int]] = context.Queue()
    procs = [
        context.Process(target=_sender, args=(pg_url, functions, who, barrier, out))
        for who in range(8)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert sum(sent for _, _, sent in results) == 50
    assert max(began for began, _, _ in results) < min(ended for _, ended, _ in results)
    assert setup.balance("team").held == 50
    windows = {w.kind: w.available for w in setup.rates.windows()}
    # the 150 refused were booked ahead: each window owes exactly their asks
    assert windows == {"requests": 60 - 200, "tokens": 30_000 - 200 * 600}
    setup.dispose()


def now_ms(ledger: Ledger) -> int:
    return int(ledger.clock().timestamp() * 1000)  # type: ignore[attr-defined]


def test_what_the_provider_says_remains_narrows_the_window_never_widens_it(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    rated.rates.set_limit("openai", "*", "tokens", 60_000)
    for key in ("a", "b", "c"):
        send(rated, key)
    # a: the provider says 5 requests remain, 2 s ago (2 more refilled since), and
    # more tokens than the window holds (left as it is)
    said = RateSeen(now_ms(rated) - 2_000, requests=5, tokens=59_999)
    rated.calls.settle("a", 10, answered=Answered(counted=RateAsk(1, 600), seen=said))
    assert level(rated, "requests") == 7
    assert level(rated, "tokens") == 60_000 - 3 * 600
    # b: more than the window holds remains: nothing widens
    rated.calls.settle(
        "b",
        10,
        answered=Answered(counted=RateAsk(1, 600), seen=RateSeen(now_ms(rated), requests=50)),
    )
    assert level(rated, "requests") == 7


def test_a_429_puts_the_window_in_debt_for_its_retry_after(rated: Ledger) -> None:
    """A run's call answered 429 (no requests remain, come back in 3 s): released,
    the request stays counted, and the window owes 3 s of its refill, so the next
    call is booked for then, not sent into another 429."""
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    ask = CallAsk("team", 100, facts=CallFacts(model="gpt-4o-mini", rate=MINI))
    start = rated.calls.admit(
        "op",
        fingerprint="f",
        owner="w1",
        lease=timedelta(minutes=5),
        max_runs=3,
        call=ask,
        plan=lambda here: ("op:0", "first"),
    )
    assert start.call is not None and start.call.reservation is not None
    assert level(rated, "requests") == 59
    refused = RateSeen(now_ms(rated), requests=0, wait_ms=3_000)
    rated.calls.end_call(
        CallEnd("op:0", "release", answered=Answered(seen=refused)),
        operation_id=start.operation_id,
        owner="w1",
    )
    assert rated.attempt("op:0").state == "released"
    assert level(rated, "requests") == -3  # 3 s of 60 a minute owed
    assert takes(rated) == 0
    with pytest.raises(RateWindowFull) as full:
        send(rated, "next")
    assert full.value.wait_ms == 4_000  # the 3 s owed, then its own turn


def test_a_busy_scope_delays_no_other_and_a_flooding_tenant_starves_no_one(
    rated: Ledger,
) -> None:
    """Two models, each its own limit: a line on one keeps nothing of the other
    waiting. Two tenants (budgets) on one model: the second tenant's call waits behind
    the first tenant's first booked call only, not behind the twenty it queued, and
    the flooding tenant's next call waits behind both."""
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 6)
    rated.rates.set_limit("openai", "gpt-4.1-nano", "requests", 6)
    rated.create_budget("other-tenant", 1_000_000)
    nano = RateClaim("openai", ("gpt-4.1-nano", "*"), RateAsk(1, 0))
    for n in range(6):
        send(rated, f"busy{n}")
    waits = {}
    for n in range(6, 26):  # the busy tenant's line: 20 calls, 10 s apart
        with pytest.raises(RateWindowFull) as full:
            send(rated, f"busy{n}")
        waits[f"busy{n}"] = full.value.wait_ms
    assert waits["busy6"] == 10_000 and waits["busy25"] == 200_000
    # the other model: sent at once
    send(rated, "nano-0", claim=nano)
    assert rated.attempt("nano-0").state == "sending"
    # the other tenant, on the busy model: second in line
    with pytest.raises(RateWindowFull) as theirs:
        rated.calls.reserve("other-tenant", "t2", 100, grant=CallFacts(rate=MINI))
    assert theirs.value.wait_ms == 20_000
    # the busy tenant's own calls moved back by one turn, in their order
    assert rated.calls.rate_turn("busy6") == 10.0
    assert rated.calls.rate_turn("busy7") == 30.0
    assert rated.calls.rate_turn("busy25") == 210.0
    with pytest.raises(RateWindowFull) as later:
        send(rated, "busy26")
    assert later.value.wait_ms == 220_000
    rated.clock.advance(seconds=20)  # type: ignore[attr-defined]
    send(rated, "busy6")
    rated.calls.reserve("other-tenant", "t2", 100, grant=CallFacts(rate=MINI))
    assert rated.attempt("t2").state == "sending"
    with pytest.raises(RateWindowFull):
        send(rated, "busy7")  # its turn is 10 s later


def test_a_call_its_budget_refuses_is_refused_not_booked_ahead_of_those_that_can_pay(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 1)
    rated.create_budget("poor", 150)
    send(rated, "first")  # the window is empty now
    for n in range(3):
        with pytest.raises(BudgetExceeded):
            rated.calls.reserve("poor", f"poor{n}", 151, grant=CallFacts(rate=MINI))
    assert takes(rated) == 1 and level(rated, "requests") == 0
    with pytest.raises(RateWindowFull) as funded:
        send(rated, "funded")
    assert funded.value.wait_ms == 60_000  # next in line, not behind the refused


def test_a_limit_lowered_while_calls_wait_keeps_them_all_in_line_at_the_new_rate(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 100)
    for n in range(170):
        with contextlib.suppress(RateWindowFull):
            send(rated, f"k{n}", amount=0)
    assert level(rated, "requests") == -70  # 70 calls booked ahead
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 1)
    # every booked call keeps its place; the last one's turn is 70 minutes away
    assert level(rated, "requests") == -70
    assert [w.booked for w in rated.rates.windows()] == [70]
    assert rated.calls.rate_turn("k100") == 60.0
    assert rated.calls.rate_turn("k169") == 70 * 60.0


def test_bookings_no_call_came_back_for_are_dropped_an_hour_after_they_were_due_back(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    for n in range(62):
        with contextlib.suppress(RateWindowFull):
            send(rated, f"k{n}")
    assert [w.booked for w in rated.rates.windows()] == [2]
    rated.clock.advance(minutes=60)  # type: ignore[attr-defined]
    assert rated.upkeep.drop_abandoned_bookings() == 0  # told 1 s and 2 s: not yet
    rated.clock.advance(seconds=1.5)  # type: ignore[attr-defined]
    assert rated.upkeep.drop_abandoned_bookings() == 1
    rated.clock.advance(seconds=1)  # type: ignore[attr-defined]
    assert rated.upkeep.drop_abandoned_bookings() == 1
    assert [w.booked for w in rated.rates.windows()] == [0]
    # what they booked went back (the window, idle an hour, is full anyway)
    assert level(rated, "requests") == 60
    assert takes(rated) == 60  # the sent calls' takes stay until they settle


def test_a_call_that_settles_the_one_before_locks_every_window_before_any_budget_row(
    pg_url: str,
) -> None:
    """A run's second call is admitted with its first call's settlement in one
    transaction (the Quick start's path): that transaction gives back to the first
    call's windows and takes the second's before it writes any budget row, as every
    admission does. Otherwise it and a plain admission on the same model and budget
    lock the same two rows in opposite orders: a deadlock."""
    from ..conftest import empty_ledger_tables

    check_postgres()
    empty_ledger_tables(pg_url)
    ledger = Ledger(pg_url, clock=ManualClock(START), server_functions=False)
    ledger.create_budget("team", 1_000_000)
    ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    ledger.rates.set_limit("openai", "*", "tokens", 60_000)
    facts = CallFacts(model="gpt-4o-mini", rate=MINI)

    def labelled(n: int) -> CallAsk:
        return CallAsk("team", 100, "r", None, facts, "openai.chat", f"op:openai.chat:{n}")

    start = ledger.calls.admit(
        "op",
        fingerprint="f",
        owner="w1",
        lease=timedelta(minutes=5),
        max_runs=3,
        call=CallAsk("team", 0),
        plan=lambda here: None,
        first=(labelled(1), "spend:1", lambda here: ("op:openai.chat:1", "first")),
    )
    first = start.first
    assert first is not None and first.reservation is not None
    written: list[str] = []
    execute = type(ledger._store.driver.checkout().connection.cursor()).execute

    def spy(cursor: Any, statement: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(statement).lstrip().upper()
        for table in ("RATE_WINDOWS", "BUDGET_PERIODS"):
            if text.startswith(f"UPDATE {table}"):
                written.append(table)
        return execute(cursor, statement, *args, **kwargs)

    settled = SettledCall(
        CallEnd(
            "op:openai.chat:1", "settle", actual=90, answered=Answered(counted=RateAsk(1, 200))
        ),
        "spend:1",
        {"answer": 1},
    )
    with patch.object(type(ledger._store.driver.checkout().connection.cursor()), "execute", spy):
        second = ledger.calls.admit_call(
            start.operation_id,
            labelled(2),
            record="spend:2",
            plan=lambda here: ("op:openai.chat:2", "first"),
            settled=[settled],
        )
    assert second.reservation is not None and second.reservation.created
    assert "RATE_WINDOWS" in written and "BUDGET_PERIODS" in written
    last_window = max(i for i, table in enumerate(written) if table == "RATE_WINDOWS")
    first_budget = min(i for i, table in enumerate(written) if table == "BUDGET_PERIODS")
    assert last_window < first_budget, written
    # and what the settlement gave back is there: 600 taken twice, 400 of the first back
    assert level(ledger, "tokens") == 60_000 - 600 - 200
    ledger.dispose()
