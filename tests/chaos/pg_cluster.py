"""A PostgreSQL cluster of the test's own, to stop and start under load.

The shared server on 5432 is everyone's; a chaos test that takes PostgreSQL down needs
one nobody else uses. ``initdb`` refuses to run as root, so the cluster belongs to the
``postgres`` OS user and lives in a temporary directory owned by it: trust
authentication, TCP on 127.0.0.1 on a free port, its unix socket inside that directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from ..services import missing

OS_USER = "postgres"


def pg_bin_dir() -> Path | None:
    """The newest installed PostgreSQL's bin directory (env BUDGET_TASKS_PG_BIN wins)."""
    override = os.environ.get("BUDGET_TASKS_PG_BIN")
    if override:
        return Path(override)
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found:
        on_path = shutil.which("initdb")
        return Path(on_path).parent if on_path else None
    newest = max(found, key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(newest).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """One ``initdb``-made cluster; ``start()``, ``stop()`` (immediate by default)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="bt-chaos-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log_path = self.root / "postgres.log"
        self.port = free_port()
        self.sockets.mkdir()
        # initdb refuses root: as root, the cluster belongs to the postgres OS user
        user = pwd.getpwnam(OS_USER) if os.geteuid() == 0 else None
        if user is not None:
            for path in (self.root, self.sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._as_postgres = user is not None

    # -- commands ----------------------------------------------------------------------

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", OS_USER, "--", *command]
        done = subprocess.run(
            command,
            cwd=self.root,  # the postgres user may not enter the caller's directory
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                f"{self.log_tail()}"
            )
        return done

    def init(self) -> PgCluster:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
            "--no-sync",
            "--no-instructions",
        )
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.sockets}'",
            "max_connections": "100",
            "shared_buffers": "16MB",
            # Only the postmaster dies here, never the machine: committed WAL in the
            # page cache survives, so crash recovery after an immediate stop is real.
            "fsync": "off",
            "logging_collector": "off",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n# tests/chaos/pg_cluster.py\n")
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        return self

    def start(self, timeout: float = 60) -> float:
        """Start the server and wait until it accepts connections; returns the time
        it came up (``time.time()``)."""
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(int(timeout)),
            "start",
            timeout=timeout + 10,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.conninfo(), connect_timeout=2).close()
                return time.time()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "immediate") -> float:
        """Stop the server; ``immediate`` kills every backend at once, as a crash does
        (crash recovery runs at the next start). Returns the time it was down."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        down = time.time()
        assert not self.accepts_connections(), "PostgreSQL still answers after the stop"
        return down

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def close(self) -> None:
        if self.running():
            with contextlib.suppress(RuntimeError, AssertionError, subprocess.TimeoutExpired):
                self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- addresses ---------------------------------------------------------------------

    def conninfo(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of a database of this cluster."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "chaos") -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.conninfo(), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return f"--- {self.log_path} ---\n{self.log_path.read_text()[-chars:]}"
        except OSError:
            return ""


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[PgCluster]:
    """A running PostgreSQL cluster of this test module's own, removed after it."""
    bin_dir = pg_bin_dir()
    if bin_dir is None or not (bin_dir / "initdb").exists():
        missing("PostgreSQL binaries (initdb)", "not found under /usr/lib/postgresql")
    assert bin_dir is not None
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            missing("runuser", "initdb refuses root and runuser is not installed")
        try:
            pwd.getpwnam(OS_USER)
        except KeyError as exc:
            missing(f"the {OS_USER} OS user", exc)
    cluster = PgCluster(bin_dir)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.close()
