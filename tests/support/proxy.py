"""A TCP proxy that tests can cut and restore, to put a fault between a client and a
real server (PostgreSQL, Redis, a provider) without touching the server itself."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultProxy:
    """Forward ``listen_host``:<port> (default 127.0.0.1, any free port) to ``target``.

    ``cut()`` resets every connection and refuses new ones; ``blackhole()`` keeps the
    connections and accepts new ones but forwards nothing either way, as a network
    whose packets vanish (no reset: the client waits for its own timeouts); ``slow()``
    delays every chunk; ``restore()`` heals all of it (connections a black hole
    swallowed bytes of are reset then: their streams lost data)."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server((listen_host, 0))
        self.host = listen_host
        self.port: int = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._holed = False
        self._delay = 0.0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._swallowed: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._up.clear()
        self._holed = False
        self._reset_all()

    def blackhole(self) -> None:
        self._holed = True

    def slow(self, seconds: float) -> None:
        self._delay = seconds

    def restore(self) -> None:
        if self._holed:
            self._holed = False
            with self._lock:
                swallowed, self._swallowed = self._swallowed, set()
            for s in swallowed:
                _reset(s)
        self._delay = 0.0
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _reset_all(self) -> None:
        with self._lock:
            for s in self._sockets | self._swallowed:
                _reset(s)
            self._sockets.clear()
            self._swallowed.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            if self._holed:
                with self._lock:
                    self._swallowed.add(client)  # accepted, then never answered
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                if self._holed:
                    with self._lock:
                        self._swallowed.update((src, dst))
                    continue  # the bytes vanish
                if self._delay:
                    time.sleep(self._delay)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
        s.close()
