"""Fixtures of the chaos suite: a redis-server of the test's own (to kill), real
``celery worker`` processes on it with the chaos tasks, a PostgreSQL scratch ledger
(``pg_url`` / ``pg_ledger`` of tests/conftest.py) and the fake provider (``fake``).

On a failure, the teardown prints the tail of every worker's log and of redis-server's.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import worker_env

from ..services import missing
from ..workers import Worker
from .redis_server import RedisServer, redis_server_binary

CHAOS_TASKS = "tests.chaos.worker_tasks"
CLIENT_TRANSPORT_OPTIONS = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.2,
}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"chaos_report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"chaos_report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


def live_children(worker: Worker) -> list[int]:
    """Pool processes of ``worker`` that are alive (not zombies awaiting a reap)."""
    found = []
    for pid in worker.children():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(pid)
    return found


def sigkill(pid: int) -> bool:
    """SIGKILL ``pid``; False if it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def redis_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """This test's own redis-server (no persistence), to kill and restart."""
    binary = redis_server_binary()
    if binary is None:
        missing("redis-server", "no /usr/bin/redis-server (env BUDGET_TASKS_REDIS_SERVER)")
    assert binary is not None
    server = RedisServer(binary, tmp_path / "redis")
    try:
        server.start()
    except RuntimeError as exc:
        missing("redis-server", exc)
    yield server
    if _failed(request):
        print(f"\n--- redis-server log ({server.log_path}) ---\n{server.log_tail()}")
    server.stop()


@contextmanager
def celery_client(url: str, *, results: bool = True) -> Iterator[Celery]:
    """A Celery client app on ``url`` (results there too, unless ``results=False``:
    a sender that never waits for results, as a web front end that only enqueues)."""
    app = Celery("chaos-client", broker=url, backend=url if results else None, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    # A client that meets a dead broker says so at once: kombu's default is to keep
    # reconnecting for minutes inside send_task.
    app.conf.broker_transport_options = CLIENT_TRANSPORT_OPTIONS
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Celery]:
    """The test's Celery client: sends to, and reads results from, its own Redis."""
    with celery_client(redis_server.url) as app:
        yield app


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    """Where the chaos task's first-delivery kill points leave their marker files."""
    path = tmp_path / "markers"
    path.mkdir()
    return path


@pytest.fixture
def start_worker(
    redis_server: RedisServer,
    pg_ledger: Ledger,
    pg_url: str,
    fake: FakeProvider,
    markers: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Worker]]:
    """Start ``celery -A workers.app worker -I tests.chaos.worker_tasks`` on the test's
    Redis and the scratch ledger; env overrides as keyword arguments."""
    started: list[Worker] = []

    def start(name: str = "chaos", concurrency: int = 1, **env: str) -> Worker:
        full_env = worker_env(
            broker=redis_server.url,
            ledger=pg_url,
            home=tmp_path / "home",
            provider=fake.openai_base_url,
            **{"BUDGET_TASKS_PROVIDER_TIMEOUT": "30", "CHAOS_MARKER_DIR": str(markers), **env},
        )
        worker = Worker(
            full_env, f"{name}-{uuid.uuid4().hex[:6]}", tmp_path, concurrency, include=CHAOS_TASKS
        )
        started.append(worker)
        return worker.wait_ready()

    yield start
    for worker in started:
        worker.stop()
    if _failed(request):
        for worker in started:
            log = worker.log_path.read_text()
            # the broker's story first: a shutdown traceback can fill the tail
            events = [line for line in log.splitlines() if BROKER_EVENTS.search(line)]
            print(f"\n--- {worker.log_path.name} (broker events) ---\n" + "\n".join(events[-60:]))
            print(f"\n--- {worker.log_path.name} (tail) ---\n{log[-4000:]}")


BROKER_EVENTS = re.compile(
    r"Connected to|Connection to broker lost|Cannot connect|Trying again|consumer:|"
    r"Restoring|CRITICAL|ready\.|Warm shutdown"
)


def outcome(result: Any, timeout: float = 90.0) -> str:
    """A task's end as a word: 'ok', or the name of the error it raised."""
    try:
        result.get(timeout=timeout, propagate=True)
    except Exception as exc:  # the task's own error, re-raised by Celery
        return type(exc).__name__
    return "ok"
