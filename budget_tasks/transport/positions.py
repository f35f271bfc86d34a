"""Where a metered call sits in its operation: its position, ``<key>:<label/>endpoint:n``,
the n-th call of that label path and endpoint. A redelivery meets each call at the same
position and gets its stored answer back, so positions must not depend on scheduling.

Calls made one after another in ``run`` have stable positions. Calls made in parallel
(threads, ``asyncio.gather``) do not, unless each branch counts its calls apart under a
label of its own (:func:`call_label`). So a label path belongs to the first thread that
calls at it in a run, and a call at it from another thread that is still alive is
refused; within one thread's event loop, a call at a path where another asyncio task
has a call out is refused (sequential tasks, ``asyncio.wait_for`` included, are fine).
Both are refused before anything is reserved or sent (:class:`ParallelCallsUnlabelled`),
with how to label the branches.

Labels live in the run's context. A thread started without it (a plain
``ThreadPoolExecutor``) still finds the run, but not the labels open around it: while a
``call_label`` block is open in the run, a call from such a thread is refused
(:class:`~budget_tasks.transport.LabelsLost`), since its position would silently drop
the outer labels and two phases of work reusing one pool would meet at one path. Submit
the work with the run's context (``pool.submit(contextvars.copy_context().run, fn)``).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..delivery.scope import AttemptScope, current_scope
from ..errors import ParallelCallsUnlabelled

_labels: ContextVar[tuple[str, ...]] = ContextVar("budget_tasks_call_labels", default=())
#: how many call_label blocks are open in each run's context
_open: weakref.WeakKeyDictionary[AttemptScope, int] = weakref.WeakKeyDictionary()
_open_lock = threading.Lock()


@contextmanager
def call_label(name: str) -> Iterator[None]:
    """Count the calls made inside this block apart, under ``name``: their positions
    are ``<key>:<outer/.../name>/<endpoint>:n``. Give each branch of parallel or
    reorderable work a label of its own, so a redelivery meets each call at its own
    position whatever order the branches run in."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError("a call label is a non-empty string without '/'")
    scope = current_scope()
    token = _labels.set((*_labels.get(), name))
    if scope is not None:
        with _open_lock:
            _open[scope] = _open.get(scope, 0) + 1
    try:
        yield
    finally:
        _labels.reset(token)
        if scope is not None:
            with _open_lock:
                _open[scope] -= 1


def labels_open(scope: AttemptScope) -> bool:
    """Whether code in ``scope``'s run context is inside a :func:`call_label` block: a
    thread started without that context would not see its labels."""
    with _open_lock:
        return _open.get(scope, 0) > 0


def label_path() -> str:
    return "/".join(_labels.get())


def position_label(endpoint: str) -> str:
    """The label a call to ``endpoint`` is counted under here."""
    path = label_path()
    return f"{path}/{endpoint}" if path else endpoint


class Positions:
    """Who calls at which label path in one run (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._out: dict[str, dict[asyncio.Task[object], int]] = {}

    def claim(self, path: str) -> Callable[[], None]:
        """Take ``path`` for this call; the returned function gives it back when the call
        has ended. Raises ParallelCallsUnlabelled (nothing taken) when another thread
        owns the path, or another task has a call out at it."""
        thread = threading.current_thread()
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        with self._lock:
            owner = self._threads.get(path)
            if owner is not None and owner is not thread and owner.is_alive():
                raise ParallelCallsUnlabelled(path or "(no label)")
            out = self._out.setdefault(path, {})
            if task is not None and any(t is not task and n > 0 for t, n in out.items()):
                raise ParallelCallsUnlabelled(path or "(no label)")
            self._threads[path] = thread
            if task is not None:
                out[task] = out.get(task, 0) + 1

        def release() -> None:
            if task is None:
                return
            with self._lock:
                left = self._out.get(path, {})
                left[task] = left.get(task, 1) - 1
                if left[task] <= 0:
                    del left[task]

        return release
