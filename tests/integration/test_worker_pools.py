"""The ledger inside a real ``celery worker``, for each pool this project supports:
prefork with a new child per task (``--max-tasks-per-child=1``) and the metrics server
on in the main process, and the threads pool. Hundreds of tasks and scrapes at once;
PostgreSQL's ``pg_stat_activity`` sampled throughout: the number of the ledger's
connections stays bounded, and every answer is right.

What this guards: connections belong to the unit of work that uses them (a scrape
thread or a pool thread that ends holds none), and a forked child never touches the
connections it inherited from the main process."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from budget_tasks import Ledger
from budget_tasks.providers import estimates
from budget_tasks.testing import FakeProvider

from ..services import pg_conninfo
from ..workers import Worker
from .worker_tasks import fixed_request

TASKS = 200
# A new child per task: Celery replaces children at about 1.5 a second here whatever
# the concurrency, so the prefork run is shorter (120 tasks, during 120 scrapes).
PREFORK_TASKS = 120

# hundreds of tasks through real workers (a fork per task for prefork): slow on a
# loaded machine, so more than the suite's default of 300 s before calling it a hang
pytestmark = pytest.mark.timeout(900)


def socket_ports(pids: list[int]) -> set[int]:
    """The local TCP ports of the sockets these processes hold open (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # a child that has just exited
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class ConnectionSampler(threading.Thread):
    """Counts the worker's sessions on the test database every 50 ms; keeps the most.

    A session is the worker's when its client port is a socket held by the worker's
    main process or one of its children: the test process's own pools (this and earlier
    tests') are not counted."""

    def __init__(self, url: str, worker: Worker) -> None:
        super().__init__(daemon=True)
        self.url, self.worker, self.most, self.samples = url, worker, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        with psycopg.connect(pg_conninfo(self.url), autocommit=True) as conn:
            database = self.url.rsplit("/", 1)[1]
            while not self.done.is_set():
                clients = [
                    port
                    for (port,) in conn.execute(
                        "SELECT client_port FROM pg_stat_activity "
                        "WHERE datname = %s AND application_name = 'budget-tasks'",
                        (database,),
                    ).fetchall()
                ]
                ours = socket_ports([self.worker.proc.pid, *self.worker.children()])
                count = sum(port in ours for port in clients)
                self.most, self.samples = max(self.most, count), self.samples + 1
                time.sleep(0.05)

    def stop(self) -> int:
        self.done.set()
        self.join(10)
        assert self.samples > 10, "the sampler must have watched the run"
        assert self.most >= 1, "the sampler must have seen the worker's sessions"
        return self.most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as response:
        assert response.status == 200
        body = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def run_tasks(
    client: Celery, during: Callable[[], None] | None = None, count: int = TASKS
) -> list[Any]:
    results = [client.send_task("tests.fixed_cost", args=[n]) for n in range(count)]
    if during is not None:
        during()
    return [r.get(timeout=240) for r in results]


def test_prefork_with_a_child_per_task_and_the_metrics_server_on(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    tmp_path: Path,
) -> None:
    each = estimates.openai_chat(fixed_request(0)).amount
    pg_ledger.create_budget("pooled", 10**9, period="day")
    port = free_port()
    (tmp_path / "prom").mkdir()
    worker = start_worker(
        "prefork",
        concurrency=2,
        options={"max_tasks_per_child": 1},  # a new child, forked from the main process, per task
        BUDGET_TASKS_BUDGET="pooled",
        BUDGET_TASKS_METRICS_PORT=str(port),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"),
    )
    scrape(port)  # the main process uses the ledger before any child is forked
    sampler = ConnectionSampler(pg_url, worker)
    sampler.start()
    scraped: list[int] = []
    failures: list[str] = []

    def scrape_meanwhile() -> None:
        def scraper() -> None:
            for _ in range(40):  # far more scrapes than the pool has connections
                try:
                    samples = scrape(port)
                    scraped.append(int(samples[("budget_tasks_cap", (("budget", "pooled"),))]))
                except Exception as exc:  # reported below: every scrape must answer
                    failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=scraper) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)

    values = run_tasks(client, scrape_meanwhile, PREFORK_TASKS)
    most = sampler.stop()
    print(f"prefork: {PREFORK_TASKS} tasks, {len(scraped)} scrapes, at most {most} sessions")
    assert values == list(range(PREFORK_TASKS))
    assert failures == []
    assert scraped == [10**9] * 120
    real = Ledger(pg_url)
    bal = real.balance("pooled")
    real.dispose()
    assert (bal.spent, bal.held) == (PREFORK_TASKS * each, 0)
    final = scrape(port)
    assert final[("budget_tasks_spent", (("budget", "pooled"),))] == PREFORK_TASKS * each
    assert final[("budget_tasks_admissions_total", (("budget", "pooled"),))] == PREFORK_TASKS
    # the main process's pool, plus two children's: not one per scrape or per task
    assert most <= 16, most
    assert pg_ledger.audit() == []


def test_threads_pool_shares_one_pool_and_opens_a_new_period_under_load(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
) -> None:
    """Ten threads take tasks at once; the first reservation opens the budget's period
    (another statement on another connection) while the others hold theirs."""
    each = estimates.openai_chat(fixed_request(0)).amount
    pg_ledger.create_budget("threaded", 10**9, period="day")
    worker = start_worker(
        "threads", concurrency=10, options={"pool": "threads"}, BUDGET_TASKS_BUDGET="threaded"
    )
    sampler = ConnectionSampler(pg_url, worker)
    sampler.start()
    values = run_tasks(client)
    most = sampler.stop()
    print(f"threads: {TASKS} tasks, at most {most} ledger sessions")
    assert values == list(range(TASKS))
    real = Ledger(pg_url)
    bal = real.balance("threaded")
    sent = [s for s in fake.served_as(real) if (s.idempotency_key or "").startswith("fixed:")]
    real.dispose()
    assert (bal.spent, bal.held) == (TASKS * each, 0)
    assert len(sent) == TASKS
    assert most <= 10, most  # one process: its pool's limit (2 + 8 overflow)
    assert pg_ledger.audit() == []
