"""The guarded ``httpx2`` transport, for the SDKs' sync clients (see
:mod:`budget_tasks.transport.guard` for the steps it takes, and
:mod:`budget_tasks.transport.flow` for what it shares with the async one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2

from .. import bypass
from ..providers.base import Kind
from . import guard
from .flow import Begun, StreamState, begin


class GuardedTransport(httpx2.BaseTransport):
    """An ``httpx2`` transport that meters billable requests through the ledger."""

    def __init__(
        self,
        inner: httpx2.BaseTransport | None = None,
        *,
        allow_unguarded: bool = False,
        allow: tuple[str, ...] = (),
        prices: Any = None,
        vendor: str | None = None,
        image_tokens: int | None = None,
        store_for_lookup: bool = True,
    ) -> None:
        self.inner = inner or httpx2.HTTPTransport()
        self.options = guard.Options(
            allow_unguarded, tuple(allow), prices, vendor, image_tokens, store_for_lookup
        )

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        route = guard.decide(request, self.options)
        if route.kind is not Kind.METERED:
            return self._pass(request)
        request.read()
        begun = begin(route, request, self.options)
        if begun is None:
            return self._pass(request)  # allowed outside a run
        try:
            answer, live = begun.replay(), False
            if answer is None:
                answer, live = self._send(begun)
        except BaseException as exc:
            return begun.failed(exc)
        if not live:  # a live stream's call ends when the SDK has read it
            begun.done()
        return answer

    def close(self) -> None:
        self.inner.close()

    def _pass(self, request: httpx2.Request) -> httpx2.Response:
        with bypass.guarded():
            return self.inner.handle_request(request)

    def _send(self, begun: Begun) -> tuple[httpx2.Response, bool]:
        """The answer, and whether it is a live stream."""
        request = begun.addressed()
        response = self._pass(request)
        begun.headers_arrived(response)
        if begun.m.streamed and response.status_code < 400:
            state = StreamState(begun, response, request)
            return state.response(_LiveStream(state)), True
        full = response.read()  # decoded: real APIs compress
        response.close()
        return begun.answered(response, full, request), False


class _LiveStream(httpx2.SyncByteStream):
    """A streamed answer passed to the SDK as it arrives, decoded; settled at its end."""

    def __init__(self, state: StreamState) -> None:
        self.state = state

    def __iter__(self) -> Iterator[bytes]:
        state = self.state
        if not state.first_read():
            return
        try:
            for chunk in state.inner.iter_bytes():
                yield from state.feed(chunk)
            yield from state.tail()
        except GeneratorExit:
            # the SDK stops reading (after [DONE], or the caller broke off): settled if
            # the usage had arrived, else unknown
            state.finish(None)
            raise
        except BaseException as exc:
            state.finish(exc)
            raise
        state.finish(None)

    def close(self) -> None:
        try:
            self.state.inner.close()
        finally:
            self.state.finish(None)
