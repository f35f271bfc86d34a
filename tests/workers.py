"""Real ``celery worker`` processes for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Worker:
    """``celery -A workers worker`` with the test tasks, in its own process group."""

    def __init__(
        self,
        env: dict[str, str],
        name: str,
        log_dir: Path,
        concurrency: int = 1,
        include: str = "tests.integration.worker_tasks",
    ):
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers",
                "worker",
                "--loglevel=INFO",
                f"--concurrency={concurrency}",
                "--pool=prefork",
                "-n",
                f"{name}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-I",
                include,
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90.0) -> Worker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready." in self.log_path.read_text():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"worker did not start:\n{self.log_path.read_text()[-3000:]}")

    def children(self) -> list[int]:
        """Pool process ids (children of the main worker process)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                found.append(int(stat.parent.name))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()
