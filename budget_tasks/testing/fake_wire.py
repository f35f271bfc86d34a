"""How the fake provider puts bytes on the wire as the real APIs do: compressed with
the encoding the client asks for (gzip and deflate always; br and zstd where their
packages are installed, as httpx2 asks for them then), flushed event by event when
streaming."""

from __future__ import annotations

import importlib
import zlib
from typing import Any, Protocol


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - both are dev dependencies
        return None


# the encodings httpx2 advertises only when it can decode them
_brotli = _optional("brotli")
_zstd = _optional("backports.zstd")


class Encoder(Protocol):
    """One response body's compressor: ``chunk`` for each piece (flushed, so a stream's
    event reaches the client whole), ``end`` once."""

    name: str

    def chunk(self, data: bytes) -> bytes: ...
    def end(self) -> bytes: ...


class _Identity:
    name = "identity"

    def chunk(self, data: bytes) -> bytes:
        return data

    def end(self) -> bytes:
        return b""


class _Zlib:
    def __init__(self, name: str, wbits: int) -> None:
        self.name = name
        self._c = zlib.compressobj(6, zlib.DEFLATED, wbits)

    def chunk(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(zlib.Z_SYNC_FLUSH)

    def end(self) -> bytes:
        return self._c.flush(zlib.Z_FINISH)


class _Brotli:
    name = "br"

    def __init__(self) -> None:
        assert _brotli is not None
        # quality 4, as front ends compress dynamic answers (11, the default, is for
        # static files and costs the fake more than the rest of an answer)
        self._c: Any = _brotli.Compressor(quality=4)

    def chunk(self, data: bytes) -> bytes:
        return bytes(self._c.process(data)) + bytes(self._c.flush())

    def end(self) -> bytes:
        return bytes(self._c.finish())


class _Zstd:
    name = "zstd"

    def __init__(self) -> None:
        assert _zstd is not None
        self._c: Any = _zstd.ZstdCompressor()

    def chunk(self, data: bytes) -> bytes:
        assert _zstd is not None
        return bytes(self._c.compress(data)) + bytes(
            self._c.flush(_zstd.ZstdCompressor.FLUSH_BLOCK)
        )

    def end(self) -> bytes:
        assert _zstd is not None
        return bytes(self._c.flush(_zstd.ZstdCompressor.FLUSH_FRAME))


def available() -> tuple[str, ...]:
    """The encodings this fake can answer in, in the order it prefers them."""
    names = ["br"] if _brotli is not None else []
    names += ["gzip"]
    names += ["zstd"] if _zstd is not None else []
    return (*names, "deflate")


def choose(accept_encoding: str | None, allowed: tuple[str, ...] | str) -> str:
    """The encoding to answer in: the first of ``allowed`` (an order, or "auto" for
    :func:`available`) that the client's ``Accept-Encoding`` names, else identity."""
    order = available() if allowed == "auto" else tuple(allowed)
    offered = set()
    for item in (accept_encoding or "").split(","):
        name, *params = (part.strip() for part in item.split(";"))
        weights = [p[2:] for p in params if p.lower().startswith("q=")]
        try:
            wanted = float(weights[0]) > 0 if weights else True
        except ValueError:
            wanted = False
        if name and wanted:
            offered.add(name.lower())
    for name in order:
        if name in offered and name in available():
            return name
    return "identity"


def encoder(name: str) -> Encoder:
    if name == "gzip":
        return _Zlib("gzip", 16 + zlib.MAX_WBITS)
    if name == "deflate":
        return _Zlib("deflate", zlib.MAX_WBITS)
    if name == "br":
        return _Brotli()
    if name == "zstd":
        return _Zstd()
    return _Identity()


def encode_whole(name: str, body: bytes) -> bytes:
    """A whole body in encoding ``name``."""
    enc = encoder(name)
    return enc.chunk(body) + enc.end()
