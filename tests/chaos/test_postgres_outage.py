"""PostgreSQL stopped mid-load (an immediate shutdown, as a crash), then started again.

Real parts only: the test's own PostgreSQL cluster as the ledger, Redis as the broker,
``celery worker`` processes, the official openai SDK over HTTP to the fake provider.

While the ledger is down nothing may reach the provider but the requests whose attempt
was committed as 'sending' before the stop (fail closed). When it is back, every task
finishes on its own: the deliveries refused during the outage come back as Celery
retries (same task id, same business key), however many times they met it; the calls
in flight at the stop settle, within the task's wait for a short outage, or from the
outcome their process kept when the outage outlasted that wait.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from budget_tasks import Ledger
from budget_tasks.delivery.owed import PERSIST_DELAYS
from budget_tasks.providers import estimates
from budget_tasks.testing import FakeProvider
from tests.support import worker_env

from ..integration.worker_tasks import fixed_request
from ..services import REDIS_HOST, REDIS_PORT, check_redis, redis_db
from ..workers import Worker
from .invariants import attempt_rows, check_all
from .pg_cluster import PgCluster, pg_cluster  # noqa: F401

REDIS_DB = redis_db("chaos: postgres outage")  # flushed before each test
TASK = "tests.fixed_cost"  # calls the provider once, charged exactly its estimate
WARMUP = 6  # tasks run before the load, one per pool process (2 workers x 3)
TASKS = 40  # then this many, one every SEND_INTERVAL
ADMITTED = 30  # the cap admits this many of the TASKS: the rest are denied
SEND_INTERVAL = 0.15
CALL_SECONDS = 0.3  # each provider call takes this long, so some are in flight at the stop
STOP_AFTER = 8  # provider requests of the load served before PostgreSQL is stopped
#: Celery's default retry limit, which a retry for the ledger must not be held to.
CELERY_DEFAULT_RETRIES = 3
RETRY_LINE = re.compile(r"\[([0-9a-f-]{36})\] retry: Retry in .*LedgerUnavailable")
KEPT_LINE = "wrote what the outage kept back (succeeded)"
SHORT = 3.0  # within the task's wait for a settlement after a call
LONG = 22.0  # past that wait and past Celery's default number of retries (3 x 5 s)


@pytest.fixture
def broker() -> str:
    check_redis()
    redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).flushdb()
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"


@pytest.fixture
def client(broker: str) -> Iterator[Celery]:
    app = Celery("chaos-client", broker=broker, backend=broker, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    yield app
    app.close()


@pytest.fixture
def ledger_url(pg_cluster: PgCluster) -> Iterator[str]:  # noqa: F811
    if not pg_cluster.running():
        pg_cluster.start()  # an earlier test failed mid-outage
    url = pg_cluster.create_database("outage")
    ledger = Ledger(url)
    ledger.create_schema()
    ledger.dispose()
    yield url
    if not pg_cluster.running():
        pg_cluster.start()


@pytest.fixture
def workers(
    broker: str, ledger_url: str, fake: FakeProvider, tmp_path: Path
) -> Iterator[Callable[..., list[Worker]]]:
    started: list[Worker] = []

    def start(count: int, concurrency: int, **env: str) -> list[Worker]:
        full_env = worker_env(
            broker=broker,
            ledger=ledger_url,
            home=tmp_path / "home",
            provider=fake.openai_base_url,
            **{"BUDGET_TASKS_PROVIDER_TIMEOUT": "30", **env},
        )
        batch = [
            Worker(full_env, f"pg{i}-{uuid.uuid4().hex[:6]}", tmp_path, concurrency)
            for i in range(count)
        ]
        started.extend(batch)
        return [w.wait_ready() for w in batch]

    yield start
    for worker in started:
        worker.stop()


def log_tails(workers: list[Worker], cluster: PgCluster) -> str:
    parts = [f"--- {w.log_path} ---\n{w.log_path.read_text()[-4000:]}" for w in workers]
    return "\n".join([*parts, cluster.log_tail()])


def outcome(result: Any, deadline: float) -> str:
    try:
        result.get(timeout=max(1.0, deadline - time.monotonic()))
        return "ok"
    except Exception as exc:  # the task's own error, rebuilt by Celery with its type
        return type(exc).__name__


def outage_retries(workers: list[Worker]) -> Counter[str]:
    """Per task id, the deliveries that met the outage before any send and went back
    to the broker as a Celery retry."""
    return Counter(
        m.group(1)
        for w in workers
        for line in w.log_path.read_text().splitlines()
        if (m := RETRY_LINE.search(line))
    )


def kept_outcomes(workers: list[Worker]) -> int:
    """Outcomes of answered calls that a process kept through the outage and wrote."""
    return sum(w.log_path.read_text().count(KEPT_LINE) for w in workers)


@pytest.mark.chaos
@pytest.mark.parametrize("outage", [SHORT, LONG], ids=["short", "long"])
def test_postgres_stopped_mid_load_sends_nothing_then_every_task_recovers(
    outage: float,
    pg_cluster: PgCluster,  # noqa: F811
    ledger_url: str,
    workers: Callable[..., list[Worker]],
    client: Celery,
    fake: FakeProvider,
) -> None:
    each = estimates.openai_chat(fixed_request(0)).amount
    setup = Ledger(ledger_url)
    setup.create_budget("outage", (WARMUP + ADMITTED) * each)
    setup.dispose()  # its pooled connection would not survive the stop
    # Every chat call takes a while, so the stop lands on calls in flight; the tasks
    # come in a trickle and there are more pool processes than calls in flight, so
    # some are free to take new tasks while the ledger is down.
    fake.plan(f"delay={CALL_SECONDS}", count=10_000, path="/chat/completions")
    running = workers(2, 3, BUDGET_TASKS_BUDGET="outage")
    try:
        # Warm the pool processes up first (the first call of each builds its SDK
        # client): a backlog at the stop would put every process in a call.
        warm = [client.send_task(TASK, args=[10_000 + n]) for n in range(WARMUP)]
        assert [r.get(timeout=120) for r in warm] == [10_000 + n for n in range(WARMUP)]
        served_warm = len(fake.served())

        results: list[Any] = []
        stop_at = down_at = up_at = 0.0
        served_at_stop = 0
        served_in_outage: list[Any] = []
        started = time.monotonic()
        while len(results) < TASKS or not up_at:
            assert time.monotonic() - started < 120, "the load never reached the outage"
            if len(results) < TASKS:
                results.append(client.send_task(TASK, args=[len(results)]))
            time.sleep(SEND_INTERVAL)
            now, log = time.time(), fake.served()
            served = len(log) - served_warm
            # mid-load, with a call in flight that has a while to go
            in_flight = any(now - s.at < CALL_SECONDS / 2 for s in log)
            if not stop_at and served >= STOP_AFTER and in_flight:
                stop_at = time.time()
                served_at_stop = served
                down_at = pg_cluster.stop("immediate")
            elif stop_at and not up_at and time.time() - down_at >= outage:
                served_in_outage = [s for s in fake.served() if s.at >= stop_at]
                up_at = pg_cluster.start()
        retries = outage_retries(running)

        deadline = time.monotonic() + 120
        outcomes = Counter(outcome(r, deadline) for r in results)
        recovered_in = time.time() - up_at

        # -- fail closed: during the outage, only sends committed before the stop ----
        ledger = Ledger(ledger_url)
        attempts = {ledger.provider_key(k): a for k, a in attempt_rows(ledger).items()}
        stopped = datetime.fromtimestamp(down_at, UTC)
        for served in served_in_outage:
            attempt = attempts.get(str(served.idempotency_key))
            assert attempt is not None, f"request {served.request_id} has no attempt"
            assert attempt.sending_at is not None and attempt.sending_at < stopped, (
                f"{attempt.key} reached the provider during the outage without a 'sending' "
                f"committed before the stop ({attempt.sending_at} >= {stopped})"
            )

        # -- recovery: every task ended, by itself, as a success or a denial ----------
        unknown = sum(1 for a in attempts.values() if a.state == "unknown")
        assert set(outcomes) <= {"ok", "BudgetExceeded", "OutcomeUnknown"}, outcomes
        assert outcomes["OutcomeUnknown"] == unknown  # a send whose commit was in doubt
        assert outcomes["ok"] + unknown == ADMITTED, outcomes
        assert outcomes["BudgetExceeded"] == TASKS - ADMITTED, outcomes  # the cap is tight
        # the outage was met: deliveries were refused before any send, and went back
        assert retries, "no delivery met the outage"
        kept = kept_outcomes(running)
        if outage > sum(PERSIST_DELAYS):
            # past Celery's default retry limit, and still no message given up on
            assert max(retries.values()) > CELERY_DEFAULT_RETRIES, retries
            # the call in flight at the stop outwaited its settlement: its process kept
            # the outcome and wrote it once the ledger was back
            assert kept >= 1
        else:
            assert kept == 0  # the settlement waited the short outage out
        requests = check_all(ledger, fake)  # nothing left 'reserved' or 'sending'
        assert requests == outcomes["ok"] + WARMUP
        bal = ledger.balance("outage")
        assert bal.spent == (outcomes["ok"] + WARMUP) * each
        assert bal.spent + bal.held == bal.cap
        ledger.dispose()
        print(
            f"outage {outage:.0f}s: requests served before the stop {served_at_stop}, "
            f"in the outage {len(served_in_outage)}, in all {requests}; "
            f"{sum(retries.values())} deliveries refused in the outage "
            f"(at most {max(retries.values())} for one task); "
            f"{kept} kept outcomes written after it; "
            f"outcomes {dict(outcomes)}; all done {recovered_in:.1f}s after the restart"
        )
    except BaseException:
        print(log_tails(running, pg_cluster))
        raise
