"""Official SDK clients with automatic retries off, and the check that refuses others."""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .. import bypass
from ..errors import RetriesEnabled, UnusableApiKey

if TYPE_CHECKING:
    from .base import Vendor

#: How long after a call's own timeout a provider may still be working on it.
DEFAULT_MARGIN = timedelta(minutes=5)


def check_api_key(vendor: Vendor, kwargs: dict[str, Any]) -> None:
    """Refuse (UnusableApiKey) a key, given or in the environment, that no HTTP header
    may carry, before any call could hold money for it."""
    candidates = [(f"{name}=", kwargs.get(name)) for name in vendor.credential_arguments]
    env = vendor.key_env
    if env:
        candidates.append((env, os.environ.get(env) if kwargs.get("api_key") is None else None))
    for source, value in candidates:
        if not isinstance(value, str):
            continue
        for position, char in enumerate(value):
            if not "!" <= char <= "~":
                what = {"\n": "a line break", "\r": "a carriage return", " ": "a space"}.get(
                    char, "a control character" if char < " " else "a character outside ASCII"
                )
                raise UnusableApiKey(vendor.name, source, what, position)


def sdk_client(vendor: Vendor, **kwargs: Any) -> Any:
    """``vendor``'s official SDK client (its sync class) with ``max_retries=0``."""
    name = vendor.sdk_clients[0]
    if not vendor.sdk or not name:
        raise ValueError(f"{vendor.name} names no SDK client")
    _refuse_retries(f"{vendor.sdk}.{name}(...)", kwargs)
    check_api_key(vendor, kwargs)
    bypass.know(str(kwargs["base_url"]) if kwargs.get("base_url") else None)
    client_class = getattr(importlib.import_module(vendor.sdk), name)
    return client_class(**{**kwargs, "max_retries": 0})


def openai_client(**kwargs: Any) -> Any:
    """An ``openai.OpenAI`` client with ``max_retries=0`` (needs the ``[openai]`` extra)."""
    from .registry import registry

    return sdk_client(registry.vendor("openai"), **kwargs)


def anthropic_client(**kwargs: Any) -> Any:
    """An ``anthropic.Anthropic`` client with ``max_retries=0`` (``[anthropic]`` extra)."""
    from .registry import registry

    return sdk_client(registry.vendor("anthropic"), **kwargs)


def _refuse_retries(name: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("max_retries", 0) != 0:
        raise RetriesEnabled(name, kwargs["max_retries"])


def require_no_retries(client: Any) -> Any:
    """Return ``client`` if its SDK retries are off; raise RetriesEnabled otherwise."""
    retries = getattr(client, "max_retries", None)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries != 0:
        raise RetriesEnabled(type(client).__name__, retries)
    return client


def client_timeout(client: Any) -> float | None:
    """The longest a call made with ``client`` can take before it gives up, in seconds
    (an ``httpx.Timeout``'s parts added up), or None if it has no finite timeout."""
    timeout = getattr(client, "timeout", None)
    if isinstance(timeout, bool):
        return None
    if isinstance(timeout, int | float):
        return float(timeout)
    parts = [getattr(timeout, name, None) for name in ("read", "write", "connect", "pool")]
    known = [float(p) for p in parts if isinstance(p, int | float) and not isinstance(p, bool)]
    return sum(known) if known else None


def settle_after(client: Any, margin: timedelta = DEFAULT_MARGIN) -> timedelta:
    """The longest a provider may still be working on a call made with ``client``:
    its timeout plus ``margin``. Before that, "not found" only means "not yet"."""
    seconds = client_timeout(client)
    if seconds is None:
        raise ValueError(f"{type(client).__name__} has no finite timeout to bound a call by")
    return timedelta(seconds=seconds) + margin
