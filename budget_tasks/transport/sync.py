"""The guarded ``httpx2`` transport, for the SDKs' sync clients (see
:mod:`budget_tasks.transport.guard` for the steps it takes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2

from .. import bypass
from ..delivery import Call
from ..errors import BudgetTasksError, StreamIncomplete
from ..providers.base import Kind
from . import guard
from .scopes import ScopedCall, find


class _StatusOutcome(Exception):
    """An error status from the provider, raised inside the call's block so its hold
    follows the status (429 and refusals released, 5xx kept unknown), then the
    response goes back to the SDK, which raises its own error."""

    def __init__(self, response: httpx2.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.status_code = response.status_code


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
    ) -> None:
        self.inner = inner or httpx2.HTTPTransport()
        self.options = guard.Options(allow_unguarded, tuple(allow), prices, vendor, image_tokens)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        route = guard.decide(request, self.options)
        if route.kind is not Kind.METERED:
            return self._pass(request)
        guard.check_not_a_retry(request)
        scoped = find(request, self.options)
        if scoped is None:
            return self._pass(request)  # allowed outside a run
        try:
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
                answer: httpx2.Response | _LiveStream = guard.replayed(
                    scoped.operation, call, m.digest, m.request, m.streamed
                )
            else:
                answer = self._send(scoped, call, m)
        except BaseException as exc:
            scoped.exit(exc)
            if isinstance(exc, _StatusOutcome):
                return exc.response
            if isinstance(exc, BudgetTasksError):
                raise guard.marked(exc) from None
            raise
        if isinstance(answer, _LiveStream):
            return answer.start()
        scoped.exit(None)
        return answer

    def close(self) -> None:
        self.inner.close()

    def _pass(self, request: httpx2.Request) -> httpx2.Response:
        with bypass.guarded():
            return self.inner.handle_request(request)

    def _send(
        self, scoped: ScopedCall, call: Call, m: guard.Metered
    ) -> httpx2.Response | _LiveStream:
        request = guard.addressed(m, scoped.provider_key(call))
        response = self._pass(request)
        request_id = guard.request_id_of(response)
        if request_id:
            call.record_request_id(request_id)
        if m.streamed and response.status_code < 400:
            return _LiveStream(scoped, call, m, response, request)
        full = response.read()  # decoded: real APIs compress
        response.close()
        content = guard.without_usage_chunk(full) if m.hidden_usage else full
        stored = guard.stored_answer(m, response, content)
        answer = guard.rebuilt(response, content, request)
        if response.status_code >= 400:
            raise _StatusOutcome(answer)
        call.record(guard.sent_of(m, request_id, full, stored))
        return answer


class _LiveStream(httpx2.SyncByteStream):
    """A streamed answer passed to the SDK as it arrives, decoded. The call is settled
    when the stream ends (its usage from its events); cut or closed before its usage
    arrived, the call's outcome is unknown and its hold kept."""

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

    def __iter__(self) -> Iterator[bytes]:
        if self.started:
            # read again (an HTTP client draining what the SDK left unread): the events
            # have been passed on once; what arrived settles the call
            self._finish(None)
            return
        self.started = True
        pending = b""
        try:
            for chunk in self.inner.iter_bytes():
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
            # the SDK stops reading (after [DONE], or the caller broke off): settled if
            # the usage had arrived, else unknown
            self._finish(None)
            raise
        except BaseException as exc:
            self._finish(exc)
            raise
        self._finish(None)

    def close(self) -> None:
        try:
            self.inner.close()
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
