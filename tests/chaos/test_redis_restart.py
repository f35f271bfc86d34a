"""The broker dies mid-load: the test's own redis-server SIGKILLed and started again.

Forty business keys through a real ``celery worker`` (concurrency 2) on the test's own
redis-server, which runs without persistence: the kill loses every queued and unacked
message, and tasks the client sends while it is down fail to enqueue. The worker must
reconnect by itself. The test client then does what an operator's re-drive would:
it enqueues every one of the forty keys again, and the ledger decides: a key that
finished replays its stored result, one that never ran runs once, one the cap refused
is refused again (or admitted, if settlements have freed room). No business key ever
reaches the provider twice, no hold is lost, and the cap holds.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..workers import Worker
from .conftest import celery_client, outcome
from .invariants import check_all
from .redis_server import RedisServer
from .worker_tasks import estimate

pytestmark = pytest.mark.chaos

KEYS = 40
BEFORE_KILL = 30  # sent before the kill; the rest are sent while Redis is down
FIT = 24  # the cap, in estimates: forty settled calls (~0.7 of one each) cannot fit
FAULT = "delay=0.2"  # each call takes a while, so the kill finds work queued and running


def job(n: int) -> str:
    return f"k{n:02d}"


def operations(ledger: Ledger) -> dict[str, Any]:
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT key, status, error, deliveries, replays, result FROM operations")
        ).all()
    return {r.key.removeprefix("chaos:"): r for r in rows}


def provider_calls(fake: FakeProvider, ledger: Ledger) -> Counter[str]:
    """POST requests per business key (the attempt key without its '#n')."""
    return Counter(
        (s.idempotency_key or "?").removeprefix("chaos:").split("#")[0]
        for s in fake.served_as(ledger)
        if s.method == "POST"
    )


def connections(worker: Worker) -> int:
    return worker.log_path.read_text().count("Connected to redis://")


def test_redis_killed_mid_load_worker_reconnects_and_resent_keys_replay(
    client: Celery,
    redis_server: RedisServer,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
) -> None:
    began = time.monotonic()
    each = estimate(job(0))
    pg_ledger.create_budget("broker", FIT * each)
    worker = start_worker("redis", concurrency=2, BUDGET_TASKS_BUDGET="broker")
    real = Ledger(pg_url)
    try:
        for n in range(BEFORE_KILL):
            client.send_task("chaos.call", args=[job(n), None, FAULT])
        wait_for(
            lambda: sum(op.status != "running" for op in operations(real).values()) >= 8,
            60,
            "some tasks to finish before the kill",
        )
        redis_server.kill()
        at_kill = operations(real)
        unsent = []
        with celery_client(redis_server.url, results=False) as sender:
            for n in range(BEFORE_KILL, KEYS):  # into the void: the broker is down
                try:
                    sender.send_task("chaos.call", args=[job(n), None, FAULT], retry=False)
                except Exception:
                    unsent.append(job(n))
        redis_server.start()  # same port, empty
        wait_for(lambda: connections(worker) >= 2, 90, "the worker to reconnect on its own")
        # Whatever was running when the broker died finishes on its own.
        wait_for(
            lambda: all(op.status != "running" for op in operations(real).values()),
            60,
            "the tasks running at the kill to end",
        )
        finished = operations(real)
        lost = [job(n) for n in range(BEFORE_KILL) if job(n) not in finished]
        print(
            f"at the kill: {len(at_kill)} of {BEFORE_KILL} started; lost with Redis: "
            f"{len(lost)}; failed to enqueue while it was down: {len(unsent)}"
        )
        assert lost, "the kill came too late: no queued message was lost"
        assert unsent == [job(n) for n in range(BEFORE_KILL, KEYS)], unsent

        # The re-drive: every key again, with a new message each.
        results = {
            job(n): client.send_task("chaos.call", args=[job(n), None, FAULT]) for n in range(KEYS)
        }
        ended = {key: outcome(r, timeout=90) for key, r in results.items()}
        assert worker.proc.poll() is None, "the worker died instead of reconnecting"

        ops = operations(real)
        calls = provider_calls(fake, real)
        assert max(calls.values()) == 1, f"a business key called twice: {calls}"
        for key, end in ended.items():
            assert end in ("ok", "BudgetExceeded"), (key, end)
            assert calls[key] == (1 if end == "ok" else 0), (key, end, calls[key])
            if key in finished and finished[key].status == "succeeded":
                # it ran before the re-drive: this delivery replayed its stored result
                assert end == "ok" and ops[key].replays >= 1, (key, ops[key])
                assert results[key].result == real.operation(f"chaos:{key}").result
        tally = Counter(ended.values())
        replayed = sum(op.replays for op in ops.values())
        print(f"after the re-drive: {dict(tally)}; {replayed} replays")
        assert tally["ok"] > 0 and tally["BudgetExceeded"] > 0, tally
        assert replayed > 0
        assert all(a.state == "settled" for a in real.attempts())

        requests = check_all(real, fake)
        assert requests == tally["ok"]
        bal = real.balance("broker")
        assert bal.held == 0 and bal.spent <= bal.cap
        assert bal.spent == fake.state()["billed_total"]
        print(f"{KEYS} keys, {requests} provider requests; {time.monotonic() - began:.1f}s")
    finally:
        real.dispose()
