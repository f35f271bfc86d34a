"""Waiting for a rate window's turn on real ``celery worker`` processes, while the world
changes: a call waiting in the process reads its turn again as the window changes (a
raised limit sends it at once), one whose turn is further off than its patience comes
back as a message after that turn (once, not spinning the ledger), and an async
client's wait leaves the event loop free for the run's other calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from celery import Celery

from budget_tasks import Ledger
from budget_tasks.ledger.records import RateAsk
from budget_tasks.testing import FakeProvider

from ..workers import Worker
from .test_rate_fleet import signals_of


def fill(url: str, scope: str, per_minute: int) -> None:
    """Set ``scope``'s requests limit and take all of it, at the workers' time (the
    tests' own ledger runs on a clock moved by hand): the next call waits."""
    ledger = Ledger(url)
    ledger.rates.set_limit("openai", scope, "requests", per_minute)
    for _ in range(per_minute):
        assert ledger.rates.take("openai", scope, RateAsk(1, 0)).granted
    ledger.dispose()


def wait_for(check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def test_a_call_waiting_in_the_process_is_sent_as_soon_as_a_raised_limit_lets_it(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    tmp_path: Path,
) -> None:
    """One request a minute, all of it taken: the task's call is told its turn comes in
    a minute, and waits in the process (its patience is two minutes). An operator
    raises the limit to 600: the call reads its turn again and is sent at once, long
    before the minute it was told, having asked the ledger for admission twice."""
    received = tmp_path / "signals.jsonl"
    start_worker(BUDGET_TASKS_TEST_SIGNALS=str(received))
    fill(pg_url, "gpt-4o-mini", 1)
    result = client.send_task("tests.rated_chat_patient", args=[1])
    wait_for(lambda: len(signals_of(received, "rate_limited")) == 1)
    [told] = signals_of(received, "rate_limited")
    assert 55 <= float(told["wait"]) <= 60
    assert result.state == "PENDING"  # waiting in its process
    pg_ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 600)
    # its turn has come: sent within a read or two, not after the minute it was told
    assert result.get(timeout=30) > 0
    assert len(signals_of(received, "rate_limited")) == 1
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert [s.status for s in posts] == [200]
    [window] = pg_ledger.rates.windows()
    assert window.booked == 0


def test_a_turn_past_the_tasks_patience_brings_the_message_back_after_it_once(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    tmp_path: Path,
) -> None:
    """Ten requests a minute, all taken: the call's turn is 6 s off and the task waits
    at most 1 s in the process, so its message comes back after the 6 s (a retry
    that spends none of ``max_retries=0``), and is sent then: told to wait once, not
    admitted and refused in a loop."""
    received = tmp_path / "signals.jsonl"
    start_worker(BUDGET_TASKS_TEST_SIGNALS=str(received), BUDGET_TASKS_TEST_RATE_WAIT="1")
    fill(pg_url, "gpt-4o-mini", 10)
    assert client.send_task("tests.rated_chat", args=[1]).get(timeout=60) > 0
    told = signals_of(received, "rate_limited")
    # its first delivery was told 6 s; the message came back when its turn had come
    # (at most once more, should it come back a moment early)
    assert 1 <= len(told) <= 2 and 4 <= float(told[0]["wait"]) <= 6
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert [s.status for s in posts] == [200]


def test_an_async_clients_wait_for_its_turn_leaves_the_run_s_other_call_free(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
) -> None:
    """An ``asyncio.gather`` of two calls: the first to a model whose window is full
    (its turn 3 s off), the second, begun a moment later, to a model with no limit.
    The second is answered while the first waits, and the first is sent at its
    turn: the wait never held the event loop."""
    start_worker()
    fill(pg_url, "gpt-4o-mini", 20)
    assert client.send_task("tests.rated_async_pair", args=[1]).get(timeout=60) == [
        "free",
        "limited",
    ]
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert [s.status for s in posts] == [200, 200]
    free, limited = sorted(posts, key=lambda s: s.at)
    assert "nano" in free.model and "mini" in limited.model


def test_async_code_opens_its_labelled_calls_with_async_with(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """``async with self.spend(...)`` admits the call off the event loop, and settles
    it at the block's end, as ``with`` does; a redelivery replays both."""
    start_worker()
    sent = client.send_task("tests.async_spend", args=["owls"])
    assert sent.get(timeout=60) == ["outline of owls", "draft of owls"]
    again = client.send_task("tests.async_spend", args=["owls"])
    assert again.get(timeout=60) == ["outline of owls", "draft of owls"]
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert len(posts) == 2
    calls = [a for a in pg_ledger.attempts() if a.label]
    assert sorted(a.label or "" for a in calls) == ["draft", "outline"]
    assert {a.state for a in calls} == {"settled"}
    assert sum(a.actual or 0 for a in calls) == sum(s.billed for s in posts)
