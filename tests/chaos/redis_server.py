"""A redis-server of the test's own, to SIGKILL and start again on the same port.

The shared Redis on 6379 is everyone's; a chaos test that kills the broker needs one
nobody else uses. It runs without persistence (``--save '' --appendonly no``), so a
kill loses every queued and unacked message, as a real crash of such a server would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = os.environ.get("BUDGET_TASKS_REDIS_SERVER", "/usr/bin/redis-server")


def redis_server_binary() -> str | None:
    if os.access(REDIS_SERVER, os.X_OK):
        return REDIS_SERVER
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``redis-server`` on 127.0.0.1:<port>, its files and log in ``directory``."""

    def __init__(self, binary: str, directory: Path, port: int | None = None) -> None:
        self.binary = binary
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis("127.0.0.1", self.port, socket_connect_timeout=2, socket_timeout=5)

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start on ``self.port`` (the same one after a kill) and wait for PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = self.log_path.open("a")
        log.write(f"--- start {self.starts} ---\n")
        log.flush()
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break  # e.g. the port was taken in between: the log says so
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; whatever it held in memory is gone."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def restart(self, down_for: float = 0.0) -> None:
        """Kill, stay down ``down_for`` seconds, start again on the same port."""
        self.kill()
        if down_for:
            time.sleep(down_for)
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return "(no log)"
