"""Run a function in many OS processes released at the same instant."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any


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
