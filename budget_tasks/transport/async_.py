"""The guarded ``httpx2`` transport for the SDKs' async clients: the same steps as the
sync one (:mod:`budget_tasks.transport.guard`), awaiting the network. The ledger's own
writes are short and synchronous: they hold the event loop for their round trip."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2

from .. import bypass
from ..delivery import Call
from ..errors import BudgetTasksError, StreamIncomplete
from ..providers.base import Kind
from . import guard
from .scopes import ScopedCall, find
from .sync import _StatusOutcome


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
    ) -> None:
        self.inner = inner or httpx2.AsyncHTTPTransport()
        self.options = guard.Options(allow_unguarded, tuple(allow), prices, vendor, image_tokens)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        route = guard.decide(request, self.options)
        if route.kind is not Kind.METERED:
            return await self._pass(request)
        guard.check_not_a_retry(request)
        scoped = find(request, self.options)
        if scoped is None:
            return await self._pass(request)
        try:
            await request.aread()
            m = guard.prepare(route, request, self.options)
            call = scoped.begin(m)
        except BudgetTasksError as exc:
            scoped.abandon()
            raise guard.marked(exc) from None
        except BaseException:
            scoped.abandon()
            raise
        try:
            if call.replayed:
                answer: httpx2.Response | _AsyncLiveStream = guard.replayed(
                    scoped.operation, call, m.digest, m.request, m.streamed
                )
            else:
                answer = await self._send(scoped, call, m)
        except BaseException as exc:
            scoped.exit(exc)
            if isinstance(exc, _StatusOutcome):
                return exc.response
            if isinstance(exc, BudgetTasksError):
                raise guard.marked(exc) from None
            raise
        if isinstance(answer, _AsyncLiveStream):
            return answer.start()
        scoped.exit(None)
        return answer

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def _pass(self, request: httpx2.Request) -> httpx2.Response:
        with bypass.guarded():
            return await self.inner.handle_async_request(request)

    async def _send(
        self, scoped: ScopedCall, call: Call, m: guard.Metered
    ) -> httpx2.Response | _AsyncLiveStream:
        request = guard.addressed(m, scoped.provider_key(call))
        response = await self._pass(request)
        request_id = guard.request_id_of(response)
        if request_id:
            call.record_request_id(request_id)
        if m.streamed and response.status_code < 400:
            return _AsyncLiveStream(scoped, call, m, response, request)
        full = await response.aread()
        await response.aclose()
        content = guard.without_usage_chunk(full) if m.hidden_usage else full
        stored = guard.stored_answer(m, response, content)
        answer = guard.rebuilt(response, content, request)
        if response.status_code >= 400:
            raise _StatusOutcome(answer)
        call.record(guard.sent_of(m, request_id, full, stored))
        return answer


class _AsyncLiveStream(httpx2.AsyncByteStream):
    """A streamed answer passed on as it arrives, settled at its end (see the sync one)."""

    def __init__(
        self,
        scoped: ScopedCall,
        call: Call,
        m: guard.Metered,
        response: httpx2.Response,
        request: httpx2.Request,
    ) -> None:
        self.scoped, self.call, self.m, self.inner, self.request = (
            scoped,
            call,
            m,
            response,
            request,
        )
        self.full: list[bytes] = []
        self.shown: list[bytes] = []
        self.started = False
        self.finished = False

    def start(self) -> httpx2.Response:
        return httpx2.Response(
            self.inner.status_code,
            headers=guard.decoded_headers(self.inner.headers),
            stream=self,
            request=self.request,
            extensions={k: v for k, v in self.inner.extensions.items() if k != "network_stream"},
        )

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.started:
            # read again (an HTTP client draining what the SDK left unread): the events
            # have been passed on once; what arrived settles the call
            self._finish(None)
            return
        self.started = True
        pending = b""
        try:
            async for chunk in self.inner.aiter_bytes():
                self.full.append(chunk)
                if not self.m.hidden_usage:
                    self.shown.append(chunk)
                    yield chunk
                    continue
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    kept = guard.without_usage_chunk(event)
                    if kept.strip():
                        self.shown.append(kept + b"\n\n")
                        yield kept + b"\n\n"
            if pending:
                self.shown.append(pending)
                yield pending
        except GeneratorExit:
            self._finish(None)
            raise
        except BaseException as exc:
            self._finish(exc)
            raise
        self._finish(None)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        if exc is None:
            stored = guard.stored_answer(self.m, self.inner, b"".join(self.shown))
            sent = guard.sent_of_stream(
                self.m, self.call.request_id, guard.sse_events(b"".join(self.full)), stored
            )
            if sent is not None:
                self.call.record(sent)
                self.scoped.exit(None)
                return
            exc = StreamIncomplete(self.m.provider, "closed before its usage arrived")
        self.scoped.exit(exc)
