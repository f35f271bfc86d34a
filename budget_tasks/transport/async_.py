"""The guarded ``httpx2`` transport for the SDKs' async clients: the same flow as the
sync one (:mod:`budget_tasks.transport.flow`), awaiting the network. A call's admission
may wait its turn in its rate windows' line: it runs on a thread of its own, so the
event loop goes on serving the run's other calls meanwhile. The settlement's writes
are short and synchronous: they hold the loop for their round trip."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx2

from .. import bypass
from .._off_loop import off_the_loop
from ..providers.base import Kind
from . import guard
from .flow import Begun, StreamState, begin


class AsyncGuardedTransport(httpx2.AsyncBaseTransport):
    """An async ``httpx2`` transport that meters billable requests through the ledger."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport | None = None,
        *,
        allow_unguarded: bool = False,
        allow: tuple[str, ...] = (),
        prices: Any = None,
        vendor: str | None = None,
        image_tokens: int | None = None,
        store_for_lookup: bool = True,
    ) -> None:
        self.inner = inner or httpx2.AsyncHTTPTransport()
        self.options = guard.Options(
            allow_unguarded, tuple(allow), prices, vendor, image_tokens, store_for_lookup
        )

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        route = guard.decide(request, self.options)
        if route.kind is not Kind.METERED:
            return await self._pass(request)
        await request.aread()
        begun = await off_the_loop(partial(begin, route, request, self.options), _undo)
        if begun is None:
            return await self._pass(request)  # allowed outside a run
        try:
            answer, live = begun.replay(), False
            if answer is None:
                answer, live = await self._send(begun)
        except BaseException as exc:
            return begun.failed(exc)
        if not live:  # a live stream's call ends when the SDK has read it
            begun.done()
        return answer

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def _pass(self, request: httpx2.Request) -> httpx2.Response:
        with bypass.guarded():
            return await self.inner.handle_async_request(request)

    async def _send(self, begun: Begun) -> tuple[httpx2.Response, bool]:
        """The answer, and whether it is a live stream."""
        request = begun.addressed()
        response = await self._pass(request)
        begun.headers_arrived(response)
        if begun.m.streamed and response.status_code < 400:
            state = StreamState(begun, response, request)
            return state.response(_AsyncLiveStream(state)), True
        full = await response.aread()  # decoded: real APIs compress
        await response.aclose()
        return begun.answered(response, full, request), False


def _undo(begun: Begun | None) -> None:
    """A call admitted for a task that was cancelled before it heard: nothing was
    sent under it (its hold is given back)."""
    if begun is not None:
        # failed() raises what it was given back: the cancelled task is gone
        with contextlib.suppress(asyncio.CancelledError):
            begun.failed(asyncio.CancelledError())


class _AsyncLiveStream(httpx2.AsyncByteStream):
    """A streamed answer passed on as it arrives, decoded; settled at its end."""

    def __init__(self, state: StreamState) -> None:
        self.state = state

    async def __aiter__(self) -> AsyncIterator[bytes]:
        state = self.state
        if not state.first_read():
            return
        try:
            async for chunk in state.inner.aiter_bytes():
                for piece in state.feed(chunk):
                    yield piece
            for piece in state.tail():
                yield piece
        except GeneratorExit:
            state.finish(None)
            raise
        except BaseException as exc:
            state.finish(exc)
            raise
        state.finish(None)

    async def aclose(self) -> None:
        try:
            await self.state.inner.aclose()
        finally:
            self.state.finish(None)
