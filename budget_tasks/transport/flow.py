"""One metered call's flow, shared by the sync and the async transports (they differ
only in how they send and read): begin it in its run, hand back a stored answer or
settle the one that came, keep a live stream's state, and end it whatever happened."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx2

from ..delivery.scope import Call
from ..errors import BudgetTasksError, LedgerUnavailable, StreamIncomplete
from ..hooks import hooks
from ..providers.rate_headers import seen_of
from ..providers.registry import Route
from . import guard
from .scopes import ScopedCall, find


class StatusOutcome(Exception):
    """An error status from the provider, raised inside the call's block so its hold
    follows the status (429 and refusals released, 5xx kept unknown), then the
    response goes back to the SDK, which raises its own error."""

    def __init__(self, response: httpx2.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response
        self.status_code = response.status_code


@dataclass
class Begun:
    """A metered call in its run: reserved (or found answered before), not yet sent."""

    scoped: ScopedCall
    call: Call
    m: guard.Metered

    def replay(self) -> httpx2.Response | None:
        """The stored answer at this position, if the call was answered before."""
        if not self.call.replayed:
            return None
        return guard.replayed(
            self.scoped.operation, self.call, self.m.digest, self.m.request, self.m.streamed
        )

    def addressed(self) -> httpx2.Request:
        """The request to send, under the attempt's provider key (reading it grants the
        send)."""
        return guard.addressed(self.m, self.scoped.provider_key(self.call))

    def headers_arrived(self, response: httpx2.Response) -> None:
        request_id = guard.request_id_of(response)
        if request_id:
            self.call.record_request_id(request_id)
        vendor = self.m.route.vendor
        if vendor is not None:
            # what the provider says remains of its limits narrows the call's windows
            # with its settlement (or release), in the same commit
            now = self._now()
            state = vendor.rate_state(response.headers, now)
            refused = response.status_code == 429
            self.call.rate_seen = seen_of(state, now, refused)
            if refused:
                wait = state.retry_after
                short = [k for k, w in state.windows.items() if w.remaining == 0]
                hooks.rate_limited(
                    provider=self.m.provider,
                    scope=self.m.estimate.model or "*",
                    kind=short[0] if short else "requests",
                    wait=0.0 if wait is None else wait.total_seconds(),
                    by="provider",
                )

    def _now(self) -> datetime:
        """The ledger's time, as its rate windows refill; this host's where the ledger
        cannot say (its clock not yet measured and the database away): an answer
        already in hand is never lost to reading a clock."""
        try:
            return self.scoped.scope.ledger.now()
        except LedgerUnavailable:
            return datetime.now(UTC)

    def answered(
        self, response: httpx2.Response, full: bytes, request: httpx2.Request
    ) -> httpx2.Response:
        """A whole answer, read and decoded: stored, priced and recorded; the decoded
        response handed to the SDK (an error status raises StatusOutcome)."""
        content = guard.without_usage_chunk(full) if self.m.hidden_usage else full
        stored = guard.stored_answer(self.m, response, content)
        answer = guard.rebuilt(response, content, request)
        if response.status_code >= 400:
            raise StatusOutcome(answer)
        self.call.record(guard.sent_of(self.m, self.call.request_id, full, stored))
        return answer

    def done(self) -> None:
        """The call ended well: its step is left (settled or kept for its usage)."""
        self.scoped.exit(None)

    def failed(self, exc: BaseException) -> httpx2.Response:
        """The call ended with ``exc``: its hold follows what ``exc`` means; an error
        status's response goes back to the SDK, anything else is raised (ours marked)."""
        self.scoped.exit(exc)
        if isinstance(exc, StatusOutcome):
            return exc.response
        if isinstance(exc, BudgetTasksError):
            raise guard.marked(exc) from None
        raise exc


def begin(route: Route, request: httpx2.Request, options: guard.Options) -> Begun | None:
    """Refuse the SDK's own retry, find the run, bound the request and reserve it.
    None: no run, and the client allows calls outside one. The request's body must
    have been read."""
    guard.check_not_a_retry(request)
    guard.check_key(request, options.vendor)
    scoped = find(request, options)
    if scoped is None:
        return None
    try:
        m = guard.prepare(route, request, options)
        call = scoped.begin(m)
    except BudgetTasksError as exc:
        scoped.abandon()
        raise guard.marked(exc) from None
    except BaseException:
        scoped.abandon()
        raise
    return Begun(scoped, call, m)


@dataclass
class StreamState:
    """A live stream's bytes: what came (decoded) and what the SDK was shown (without
    a usage chunk it did not ask for). The call settles when the stream ends, from its
    events; cut, or left before its usage arrived, its outcome is unknown."""

    begun: Begun
    inner: httpx2.Response
    request: httpx2.Request
    full: list[bytes] = field(default_factory=list)
    shown: list[bytes] = field(default_factory=list)
    pending: bytes = b""
    started: bool = False
    finished: bool = False

    def response(self, stream: httpx2.SyncByteStream | httpx2.AsyncByteStream) -> httpx2.Response:
        return httpx2.Response(
            self.inner.status_code,
            headers=guard.decoded_headers(self.inner.headers),
            stream=stream,
            request=self.request,
            extensions={k: v for k, v in self.inner.extensions.items() if k != "network_stream"},
        )

    def first_read(self) -> bool:
        """Whether this is the stream's first reading. Read again (an HTTP client
        draining what the SDK left unread), the events have been passed on once: what
        arrived settles the call."""
        if self.started:
            self.finish(None)
            return False
        self.started = True
        return True

    def feed(self, chunk: bytes) -> list[bytes]:
        """What of ``chunk`` to hand on."""
        self.full.append(chunk)
        if not self.begun.m.hidden_usage:
            self.shown.append(chunk)
            return [chunk]
        self.pending += chunk
        *events, self.pending = self.pending.split(b"\n\n")
        out = []
        for event in events:
            kept = guard.without_usage_chunk(event)
            if kept.strip():
                out.append(kept + b"\n\n")
        self.shown.extend(out)
        return out

    def tail(self) -> list[bytes]:
        rest, self.pending = self.pending, b""
        if rest:
            self.shown.append(rest)
            return [rest]
        return []

    def finish(self, exc: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        begun = self.begun
        if exc is None:
            try:
                stored = guard.stored_answer(begun.m, self.inner, b"".join(self.shown))
                events = guard.sse_events(b"".join(self.full))
                sent = guard.sent_of_stream(begun.m, begun.call.request_id, events, stored)
            except Exception as unreadable:  # an answer its usage cannot be read from
                exc = unreadable
            else:
                if sent is not None:
                    begun.call.record(sent)
                    begun.scoped.exit(None)
                    return
                exc = StreamIncomplete(begun.m.provider, "closed before its usage arrived")
        begun.scoped.exit(exc)
