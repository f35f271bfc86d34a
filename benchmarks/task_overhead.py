"""BudgetTask against a plain Celery task making the same provider call, on the same
worker settings, in one run: throughput ratio and added median latency.

    .venv/bin/python benchmarks/task_overhead.py [--tasks 300] [--concurrency 2]

Needs PostgreSQL (ledger) and Redis (broker, results) on 127.0.0.1; the provider is the
fake provider in this process. Both kinds alternate in rounds so machine load affects
both alike.
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
from pathlib import Path

import psycopg
import redis
from celery import Celery

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from budget_tasks import Ledger  # noqa: E402
from budget_tasks.testing import FakeProvider  # noqa: E402
from tests.workers import Worker  # noqa: E402

ADMIN_URL = os.environ.get(
    "BUDGET_TASKS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_DB = 10
TARGET = 0.85


def throughput(app: Celery, name: str, tasks: int) -> float:
    tag = uuid.uuid4().hex[:8]
    started = time.perf_counter()
    results = [app.send_task(name, args=[f"{tag}-{n}"]) for n in range(tasks)]
    for r in results:
        r.get(timeout=300)
    return tasks / (time.perf_counter() - started)


def latencies(app: Celery, name: str, count: int) -> list[float]:
    tag = uuid.uuid4().hex[:8]
    out = []
    for n in range(count):
        started = time.perf_counter()
        app.send_task(name, args=[f"{tag}-lat-{n}"]).get(timeout=60)
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--latency-samples", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    db = f"bt_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    ledger_url = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    ledger_url += f"/{db}"
    broker = f"redis://127.0.0.1:6379/{REDIS_DB}"
    redis.Redis(db=REDIS_DB).flushdb()
    ledger = Ledger(ledger_url)
    ledger.create_schema()
    ledger.create_budget("bench", 10**14)
    worker = None
    try:
        with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "BUDGET_"))},
                "CELERY_BROKER_URL": broker,
                "CELERY_RESULT_BACKEND": broker,
                "BUDGET_TASKS_LEDGER_URL": ledger_url,
                "BUDGET_TASKS_HOME": tmp,
                "OPENAI_BASE_URL": fake.openai_base_url,
            }
            worker = Worker(
                env, "bench", Path(tmp), args.concurrency, include="benchmarks.bench_tasks"
            ).wait_ready()
            app = Celery("bench-client", broker=broker, backend=broker, set_as_current=False)
            for name in ("bench.plain", "bench.budgeted"):  # warm both paths
                throughput(app, name, 20)
            plain_tp, budget_tp = [], []
            for _ in range(args.rounds):
                plain_tp.append(throughput(app, "bench.plain", args.tasks))
                budget_tp.append(throughput(app, "bench.budgeted", args.tasks))
            plain_lat = latencies(app, "bench.plain", args.latency_samples)
            budget_lat = latencies(app, "bench.budgeted", args.latency_samples)
            app.close()
        p, b = statistics.median(plain_tp), statistics.median(budget_tp)
        pl, bl = statistics.median(plain_lat) * 1e3, statistics.median(budget_lat) * 1e3
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; worker prefork concurrency {args.concurrency}, "
            "acks_late, prefetch 1, Redis broker and results, PostgreSQL ledger"
        )
        print(f"{'':>22} {'plain task':>12} {'BudgetTask':>12} {'ratio':>7}")
        print(f"{'throughput (tasks/s)':>22} {p:>12.1f} {b:>12.1f} {b / p:>7.2f}")
        print(
            f"{'median latency (ms)':>22} {pl:>12.1f} {bl:>12.1f} {'+' + format(bl - pl, '.1f'):>7}"
        )
        audit = ledger.audit()
        print(f"ledger audit after the run: {audit or 'clean'}")
        print(
            f"target: BudgetTask >= {TARGET} x plain throughput: "
            f"{'met' if b / p >= TARGET else 'NOT met'}"
        )
        return 0 if not audit else 1
    finally:
        if worker is not None:
            worker.stop()
        ledger.dispose()
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
