"""A labelled call's block as the run's code opens it: ``with`` in sync code, ``async
with`` in async code, where its admission runs off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType

from .._off_loop import off_the_loop
from .scope import Call


class SpendBlock(AbstractContextManager[Call], AbstractAsyncContextManager[Call]):
    """One labelled call's block (see ``BudgetTask.spend``): opened by ``open`` on
    entry, in either kind of ``with``."""

    def __init__(self, open: Callable[[], AbstractContextManager[Call]]) -> None:
        self._open = open
        self._block: AbstractContextManager[Call] | None = None

    def __enter__(self) -> Call:
        self._block = self._open()
        return self._block.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._block is not None, "a block is left only after it was entered"
        return self._block.__exit__(kind, exc, tb)

    async def __aenter__(self) -> Call:
        self._block = self._open()
        return await off_the_loop(self._block.__enter__, self._cancelled)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return self.__exit__(kind, exc, tb)

    def _cancelled(self, _: Call) -> None:
        """Entered for a task cancelled meanwhile: left as a block that sent nothing."""
        cancelled = asyncio.CancelledError()
        with contextlib.suppress(asyncio.CancelledError):
            self.__exit__(type(cancelled), cancelled, None)
