"""The demo's processes: real ``celery worker`` processes, started and stopped (the
demo runs its scenario on them; the project's tests use them too), and a function
run in many OS processes released at the same instant."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any


def worker_env(
    *,
    broker: str,
    ledger: str,
    home: Path | str,
    provider: str | None = None,
    backend: str | None = None,
    **settings: str,
) -> dict[str, str]:
    """The environment for a ``celery -A workers.app worker``: this process's,
    without its own ``CELERY_*``/``BUDGET_*`` variables, plus the reference app's
    settings under the names its ``celeryconfig.py`` reads (results on the broker
    unless ``backend`` is given; the OpenAI-compatible ``provider`` URL, with a fake
    key; any more ``settings`` as they are)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "BUDGET_"))}
    env.update(
        CELERY_BROKER_URL=broker,
        CELERY_RESULT_BACKEND=backend or broker,
        BUDGET_TASKS_LEDGER_URL=ledger,
        BUDGET_TASKS_HOME=str(home),
    )
    if provider is not None:
        env["OPENAI_BASE_URL"] = provider
        # the fake's own key: a real one in this shell is not sent to a test provider
        env["OPENAI_API_KEY"] = "sk-fake"
    env.update(settings)
    return env


def wait_for(condition: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    """Poll ``condition`` every 50 ms until it returns something true, and return that;
    TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(0.05)


class Worker:
    """``celery -A <app> worker`` in its own process group.

    ``include`` names extra task modules (``-I``); the log goes to
    ``log_dir/<name>.log``. ``cwd`` is where the app module is importable from;
    ``pool`` is Celery's ``--pool`` (prefork, threads, solo) and ``max_tasks_per_child``
    its ``--max-tasks-per-child``; ``prefix`` runs it under another command (``unshare
    ... sh -c ...``: a host of its own) that ends by running what follows it; ``command``
    is ``worker`` or ``beat``; ``queues`` the queues it consumes (``-Q``; none: the
    default one).
    """

    def __init__(
        self,
        env: dict[str, str],
        name: str,
        log_dir: Path,
        concurrency: int = 1,
        include: str = "tests.integration.worker_tasks",
        *,
        app: str = "budget_tasks.reference.workers.app",
        cwd: Path | None = None,
        pool: str = "prefork",
        max_tasks_per_child: int | None = None,
        prefix: Sequence[str] = (),
        command: str = "worker",
        queues: Sequence[str] = (),
    ):
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("w")
        args = [*prefix, sys.executable, "-m", "celery", "-A", app, command, "--loglevel=INFO"]
        if command == "worker":
            args += [f"--concurrency={concurrency}", f"--pool={pool}", "-n", f"{name}@%h"]
            if max_tasks_per_child is not None:
                args.append(f"--max-tasks-per-child={max_tasks_per_child}")
            args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            if include:
                args += ["-I", include]
            if queues:
                args += ["-Q", ",".join(queues)]
        else:
            args += ["--schedule", str(log_dir / f"{name}.schedule")]
        self.proc = subprocess.Popen(
            args,
            cwd=cwd or Path.cwd(),
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90.0, mark: str = "ready.") -> Worker:
        """Block until the worker logs ``mark``; RuntimeError with its log if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if mark in self.log_path.read_text():
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

    def kill(self) -> None:
        """SIGKILL the whole process group at once: the machine died."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group (warm shutdown), SIGKILL it after ``timeout``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


def _contender(
    fn: Callable[..., Any], index: int, args: Sequence[Any], barrier: Barrier, out: Queue[Any]
) -> None:
    try:
        barrier.wait(timeout=120)
        out.put((index, True, fn(*args)))
    except BaseException as exc:  # reported to the parent, which re-raises
        out.put((index, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def race(
    fn: Callable[..., Any], calls: Sequence[Sequence[Any]], *, timeout: float = 300.0
) -> list[Any]:
    """Call ``fn(*args)`` for each ``args`` in its own spawned process.

    Every process waits at one barrier so the calls start together; each opens its
    own connections. Returns the results in call order; a failure in any child
    raises RuntimeError with its traceback. ``fn`` must be importable (module level).
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(calls))
    out: Queue[Any] = ctx.Queue()
    procs = [
        ctx.Process(target=_contender, args=(fn, i, tuple(args), barrier, out), daemon=True)
        for i, args in enumerate(calls)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in procs:
            index, ok, value = out.get(timeout=timeout)
            if ok:
                results[index] = value
            else:
                failures.append(f"call {index}: {value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("child process failed:\n" + "\n".join(failures))
    return [results[i] for i in range(len(calls))]
