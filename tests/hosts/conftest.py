"""Simulated hosts: each a ``celery worker`` (prefork, two children) in a UTS and PID
namespace of its own (``unshare --uts --pid --fork --mount-proc``, as root; its own
hostname), reaching PostgreSQL and Redis only through fault proxies of its own on a
loopback address of its own (127.0.0.1x). A test cuts, black-holes, slows and heals
one host's path to one service, or kills the whole host (every process of its
namespace at once). The fixture stops every host and proxy it made, also when a test
fails, and then prints each host's log.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy.engine import make_url

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from budget_tasks.testing.harness import worker_env
from budget_tasks.testing.proxy import FaultProxy

from ..chaos.conftest import celery_client
from ..services import REDIS_HOST, REDIS_PORT, check_redis, missing
from ..workers import Worker

HOST_TASKS = "tests.hosts.host_tasks"
REDIS_DB = 14  # the hosts suite's database on the shared Redis; flushed before each test
#: What every host runs with: Redis hands an unacknowledged message to another host
#: after 3 s, and a host looks for such messages every second.
SETTINGS = {
    "BUDGET_TASKS_VISIBILITY_TIMEOUT": "3",
    "BUDGET_TASKS_RESTORE_INTERVAL": "1",
    "BUDGET_TASKS_PROVIDER_TIMEOUT": "30",
    "BUDGET_TASKS_RECONCILE_MARGIN": "0",
}


def _namespaces() -> list[str]:
    if shutil.which("unshare") is None:
        missing("unshare", "not installed")
    probe = subprocess.run(
        ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "hostname", "probe"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        missing("UTS and PID namespaces", probe.stderr.decode().strip() or "unshare refused")
    return ["unshare", "--uts", "--pid", "--fork", "--mount-proc"]


class Host:
    """One simulated host: its proxies to PostgreSQL and Redis, and its processes."""

    def __init__(
        self, name: str, index: int, pg_url: str, fake: FakeProvider, log_dir: Path
    ) -> None:
        self.name = name
        self.address = f"127.0.0.{10 + index}"
        pg = make_url(pg_url)
        self.pg = FaultProxy(pg.host or "127.0.0.1", pg.port or 5432, listen_host=self.address)
        self.redis = FaultProxy(REDIS_HOST, REDIS_PORT, listen_host=self.address)
        self.ledger_url = pg.set(host=self.address, port=self.pg.port).render_as_string(
            hide_password=False
        )
        self.broker = f"redis://{self.address}:{self.redis.port}/{REDIS_DB}"
        self._fake = fake
        self._log_dir = log_dir
        self.processes: list[Worker] = []

    def _prefix(self) -> list[str]:
        # the namespace's first process names the host, then becomes the worker
        return [*_namespaces(), "sh", "-c", 'hostname "$0" && exec "$@"', self.name]

    def start(self, concurrency: int = 2, **env: str) -> Worker:
        """A worker on this host (``env`` over SETTINGS), once it is ready."""
        worker = Worker(
            self._env(env),
            f"{self.name}-{uuid.uuid4().hex[:4]}",
            self._log_dir,
            concurrency,
            include=HOST_TASKS,
            prefix=self._prefix(),
        )
        self.processes.append(worker)
        return worker.wait_ready()

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return worker_env(
            broker=self.broker,
            ledger=self.ledger_url,
            home=self._log_dir / f"{self.name}-home",
            provider=self._fake.openai_base_url,
            **{**SETTINGS, **env},
        )

    def kill(self) -> None:
        """The host dies: every process of its namespaces, SIGKILL, at once."""
        for process in self.processes:
            process.kill()

    def close(self) -> None:
        for process in self.processes:
            process.stop(timeout=10)
        self.pg.close()
        self.redis.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.log_path.name} ---\n{p.log_path.read_text()[-4000:]}" for p in self.processes
        )


@pytest.fixture
def client() -> Iterator[Celery]:
    """The test's Celery client, on the shared Redis directly (not through a host)."""
    check_redis()
    redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB).flushdb()
    with celery_client(f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}") as app:
        yield app


@pytest.fixture
def hosts(
    pg_url: str,
    pg_ledger: Ledger,
    fake: FakeProvider,
    tmp_path: Path,
    client: Celery,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Host]]:
    """Make hosts: ``hosts("host-a")``; each is stopped and its proxies closed after."""
    pg_ledger.create_budget("default", 10_000_000)
    made: list[Host] = []

    def make(name: str) -> Host:
        host = Host(name, len(made), pg_url, fake, tmp_path)
        made.append(host)
        return host

    yield make
    failed = any(
        getattr(getattr(request.node, f"hosts_report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )
    for host in made:
        host.close()
    if failed:
        for host in made:
            print(host.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"hosts_report_{report.when}", report)
    return report
