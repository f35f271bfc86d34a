"""BudgetTask against a plain Celery task making the same provider call, on the same
worker settings, in one run: throughput ratio and added median latency.

    .venv/bin/python benchmarks/task_overhead.py [--tasks 300] [--concurrency 2] [--delay S]

Needs PostgreSQL (ledger) and Redis (broker, results) on 127.0.0.1; the provider is the
fake provider in this process, answering at once or, with ``--delay``, after S seconds.
Both kinds alternate in rounds so machine load affects both alike. ``services()`` and
the helpers below are shared with ``run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from budget_tasks import Ledger  # noqa: E402
from budget_tasks.demo.processes import worker_env  # noqa: E402
from budget_tasks.testing import FakeProvider  # noqa: E402
from tests.workers import Worker  # noqa: E402

ADMIN_URL = os.environ.get(
    "BUDGET_TASKS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_DB = 10
#: Issue 42's target on the Quick start's path (a guarded SDK call, two commits per run);
#: the older 0.85 was set for the call helpers' path, which left the package.
TARGET = 0.75
RESULT_TIMEOUT = 300.0


@dataclass
class Services:
    """A scratch ledger database, a flushed Redis database, the fake provider, a client
    app, and the workers started on them (stopped when the ``services()`` block ends)."""

    app: Celery
    ledger: Ledger
    ledger_url: str
    fake: FakeProvider
    env: dict[str, str]
    log_dir: Path
    workers: list[Worker] = field(default_factory=list)

    def start_worker(self, name: str, concurrency: int, queues: Sequence[str] = ()) -> Worker:
        worker = Worker(
            self.env,
            f"{name}-{uuid.uuid4().hex[:6]}",
            self.log_dir,
            concurrency,
            include="benchmarks.bench_tasks",
            queues=queues,
        )
        self.workers.append(worker)
        return worker.wait_ready()

    def stop_workers(self) -> None:
        while self.workers:
            self.workers.pop().stop()


@contextmanager
def services(admin_url: str = ADMIN_URL, redis_db: int = REDIS_DB) -> Iterator[Services]:
    db = f"bt_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    ledger_url = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    ledger_url += f"/{db}"
    broker = f"redis://{REDIS_HOST}:{REDIS_PORT}/{redis_db}"
    redis.Redis(REDIS_HOST, REDIS_PORT, db=redis_db).flushdb()
    ledger = Ledger(ledger_url)
    stack = None
    try:
        ledger.create_schema()
        ledger.create_budget("bench", 10**14)
        with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
            env = worker_env(
                broker=broker, ledger=ledger_url, home=tmp, provider=fake.openai_base_url
            )
            app = Celery("bench-client", broker=broker, backend=broker, set_as_current=False)
            app.conf.broker_connection_retry_on_startup = True
            stack = Services(app, ledger, ledger_url, fake, env, Path(tmp))
            try:
                yield stack
            finally:
                stack.stop_workers()
                app.close()
    finally:
        ledger.dispose()
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        redis.Redis(REDIS_HOST, REDIS_PORT, db=redis_db).flushdb()


def _kwargs(delay: float) -> dict[str, Any]:
    """The bench tasks' keyword arguments: ``delay`` only when there is one."""
    return {"delay": delay} if delay else {}


def run_all_of(
    app: Celery, name: str, keys: Sequence[str], delay: float = 0.0
) -> tuple[float, list[Any]]:
    """Send one task per key at once and wait for every result: (seconds, results)."""
    started = time.perf_counter()
    pending = [app.send_task(name, args=[key], kwargs=_kwargs(delay)) for key in keys]
    results = [r.get(timeout=RESULT_TIMEOUT) for r in pending]
    return time.perf_counter() - started, results


def throughput(app: Celery, name: str, tasks: int, delay: float = 0.0) -> float:
    tag = uuid.uuid4().hex[:8]
    seconds, _ = run_all_of(app, name, [f"{tag}-{n}" for n in range(tasks)], delay)
    return tasks / seconds


def latency(app: Celery, name: str, key: str, delay: float = 0.0) -> tuple[float, Any]:
    """Enqueue to result for one task alone: (seconds, result)."""
    started = time.perf_counter()
    result = app.send_task(name, args=[key], kwargs=_kwargs(delay)).get(timeout=60)
    return time.perf_counter() - started, result


def latencies(app: Celery, name: str, count: int, delay: float = 0.0) -> list[float]:
    tag = uuid.uuid4().hex[:8]
    return [latency(app, name, f"{tag}-lat-{n}", delay)[0] for n in range(count)]


@dataclass
class OverheadResult:
    """Tasks/s per round and latency samples (s), plain and BudgetTask."""

    plain_tp: list[float]
    budget_tp: list[float]
    plain_lat: list[float]
    budget_lat: list[float]

    @property
    def plain(self) -> float:
        return statistics.median(self.plain_tp)

    @property
    def budgeted(self) -> float:
        return statistics.median(self.budget_tp)

    @property
    def plain_ms(self) -> float:
        return statistics.median(self.plain_lat) * 1e3

    @property
    def budgeted_ms(self) -> float:
        return statistics.median(self.budget_lat) * 1e3


def run_overhead(
    app: Celery,
    *,
    tasks: int,
    rounds: int,
    latency_samples: int,
    delay: float = 0.0,
    warm: bool = True,
) -> OverheadResult:
    """On a running worker: throughput rounds alternating, then latency samples
    alternating one plain, one BudgetTask; every provider call takes ``delay`` seconds
    at the fake provider. ``warm``: first a short batch of each kind (not measured)."""
    if warm:
        for name in ("bench.plain", "bench.budgeted"):
            throughput(app, name, min(20, tasks), delay)
    plain_tp, budget_tp = [], []
    for _ in range(rounds):
        plain_tp.append(throughput(app, "bench.plain", tasks, delay))
        budget_tp.append(throughput(app, "bench.budgeted", tasks, delay))
    tag = uuid.uuid4().hex[:8]
    plain_lat, budget_lat = [], []
    for n in range(latency_samples):
        plain_lat.append(latency(app, "bench.plain", f"{tag}-lat-{n}", delay)[0])
        budget_lat.append(latency(app, "bench.budgeted", f"{tag}-lat-{n}", delay)[0])
    return OverheadResult(plain_tp, budget_tp, plain_lat, budget_lat)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--latency-samples", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds the fake provider takes per call"
    )
    args = parser.parse_args()

    with services() as stack:
        stack.start_worker("bench", args.concurrency)
        result = run_overhead(
            stack.app,
            tasks=args.tasks,
            rounds=args.rounds,
            latency_samples=args.latency_samples,
            delay=args.delay,
        )
        audit = stack.ledger.audit()
    p, b = result.plain, result.budgeted
    pl, bl = result.plain_ms, result.budgeted_ms
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; worker prefork concurrency {args.concurrency}, "
        "acks_late, prefetch 1, Redis broker and results, PostgreSQL ledger; provider call "
        f"{args.delay * 1e3:.0f} ms"
    )
    print(f"{'':>22} {'plain task':>12} {'BudgetTask':>12} {'ratio':>7}")
    print(f"{'throughput (tasks/s)':>22} {p:>12.1f} {b:>12.1f} {b / p:>7.2f}")
    print(f"{'median latency (ms)':>22} {pl:>12.1f} {bl:>12.1f} {'+' + format(bl - pl, '.1f'):>7}")
    print(f"ledger audit after the run: {audit or 'clean'}")
    print(
        f"target: BudgetTask >= {TARGET} x plain throughput: "
        f"{'met' if b / p >= TARGET else 'NOT met'}"
    )
    return 0 if not audit else 1


if __name__ == "__main__":
    sys.exit(main())
