"""Blocking work an async caller awaits without holding its event loop: a ledger
admission that may wait its turn in a rate window's line (seconds, or minutes) runs on
a thread of its own, in the caller's context, while the loop serves the caller's other
tasks."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def off_the_loop(work: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
    """``work()`` run on a new thread in a copy of this context; its result or error.
    Should the awaiting task be cancelled before it hears (or its loop close), ``undo``
    is given the result once it comes, on that thread: what ``work`` reserved for a
    caller that is gone is given back."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()
    gone = threading.Event()

    def given_back(result: T) -> None:
        if undo is not None:
            context.run(undo, result)

    def hand(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            if error is None:
                threading.Thread(target=given_back, args=(result,), daemon=True).start()
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = context.run(work)
        except BaseException as error:  # handed to the awaiting task, raised there
            # the loop closed meanwhile: nobody awaits it
            with contextlib.suppress(RuntimeError):
                if not gone.is_set():
                    loop.call_soon_threadsafe(hand, None, error)
            return
        if gone.is_set():
            given_back(result)
            return
        try:
            loop.call_soon_threadsafe(hand, result, None)
        except RuntimeError:  # the loop closed meanwhile: nobody will hear of it
            given_back(result)

    threading.Thread(target=run, name="budget-tasks-admission", daemon=True).start()
    try:
        return await future
    except asyncio.CancelledError:
        gone.set()
        raise
