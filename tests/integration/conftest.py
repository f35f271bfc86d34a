"""Fixtures for the tests that run real ``celery worker`` processes: a Redis broker of
the tests' own, a client app, and workers started on the test's PostgreSQL ledger."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import worker_env

from ..hostile_gateway import HostileGateway
from ..services import REDIS_HOST, REDIS_PORT, check_redis, redis_db
from ..workers import Worker

REDIS_DB = redis_db("integration")  # flushed before each test


@pytest.fixture
def broker() -> str:
    check_redis()
    redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).flushdb()
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"


@pytest.fixture
def client(broker: str) -> Iterator[Celery]:
    app = Celery("test-client", broker=broker, backend=broker, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    yield app
    app.close()


@pytest.fixture
def start_worker(
    broker: str, pg_ledger: Ledger, pg_url: str, fake: FakeProvider, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    pg_ledger.create_budget("default", 10_000_000)
    started: list[Worker] = []

    def start(
        name: str = "w1", concurrency: int = 1, options: dict[str, Any] | None = None, **env: str
    ) -> Worker:
        """A worker on the test's ledger and fake provider; ``options`` go to Worker
        (``pool``, ``max_tasks_per_child``), ``env`` to its environment."""
        full_env = worker_env(
            broker=broker,
            ledger=pg_url,
            home=tmp_path / "home",
            provider=fake.openai_base_url,
            **{"BUDGET_TASKS_PROVIDER_TIMEOUT": "30", **env},
        )
        worker = Worker(
            full_env, f"{name}-{uuid.uuid4().hex[:6]}", tmp_path, concurrency, **(options or {})
        )
        started.append(worker)
        return worker.wait_ready()

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def gateway() -> Iterator[HostileGateway]:
    """A gateway that answers as a broken or malicious one (tests/hostile_gateway.py)."""
    server = HostileGateway().start()
    yield server
    server.stop()
