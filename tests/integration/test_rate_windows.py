"""The ledger's rate windows (issue 45's primitive): token buckets per provider and
scope, held in the database so that every worker takes from the same ones; exact at
their boundaries, all or none across a scope's limits, refilled by the ledger's clock,
given back what a call did not use, and exact across processes."""

from __future__ import annotations

import multiprocessing
import time
from datetime import UTC, datetime, timedelta
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import pytest

from budget_tasks import Ledger
from budget_tasks.ledger.rates import RateAsk, RateTaken
from budget_tasks.testing.clock import ManualClock

from ..services import check_postgres

START = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


@pytest.fixture
def rated(backend_url: str) -> Ledger:
    clock = ManualClock(START)
    ledger = Ledger(backend_url, clock=clock)
    ledger.clock = clock  # type: ignore[attr-defined]
    return ledger


def advance(ledger: Ledger, **delta: float) -> None:
    ledger.clock.advance(**delta)  # type: ignore[attr-defined]


def test_a_window_admits_exactly_its_limit_then_says_how_long_to_wait(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 10)
    calls = rated.rates
    taken = [calls.take("openai", "gpt-4o-mini", RateAsk()) for _ in range(11)]
    assert [t.granted for t in taken] == [True] * 10 + [False]
    # one request refills every 6 s (10 a minute)
    assert taken[-1] == RateTaken(False, "requests", timedelta(seconds=6))
    advance(rated, seconds=5.999)
    assert not calls.take("openai", "gpt-4o-mini", RateAsk()).granted
    advance(rated, milliseconds=1)
    assert calls.take("openai", "gpt-4o-mini", RateAsk()).granted
    # another scope, or another provider, is not held by it
    assert calls.take("openai", "gpt-4.1-nano", RateAsk()).granted
    assert calls.take("anthropic", "gpt-4o-mini", RateAsk()).granted


def test_an_ask_exactly_equal_to_what_is_left_passes_and_one_more_does_not(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "team", "tokens", 60_000)
    calls = rated.rates
    assert calls.take("openai", "team", RateAsk(tokens=59_000)).granted
    assert not calls.take("openai", "team", RateAsk(tokens=1_001)).granted
    assert calls.take("openai", "team", RateAsk(tokens=1_000)).granted
    refused = calls.take("openai", "team", RateAsk(tokens=1))
    # 1,000 tokens a second: one token is a millisecond away
    assert refused == RateTaken(False, "tokens", timedelta(milliseconds=1))
    # more than the whole limit never fits: no wait would help
    assert calls.take("openai", "team", RateAsk(tokens=60_001)) == RateTaken(False, "tokens", None)


def test_a_scope_admits_all_of_an_ask_or_none_of_it(rated: Ledger) -> None:
    rated.rates.set_limit("anthropic", "haiku", "requests", 100)
    rated.rates.set_limit("anthropic", "haiku", "output_tokens", 1_000)
    calls = rated.rates
    refused = calls.take("anthropic", "haiku", RateAsk(output_tokens=1_001))
    assert (refused.granted, refused.short, refused.wait) == (False, "output_tokens", None)
    # the request it would have counted was not taken: the whole limit is still there
    for _ in range(100):
        assert calls.take("anthropic", "haiku", RateAsk()).granted
    assert calls.take("anthropic", "haiku", RateAsk()).short == "requests"
    levels = {w.kind: w.available for w in rated.rates.windows()}
    assert levels == {"requests": 0.0, "output_tokens": 1_000.0}


def test_what_a_call_did_not_use_comes_back_and_never_past_the_limit(rated: Ledger) -> None:
    rated.rates.set_limit("anthropic", "haiku", "output_tokens", 8_000)
    calls = rated.rates
    assert calls.take("anthropic", "haiku", RateAsk(output_tokens=8_000)).granted
    assert not calls.take("anthropic", "haiku", RateAsk(output_tokens=500)).granted
    # it produced 300 of its 8,000: 7,700 come back
    calls.give_back("anthropic", "haiku", output_tokens=7_700)
    assert calls.take("anthropic", "haiku", RateAsk(output_tokens=7_700)).granted
    assert not calls.take("anthropic", "haiku", RateAsk(output_tokens=1)).granted
    calls.give_back("anthropic", "haiku", output_tokens=20_000)
    [window] = rated.rates.windows()
    assert window.available == 8_000.0  # never past the limit


def test_a_minute_refills_a_window_whole_and_a_clock_going_back_refills_nothing(
    rated: Ledger,
) -> None:
    rated.rates.set_limit("openai", "m", "requests", 60)
    calls = rated.rates
    for _ in range(60):
        assert calls.take("openai", "m", RateAsk()).granted
    advance(rated, hours=5)  # long idle: full, not 300 times full
    granted = sum(calls.take("openai", "m", RateAsk()).granted for _ in range(61))
    assert granted == 60
    # another host's clock 30 s behind: its takes refill nothing, and when this host's
    # clock comes back the window has refilled from where it was, once
    advance(rated, seconds=-30)
    assert not calls.take("openai", "m", RateAsk()).granted
    advance(rated, seconds=30)
    assert sum(calls.take("openai", "m", RateAsk()).granted for _ in range(5)) == 0
    advance(rated, seconds=1)  # a second: one request
    assert sum(calls.take("openai", "m", RateAsk()).granted for _ in range(5)) == 1


def test_a_refusal_waits_for_the_longest_of_its_short_limits(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "m", "requests", 10)
    rated.rates.set_limit("openai", "m", "tokens", 1_000)
    calls = rated.rates
    assert calls.take("openai", "m", RateAsk(requests=10, tokens=1_000)).granted
    refused = calls.take("openai", "m", RateAsk(tokens=500))
    # a request is back in 6 s, 500 tokens in 30 s: the wait is the longer one
    assert refused == RateTaken(False, "tokens", timedelta(seconds=30))
    advance(rated, seconds=29.999)
    assert not calls.take("openai", "m", RateAsk(tokens=500)).granted
    advance(rated, milliseconds=1)
    assert calls.take("openai", "m", RateAsk(tokens=500)).granted


def test_a_large_limit_and_a_returned_call_keep_their_exact_counts(rated: Ledger) -> None:
    """150 million tokens a minute (a high tier's) is held to the token; giving back
    unused tokens never gives back the request that was sent."""
    rated.rates.set_limit("openai", "big", "tokens", 150_000_000)
    rated.rates.set_limit("openai", "big", "requests", 1)
    calls = rated.rates
    assert calls.take("openai", "big", RateAsk(tokens=150_000_000)).granted
    calls.give_back("openai", "big", tokens=149_999_999)
    assert not calls.take("openai", "big", RateAsk(tokens=1)).granted  # no request
    levels = {w.kind: w.available for w in rated.rates.windows()}
    assert levels == {"tokens": 149_999_999.0, "requests": 0.0}
    with pytest.raises(ValueError, match="at most"):
        rated.rates.set_limit("openai", "big", "tokens", 10**13)


def test_raising_a_limit_refills_the_time_before_at_the_old_rate(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "m", "requests", 10)
    calls = rated.rates
    for _ in range(10):
        assert calls.take("openai", "m", RateAsk()).granted
    advance(rated, seconds=59)  # 9 requests refilled at 10 a minute
    rated.rates.set_limit("openai", "m", "requests", 6_000)
    assert sum(calls.take("openai", "m", RateAsk()).granted for _ in range(20)) == 9


def test_lowering_a_limit_keeps_no_more_than_the_new_limit(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "m", "tokens", 10_000)
    rated.rates.set_limit("openai", "m", "tokens", 2_000)  # learned: the real limit is lower
    calls = rated.rates
    assert calls.take("openai", "m", RateAsk(tokens=2_000)).granted
    assert not calls.take("openai", "m", RateAsk(tokens=1)).granted
    assert rated.rates.clear_limit("openai", "m") == 1
    assert calls.take("openai", "m", RateAsk(tokens=1_000_000)).granted  # none held


def test_bad_limits_are_refused_with_a_clear_error(rated: Ledger) -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        rated.rates.set_limit("openai", "m", "dollars", 5)
    with pytest.raises(ValueError, match="clear it instead"):
        rated.rates.set_limit("openai", "m", "requests", 0)
    with pytest.raises(ValueError, match="per_minute must not be negative"):
        rated.rates.set_limit("openai", "m", "requests", -1)
    with pytest.raises(TypeError):
        rated.rates.set_limit("openai", "m", "requests", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate scope must not be empty"):
        rated.rates.set_limit("openai", "", "requests", 5)
    with pytest.raises(ValueError, match="tokens must not be negative"):
        RateAsk(tokens=-1)
    assert rated.rates.windows() == []


def _taker(
    url: str, start: datetime, asks: int, barrier: Barrier, out: Queue[tuple[float, float, int]]
) -> None:
    ledger = Ledger(url, clock=ManualClock(start))  # a clock that stands still: no refill
    barrier.wait()
    began, granted = time.time(), -1  # -1: this process failed (its error is on stderr)
    try:
        granted = sum(
            ledger.rates.take("openai", "burst", RateAsk(tokens=7)).granted for _ in range(asks)
        )
    finally:
        out.put((began, time.time(), granted))
        ledger.dispose()


def test_processes_at_once_take_exactly_what_the_window_holds(pg_url: str) -> None:
    """Eight processes take 7 tokens at a time, 40 times each, from one window of 500
    at a clock that stands still: exactly 71 takes are granted (497 tokens), whoever
    wins them, and none past the limit."""
    check_postgres()
    from ..conftest import empty_ledger_tables

    empty_ledger_tables(pg_url)
    Ledger(pg_url, clock=ManualClock(START)).rates.set_limit("openai", "burst", "tokens", 500)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(8)
    out: Queue[tuple[float, float, int]] = context.Queue()
    procs = [
        context.Process(target=_taker, args=(pg_url, START, 40, barrier, out)) for _ in range(8)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert sum(granted for _, _, granted in results) == 500 // 7
    # they overlapped: every process began before the first one ended
    assert max(began for began, _, _ in results) < min(ended for _, ended, _ in results)
    [window] = Ledger(pg_url, clock=ManualClock(START)).rates.windows()
    assert window.available == 500 - 7 * (500 // 7)
