"""Calls that bypass the guard: a connection to a known provider endpoint opened inside a
BudgetTask's ``run`` by anything but the guarded transport (a plain
SDK client, an async one, ``requests``, a framework built without the guarded client)
is refused when it opens, through Python's audit hook on sockets, before any byte is
sent: :class:`UnmeteredConnection`.

Known provider endpoints are the registered vendors' API hosts, the base URL each
vendor's SDK reads from the environment (``OPENAI_BASE_URL``...), and every base URL
a guarded client was built for; the vendors tell this module (see
:mod:`budget_tasks.providers.registry`), which names none itself.

What it cannot see, and so does not refuse: a connection opened before ``run`` and
reused inside it (a pooled keep-alive connection); a name resolved in a thread the run
did not start, while a guarded call of this process resolves one at the same moment
(asyncio resolves names in an executor thread); traffic from another process; a
provider reached through an address no one told it, or through an HTTP proxy
(``HTTPS_PROXY``: the socket opens to the proxy, not the provider). ``unmetered()`` lets a block
through on purpose (an unbilled lookup with a plain client, say).
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from .errors import UnmeteredConnection, mark_raised_by_transport

__all__ = [
    "unmetered",
]

#: The environment switch: ``off`` installs no hook (nothing is refused).
SWITCH_ENV = "BUDGET_TASKS_REFUSE_UNMETERED"

_guarded: ContextVar[bool] = ContextVar("budget_tasks_guarded_send", default=False)
_lock = threading.Lock()
_hosts: set[str] = set()
_endpoints: set[tuple[str, int]] = set()
#: the environment variables that name a provider's base URL, read again at install
_base_url_envs: set[str] = set()
#: guarded sends out now, in this process (names resolved in an executor thread are
#: let through while any is: that thread cannot tell whose they are)
_sending = 0
_installed = False


#: whether the calling context belongs to a run: "mine" (it runs one), "maybe" (a
#: thread with no task of its own while a run is in progress: one the run started), or
#: None (set by install())
def _nobody() -> str | None:
    return None


_whose: Callable[[], str | None] = _nobody


def know(url: str | None) -> None:
    """Remember the host (and port) of a provider base URL."""
    if not url:
        return
    parts = urlsplit(url if "//" in url else f"https://{url}")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        return
    port = parts.port or (443 if parts.scheme != "http" else 80)
    with _lock:
        _hosts.add(host)
        _endpoints.add((host, port))
        if host == "localhost":
            _endpoints.update({("127.0.0.1", port), ("::1", port)})


def forget(url: str) -> None:
    """Forget a provider base URL (a fake provider that has stopped: its port may be
    anything's next)."""
    parts = urlsplit(url if "//" in url else f"https://{url}")
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme != "http" else 80)
    with _lock:
        _endpoints.difference_update({(host, port), ("127.0.0.1", port), ("::1", port)})


def know_env(name: str) -> None:
    """Remember that environment variable ``name`` may name a provider base URL (read
    now, and again when the hook is installed)."""
    if not name:
        return
    with _lock:
        _base_url_envs.add(name)
    know(os.environ.get(name))


def _known_at_start() -> None:
    with _lock:
        names = sorted(_base_url_envs)
    for name in names:
        know(os.environ.get(name))


@contextmanager
def guarded() -> Iterator[None]:
    """Mark the connections opened in this block as the guard's own."""
    global _sending
    token = _guarded.set(True)
    with _lock:
        _sending += 1
    try:
        yield
    finally:
        _guarded.reset(token)
        with _lock:
            _sending -= 1


@contextmanager
def unmetered() -> Iterator[None]:
    """Let this block's connections to a provider through unmetered, on purpose (an
    unbilled lookup with a plain client): you answer for what they bill."""
    token = _guarded.set(True)
    try:
        yield
    finally:
        _guarded.reset(token)


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2 and isinstance(value[1], int):
        host = value[0]
        if isinstance(host, str):
            try:
                return str(ipaddress.ip_address(host.split("%")[0])), value[1]
            except ValueError:
                return host.lower(), value[1]
    return None


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        if _guarded.get() or len(args) < 2:
            return
        address = _address(args[1])
        if address is None or address not in _endpoints or _whose() is None:
            return
        raise mark_raised_by_transport(UnmeteredConnection(*address))
    if event == "socket.getaddrinfo":
        if _guarded.get() or not args or not isinstance(args[0], str | bytes):
            return
        host = (args[0].decode() if isinstance(args[0], bytes) else args[0]).lower().rstrip(".")
        port = _port(args[1] if len(args) > 1 else None)
        if host not in _hosts or (port is not None and (host, port) not in _endpoints):
            return
        whose = _whose()
        # a name resolved in a thread of no task (asyncio resolves in an executor) is
        # let through while a guarded send of this process may be the one resolving it
        if whose == "mine" or (whose == "maybe" and _sending == 0):
            raise mark_raised_by_transport(UnmeteredConnection(host, port or 443))


def _port(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str | bytes) and value.isdigit():
        return int(value)
    return None


def install(whose: Callable[[], str | None]) -> bool:
    """Install the audit hook once per process (Python's audit hooks cannot be removed);
    ``whose`` says whether the calling context belongs to a run (see ``_whose``). False
    when switched off (``BUDGET_TASKS_REFUSE_UNMETERED=off``)."""
    global _installed, _whose
    if os.environ.get(SWITCH_ENV, "").lower() in ("off", "0", "false", "no"):
        return False
    with _lock:
        if _installed:
            return True
        _whose = whose
        _installed = True
    _known_at_start()
    sys.addaudithook(_hook)
    return True
