"""Simulated hosts: each a ``celery worker`` (prefork, two children) in a UTS and PID
namespace of its own (``unshare --uts --pid --fork --mount-proc``, as root; its own
hostname), reaching PostgreSQL and Redis only through fault proxies of its own on a
loopback address of its own (127.0.0.1x). A test cuts, black-holes, slows and heals
one host's path to one service, or kills the whole host (every process of its
namespace at once). A host made with ``hidepid=True`` keeps all its processes in one
set of namespaces (joined with nsenter, each as the user it names), its /proc
mounted ``hidepid=2``: another user's processes there are invisible. The fixture
stops every host and proxy it made, also when a test fails, and then prints each
host's log.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy.engine import URL, make_url

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import FaultProxy, worker_env

from ..chaos.conftest import celery_client
from ..services import REDIS_HOST, REDIS_PORT, check_redis, missing, redis_db
from ..workers import ROOT, Worker

HOST_TASKS = "tests.hosts.host_tasks"
BEAT_READY = "beat: Starting..."
REDIS_DB = redis_db("hosts")  # flushed before each test
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


def _interpreter_opened(stage: Path) -> str:
    """Shell commands that let any user run this interpreter inside a host's mount
    namespace, or "" where they can already.

    An interpreter under a directory other users may not enter (a pyenv in /root) runs
    for them with another libpython, or not at all. Inside the host's own mount
    namespace (private: nothing leaks out), a tmpfs that anyone may enter covers that
    directory, with the interpreter's tree bound back into it."""
    path = Path(os.path.realpath(sys._base_executable))  # type: ignore[attr-defined]
    for closed in reversed(path.parents):
        if closed != Path("/") and not closed.stat().st_mode & stat.S_IXOTH:
            break
    else:
        return ""
    inner = closed / path.relative_to(closed).parts[0]
    q = shlex.quote
    return (
        f" && mount --bind {q(str(inner))} {q(str(stage))}"
        f" && mount -t tmpfs -o mode=0755 tmpfs {q(str(closed))}"
        f" && mkdir {q(str(inner))} && mount --bind {q(str(stage))} {q(str(inner))}"
    )


def _anchor(name: str, stage: Path) -> subprocess.Popen[bytes]:
    """The namespaces of a host whose /proc is mounted ``hidepid=2``: their PID 1
    names the host, mounts /proc so, and sleeps; processes join with nsenter."""
    script = (
        'hostname "$0" && mount -t proc -o hidepid=2 proc /proc'
        f"{_interpreter_opened(stage)} && exec sleep 3600"
    )
    return subprocess.Popen([*_namespaces(), "sh", "-c", script, name], start_new_session=True)


def _namespace_init(anchor: subprocess.Popen[bytes], timeout: float = 10) -> int:
    """The pid (here) of the anchor's namespace PID 1, once it sleeps (set up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if anchor.poll() is not None:
            raise RuntimeError(f"the host's namespaces did not start (exit {anchor.returncode})")
        for child in Path(f"/proc/{anchor.pid}/task/{anchor.pid}/children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == "sleep":
                return int(child)
        time.sleep(0.05)
    raise TimeoutError("the host's namespaces were not set up in time")


class Host:
    """One simulated host: its proxies to PostgreSQL and Redis, and its processes."""

    def __init__(
        self,
        name: str,
        index: int,
        pg_url: str,
        fake: FakeProvider,
        log_dir: Path,
        *,
        hidepid: bool = False,
        standby: str | None = None,
    ) -> None:
        for tool in ("nsenter", "setpriv", "mount") if hidepid else ():
            if shutil.which(tool) is None:  # before anything is made that would leak
                missing(tool, "a hidepid host joins its namespaces with it")
        self.name = name
        self.address = f"127.0.0.{10 + index}"
        pg = make_url(pg_url)
        self.pg = FaultProxy(pg.host or "127.0.0.1", pg.port or 5432, listen_host=self.address)
        self.redis = FaultProxy(REDIS_HOST, REDIS_PORT, listen_host=self.address)
        self.ledger_url = pg.set(host=self.address, port=self.pg.port).render_as_string(
            hide_password=False
        )
        #: With ``standby`` (a second server's URL, same database), a proxy to it too,
        #: and a multi-host ledger URL: libpq tries the primary's path, then the
        #: standby's, and keeps the first that accepts writes (as after a failover).
        self.pg_standby: FaultProxy | None = None
        if standby is not None:
            other = make_url(standby)
            self.pg_standby = FaultProxy(
                other.host or "127.0.0.1", other.port or 5432, listen_host=self.address
            )
            paths = (f"{self.address}:{self.pg.port}", f"{self.address}:{self.pg_standby.port}")
            multi = {**pg.query, "host": paths, "target_session_attrs": "read-write"}
            self.ledger_url = URL.create(
                pg.drivername, pg.username, pg.password, database=pg.database, query=multi
            ).render_as_string(hide_password=False)
        self.broker = f"redis://{self.address}:{self.redis.port}/{REDIS_DB}"
        self._fake = fake
        self._log_dir = log_dir
        self.processes: list[Worker] = []
        #: With ``hidepid``, every process of the host shares one set of namespaces,
        #: held by this anchor (its PID 1), whose /proc is mounted ``hidepid=2``.
        self._anchor: subprocess.Popen[bytes] | None = None
        self._anchor_pid = 0
        if hidepid:
            stage = log_dir / f"{name}-stage"
            stage.mkdir()
            self._anchor = _anchor(self.name, stage)
            try:
                self._anchor_pid = _namespace_init(self._anchor)
            except BaseException:
                self.close()
                raise

    def _prefix(self, user: int | None = None) -> list[str]:
        if self._anchor is None:
            # the namespace's first process names the host, then becomes the worker
            return [*_namespaces(), "sh", "-c", 'hostname "$0" && exec "$@"', self.name]
        entered = [
            "nsenter",
            f"--target={self._anchor_pid}",
            "--uts",
            "--pid",
            "--mount",
            f"--wd={ROOT}",
            "--",
        ]
        if user is None:
            return entered
        return [*entered, "setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]

    def start(
        self, concurrency: int = 2, *, user: int | None = None, wait: bool = True, **env: str
    ) -> Worker:
        """A worker on this host (``env`` over SETTINGS), once it is ready (unless not
        ``wait``); ``user``: the uid it runs as (a host with ``hidepid`` only, whose
        processes share one PID namespace)."""
        if user is not None and self._anchor is None:
            raise ValueError("another user's worker shares a namespace: make the host hidepid")
        worker = Worker(
            self._env(env),
            f"{self.name}-{uuid.uuid4().hex[:4]}",
            self._log_dir,
            concurrency,
            include=HOST_TASKS,
            prefix=self._prefix(user),
        )
        self.processes.append(worker)
        return worker.wait_ready() if wait else worker

    def start_beat(self, *, wait: bool = True, **env: str) -> Worker:
        """``celery beat`` on this host (its schedule, as the workers' env, over
        SETTINGS), once it runs (unless not ``wait``)."""
        beat = Worker(
            self._env(env),
            f"{self.name}-beat-{uuid.uuid4().hex[:4]}",
            self._log_dir,
            app=HOST_TASKS,
            command="beat",
            prefix=self._prefix(),
        )
        self.processes.append(beat)
        return beat.wait_ready(mark=BEAT_READY) if wait else beat

    def run(self, argv: list[str], *, user: int | None = None) -> str:
        """Run ``argv`` in this host's namespaces (as ``user``); its output."""
        done = subprocess.run(
            [*self._prefix(user), *argv], capture_output=True, text=True, timeout=60, check=True
        )
        return done.stdout

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
        if self._anchor is not None and self._anchor.poll() is None:
            # its PID 1 gone, the kernel kills whatever is left in the namespace
            os.killpg(self._anchor.pid, signal.SIGKILL)
            self._anchor.wait(timeout=10)
        self.pg.close()
        if self.pg_standby is not None:
            self.pg_standby.close()
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

    def make(
        name: str, *, hidepid: bool = False, ledger: str | None = None, standby: str | None = None
    ) -> Host:
        """``ledger``: the URL of another ledger than the session's (``standby``: its
        synchronous standby's)."""
        host = Host(
            name, len(made), ledger or pg_url, fake, tmp_path, hidepid=hidepid, standby=standby
        )
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


#: Per scenario, the counts of its last run (``hosts_counts``), printed at the end of
#: the session and written as JSON to ``$HOSTS_COUNTS_FILE`` if set: the figures of
#: docs' per-scenario table come from a real run.
COUNTS_ENV = "HOSTS_COUNTS_FILE"
_counts: dict[str, dict[str, int]] = {}


@pytest.fixture
def hosts_counts(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``hosts_counts(5, tasks=12, ...)``: this scenario's counts from this run."""

    def record(scenario: int, **counts: int) -> None:
        _counts[f"{scenario}: {request.node.name}"] = counts
        print(f"hosts counts, scenario {scenario}: {counts}")

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _counts:
        return
    terminalreporter.section("hosts suite: counts per scenario")
    for name, counts in sorted(_counts.items()):
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    target = os.environ.get(COUNTS_ENV)
    if target:
        Path(target).write_text(json.dumps(_counts, indent=2, sort_keys=True) + "\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"hosts_report_{report.when}", report)
    return report
