"""The run a metered request belongs to, and its call's life in that run: found from
the calling context (its thread, its asyncio tasks, a context copied from it) or, from a
thread of its own that ``run`` started, the one run in progress in this process; its
position claimed; its step entered, and left when the answer has been read."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import httpx2

from ..delivery.scope import AttemptScope, Call, current_scope, running_scopes
from ..errors import ParallelCallsUnlabelled, UnguardedCall
from . import guard
from .positions import Positions, label_path, labels_open

_positions: weakref.WeakKeyDictionary[AttemptScope, Positions] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class ManyRuns(UnguardedCall):
    """A billable request from a thread with no run of its own while several runs are in
    progress in this process (a ``--pool threads`` worker): it belongs to none of them
    for sure. Refused before sending."""

    template = (
        "{method} {path} comes from a thread with no BudgetTask run of its own while "
        "several runs are in progress here: nothing was sent. Start the thread with the "
        "run's context (contextvars.copy_context().run) so the call is the run's"
    )


class LabelsLost(ParallelCallsUnlabelled):
    """A billable request from a thread started without the run's context while the run
    is inside a ``call_label`` block: the thread does not see those labels, so its
    call's position would drop them. Refused before sending."""

    template = (
        "a call at {path!r} comes from a thread started without the run's context while "
        "the run is inside call_label blocks: their labels do not reach that thread, so "
        "its position would drop them (and two phases sharing a pool would meet at one "
        "position). Nothing was sent. Start the work with the run's context: "
        "pool.submit(contextvars.copy_context().run, fn, *args)"
    )


def scope_for(request: httpx2.Request) -> AttemptScope | None:
    """The run this request is made in, or None when no run is in progress."""
    scope = current_scope()
    if scope is not None:
        return scope
    runs = running_scopes()
    if len(runs) > 1:
        raise guard.marked(ManyRuns(request.method, request.url.path))
    if runs and labels_open(runs[0]):
        raise guard.marked(LabelsLost(label_path() or "(no label)"))
    return runs[0] if runs else None


class ScopedCall:
    """One metered call in its run: its position claimed, its step entered."""

    def __init__(self, scope: AttemptScope) -> None:
        self.scope = scope
        self._step: AbstractContextManager[Call] | None = None
        self._release: Callable[[], None] | None = None

    @property
    def operation(self) -> str:
        return self.scope.operation_key

    def begin(self, m: guard.Metered) -> Call:
        """Claim the call's position and reserve it (or find it answered before)."""
        with _lock:
            positions = _positions.get(self.scope)
            if positions is None:
                positions = _positions[self.scope] = Positions()
        self._release = positions.claim(label_path())
        manager = self.scope.manager
        assert manager is not None
        self._step = manager.step(
            self.scope, m.estimate.amount, m.label, m.facts, m.estimate.price_version
        )
        call = self._step.__enter__()
        # whom it is sent to and with which key, known before it is sent: written with
        # its end, an answer or an unknown outcome (the drift check reads them)
        call.provider, call.credential = m.provider, m.credential
        return call

    def provider_key(self, call: Call) -> str:
        """What the provider is sent as the call's key; reading it grants the send."""
        return call.provider_key

    def exit(self, exc: BaseException | None) -> None:
        """The call has ended (``exc``: how, None when answered and read)."""
        try:
            if self._step is not None:
                step, self._step = self._step, None
                if exc is None:
                    step.__exit__(None, None, None)
                else:
                    step.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give the position back (nothing was entered, or the step has been left)."""
        if self._release is not None:
            release, self._release = self._release, None
            release()


def find(request: httpx2.Request, options: guard.Options) -> ScopedCall | None:
    """The call's run, or None when none runs and the client allows unguarded calls;
    raises UnguardedCall (marked) otherwise."""
    scope = scope_for(request)
    if scope is None:
        if options.allow_unguarded:
            return None
        raise guard.unguarded(request)
    return ScopedCall(scope)
