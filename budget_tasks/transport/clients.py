"""Guarded clients: an ``httpx2`` client over the guarded transport, and the official
SDKs' clients built on it with their retries locked off."""

from __future__ import annotations

import importlib
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx2

from .. import bypass
from ..errors import RetriesEnabled
from ..providers.base import check_api_key
from ..providers.base import refuse_retries as _refuse_retries
from ..providers.registry import registry
from .async_ import AsyncGuardedTransport
from .guard import MISSING_API_KEY
from .sync import GuardedTransport


@dataclass(frozen=True)
class _Built:
    vendor: str
    base_url_given: bool
    key_given: bool


#: the guarded SDK clients this process built, for the test fixtures to re-point
_built: weakref.WeakKeyDictionary[Any, _Built] = weakref.WeakKeyDictionary()
_built_lock = threading.Lock()


def repoint(base_urls: dict[str, str], keys: dict[str, str]) -> Callable[[], None]:
    """Point every guarded SDK client built so far (a task module's, built at import)
    at ``base_urls[vendor]`` with ``keys[vendor]``, where it was not given a base URL
    or a key of its own; returns what puts them back (``fake_llm`` uses it)."""
    with _built_lock:
        clients = list(_built.items())
    undo: list[tuple[Any, Any, Any]] = []
    for client, built in clients:
        undo.append((client, client.base_url, client.api_key))
        if not built.base_url_given and built.vendor in base_urls:
            client.base_url = base_urls[built.vendor]
        if not built.key_given and built.vendor in keys:
            client.api_key = keys[built.vendor]

    def restore() -> None:
        for client, base_url, api_key in reversed(undo):
            client.base_url, client.api_key = base_url, api_key

    return restore


#: The refused endpoints ``allow_batches=True`` lets through (reserve for them yourself).
BATCH_ENDPOINTS = ("openai.batches",)


def _allowed(allow: tuple[str, ...] | list[str], allow_batches: bool) -> tuple[str, ...]:
    return tuple(allow) + (BATCH_ENDPOINTS if allow_batches else ())


def guarded_http_client(
    *,
    allow_unguarded: bool = False,
    allow: tuple[str, ...] | list[str] = (),
    allow_batches: bool = False,
    prices: Any = None,
    vendor: str | None = None,
    image_tokens: int | None = None,
    store_for_lookup: bool = True,
    **options: Any,
) -> httpx2.Client:
    """An ``httpx2.Client`` whose billable requests go through the ledger; give it to
    an SDK (``openai.OpenAI(http_client=..., max_retries=0)``) or any library that takes
    one. ``options`` go to ``httpx2.Client`` (``timeout=...``).

    ``allow`` names refused endpoints to let through unmetered (``"openai.batches"``:
    reserve for them yourself with ``spend()``); ``vendor`` names the vendor the client
    speaks to (else it is found by host, or by every vendor's rules); ``image_tokens``
    is the most one image or other media item may cost on the models you call (media
    in a request is refused without it: it is billed by its size, unseen here).
    ``store_for_lookup`` (default): an OpenAI chat completion whose request does not
    say ``store`` is sent with ``store: true``, so that beat can look it up should its
    answer never arrive (OpenAI then keeps it, as its stored completions, for its
    retention period); False sends it as written (such a call's outcome, if unknown,
    is left to an operator)."""
    if vendor is not None:
        registry.vendor(vendor)  # an unknown name fails here, not at the first call
    return httpx2.Client(
        transport=GuardedTransport(
            allow_unguarded=allow_unguarded,
            allow=_allowed(allow, allow_batches),
            prices=prices,
            vendor=vendor,
            image_tokens=image_tokens,
            store_for_lookup=store_for_lookup,
        ),
        **options,
    )


def guarded_async_http_client(
    *,
    allow_unguarded: bool = False,
    allow: tuple[str, ...] | list[str] = (),
    allow_batches: bool = False,
    prices: Any = None,
    vendor: str | None = None,
    image_tokens: int | None = None,
    store_for_lookup: bool = True,
    **options: Any,
) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` over the guarded transport (as
    :func:`guarded_http_client`), for the SDKs' async clients and async code."""
    if vendor is not None:
        registry.vendor(vendor)
    return httpx2.AsyncClient(
        transport=AsyncGuardedTransport(
            allow_unguarded=allow_unguarded,
            allow=_allowed(allow, allow_batches),
            prices=prices,
            vendor=vendor,
            image_tokens=image_tokens,
            store_for_lookup=store_for_lookup,
        ),
        **options,
    )


def guarded_client(
    vendor: str,
    *,
    asynchronous: bool = False,
    allow_unguarded: bool = False,
    allow: tuple[str, ...] = (),
    image_tokens: int | None = None,
    store_for_lookup: bool = True,
    prices: Any = None,
    **kwargs: Any,
) -> Any:
    """The registered ``vendor``'s official SDK client (its sync class, or its async
    one), built with ``**kwargs``, retries locked off, on a guarded http client whose
    timeout is the SDK client's; its ``copy``/``with_options`` refuse to turn retries
    back on or to swap the transport. ``allow``, ``image_tokens``,
    ``store_for_lookup`` and ``prices`` as for :func:`guarded_http_client`."""
    found = registry.vendor(vendor)
    name = found.sdk_clients[1 if asynchronous else 0]
    if not found.sdk or not name:
        raise ValueError(f"vendor {vendor!r} names no SDK client to guard")
    _refuse_retries(f"{name}(...)", kwargs)
    check_api_key(found, kwargs)
    bypass.know(str(kwargs["base_url"]) if kwargs.get("base_url") else None)
    build = guarded_async_http_client if asynchronous else guarded_http_client
    http = build(
        allow_unguarded=allow_unguarded,
        allow=allow,
        image_tokens=image_tokens,
        vendor=vendor,
        store_for_lookup=store_for_lookup,
        prices=prices,
        timeout=kwargs.get("timeout", 600.0),
    )
    key_given = kwargs.get("api_key") is not None or bool(
        found.key_env and os.environ.get(found.key_env)
    )
    token = bool(found.token_env) and (
        kwargs.get("auth_token") is not None or bool(os.environ.get(found.token_env))
    )
    if not (key_given or token):
        # OpenAI's SDK refuses to build without a key; Anthropic's fails at the request:
        # a placeholder lets the module import, and the transport refuses to send it
        kwargs = {**kwargs, "api_key": MISSING_API_KEY}
    client = guarded_class(found.sdk, name)(**{**kwargs, "max_retries": 0, "http_client": http})
    with _built_lock:
        _built[client] = _Built(vendor, kwargs.get("base_url") is not None, key_given or token)
    return client


def guarded_openai_client(**options: Any) -> Any:
    """``openai.OpenAI(**kwargs)``, guarded (see :func:`guarded_client`)."""
    return guarded_client("openai", **options)


def guarded_anthropic_client(**options: Any) -> Any:
    """``anthropic.Anthropic(**kwargs)``, guarded (see :func:`guarded_client`)."""
    return guarded_client("anthropic", **options)


def guarded_async_openai_client(**options: Any) -> Any:
    """``openai.AsyncOpenAI(**kwargs)``, guarded: usable inside ``run`` through
    ``asyncio.run``, and in async code a task calls."""
    return guarded_client("openai", asynchronous=True, **options)


def guarded_async_anthropic_client(**options: Any) -> Any:
    """``anthropic.AsyncAnthropic(**kwargs)``, guarded."""
    return guarded_client("anthropic", asynchronous=True, **options)


_classes: dict[tuple[str, str], type] = {}


def is_guarded(http: Any) -> bool:
    """Whether an ``httpx2`` client sends through a guarded transport."""
    return isinstance(getattr(http, "_transport", None), GuardedTransport | AsyncGuardedTransport)


def guarded_class(module: str, name: str) -> type:
    """A subclass of an SDK's client whose retries stay off: ``max_retries`` cannot be
    set above 0, and ``copy``/``with_options`` keep a guarded HTTP client."""
    found = _classes.get((module, name))
    if found is not None:
        return found
    base = getattr(importlib.import_module(module), name)

    def _get_retries(self: Any) -> int:
        return 0

    def _set_retries(self: Any, value: object) -> None:
        if value != 0 or isinstance(value, bool):
            raise RetriesEnabled(f"a guarded {module} client", value)

    def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        http = kwargs.get("http_client")
        if http is not None and not is_guarded(http):
            raise ValueError(
                "a guarded client keeps its guarded http client: give copy()/with_options() "
                "a budget_tasks.transport.guarded_http_client(), or none"
            )
        return base.copy(self, *args, **kwargs)

    guarded = type(
        f"Guarded{name}",
        (base,),
        {
            "max_retries": property(_get_retries, _set_retries),
            "copy": copy,
            "with_options": copy,
            "__module__": __name__,
        },
    )
    _classes[(module, name)] = guarded
    return guarded
