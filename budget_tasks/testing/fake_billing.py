"""What the fake provider bills, as the real APIs bill it: deterministic token counts
for everything a request carries (media and items stored at the provider included),
the snapshot that answers for an alias, reasoning tokens, cache reads and writes by
TTL, service tiers and the batch discount. Each realistic behaviour can be turned off
(:class:`Realism`), to show which test catches a fake that is kinder than the APIs."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ..pricing import Usage
from ..pricing.usage import PriceContext

#: What the fake bills for one image (or screenshot, or document page) in a request,
#: for the tool-use prompt a provider adds when a request carries tools (Anthropic
#: documents a few hundred tokens), and for an item stored at the provider that a
#: request points at (an ``item_reference``: its content is billed, unseen by the
#: client).
IMAGE_TOKENS = 765
TOOL_PROMPT_TOKENS = 346
STORED_ITEM_TOKENS = 6_000
#: The most a model may think: reasoning models report this share of their output as
#: reasoning tokens.
REASONING_SHARE = 2
REASONING_MODELS = ("o1", "o3", "o4", "gpt-5")

#: The snapshot that answers for an alias (the real APIs name the snapshot).
SNAPSHOTS = {
    "gpt-4o": "gpt-4o-2024-08-06",
    "gpt-4o-mini": "gpt-4o-mini-2024-07-18",
    "gpt-4.1": "gpt-4.1-2025-04-14",
    "gpt-4.1-mini": "gpt-4.1-mini-2025-04-14",
    "gpt-4.1-nano": "gpt-4.1-nano-2025-04-14",
    "o3-mini": "o3-mini-2025-01-31",
    "o4-mini": "o4-mini-2025-04-16",
    "gpt-5": "gpt-5-2025-08-07",
    "gpt-5-mini": "gpt-5-mini-2025-08-07",
    "gpt-3.5-turbo-instruct": "gpt-3.5-turbo-instruct-0914",
    "claude-haiku-4-5": "claude-haiku-4-5-20251001",
    "claude-sonnet-4-5": "claude-sonnet-4-5-20250929",
    "claude-opus-4-1": "claude-opus-4-1-20250805",
}

_IMAGE_PARTS = frozenset(
    {"image_url", "input_image", "image", "computer_screenshot", "input_file", "document", "file"}
)
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "summary_text"})


@dataclass(frozen=True)
class Realism:
    """Which of the real APIs' ways the fake follows (all, by default)."""

    #: answer compressed when the client accepts it
    compress: bool = True
    #: answers name the snapshot, not the alias asked for
    snapshots: bool = True
    #: reasoning models report reasoning tokens
    reasoning: bool = True
    #: Anthropic bills cache writes (by TTL) and reads for ``cache_control`` markers
    cache: bool = True
    #: requests are billed at the service tier they ask for (and say so)
    tiers: bool = True
    #: batches bill half price
    batch_discount: bool = True
    #: items the request points at (stored items) and media inside tool results bill
    hidden_input: bool = True
    #: rate-limit and request-id headers as each vendor sends them
    headers: bool = True

    @classmethod
    def kind(cls) -> Realism:
        """Every realistic behaviour off: the fake as it was."""
        return cls(**{f.name: False for f in fields(cls)})

    def without(self, *names: str) -> Realism:
        return replace(self, **dict.fromkeys(names, False))


def text_tokens(text: str) -> int:
    """What the fake bills one text as: a token per 4 UTF-8 bytes, and 4 more."""
    return -(-len(text.encode("utf-8")) // 4) + 4


class _Count:
    """Tokens of one request's content, media and stored items apart."""

    def __init__(self, realism: Realism) -> None:
        self.realism = realism
        self.texts: list[str] = []
        self.images = 0
        self.stored = 0

    def content(self, content: Any) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.texts.append(content)
            return
        if isinstance(content, Mapping):
            self.part(content)
            return
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping):
                    self.part(part)
                else:
                    self.texts.append(str(part))
            return
        self.texts.append(str(content))

    def part(self, part: Mapping[str, Any]) -> None:
        kind = part.get("type", "text")
        if kind in _IMAGE_PARTS:
            self.images += 1
        elif kind == "item_reference":
            if self.realism.hidden_input:
                self.stored += 1
            else:
                self.texts.append(json.dumps(part))
        elif kind in _TEXT_PARTS and isinstance(part.get("text", part.get("refusal")), str):
            self.texts.append(str(part.get("text", part.get("refusal"))))
        else:
            # a tool call or result, a reasoning item: its text as JSON, and any media
            # inside it billed as media
            if self.realism.hidden_input:
                stripped = self._strip(part)
                self.texts.append(json.dumps(stripped))
            else:
                self.texts.append(json.dumps(part))

    def _strip(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            if value.get("type") in _IMAGE_PARTS:
                self.images += 1
                return None
            return {k: self._strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._strip(v) for v in value]
        return value

    def messages(self, messages: Any) -> None:
        if isinstance(messages, str):
            self.texts.append(messages)
            return
        for message in messages or []:
            if not isinstance(message, Mapping):
                self.texts.append(str(message))
                continue
            if message.get("type", "message") != "message" or "content" not in message:
                self.part(message)
                continue
            before = len(self.texts)
            self.content(message.get("content"))
            extra = {k: message[k] for k in ("tool_calls", "function_call") if message.get(k)}
            if extra:
                self.texts.append(json.dumps(extra))
            if len(self.texts) == before:
                self.texts.append("")

    @property
    def tokens(self) -> int:
        return (
            sum(text_tokens(t) for t in self.texts)
            + self.images * IMAGE_TOKENS
            + self.stored * STORED_ITEM_TOKENS
        )


def prompt_tokens(
    messages: Any, system: Any = None, extras: Any = None, realism: Realism | None = None
) -> int:
    """The input tokens the fake bills a request: every message's text (tool calls and
    results as their JSON, media inside them as media), the system prompt, images at a
    fixed count each, stored items the request points at, and ``extras`` (tool
    definitions, a response schema) as JSON plus the tool-use prompt."""
    count = _Count(realism or Realism())
    if system:
        count.content(system)
    count.messages(messages)
    tokens = 3 + count.tokens
    if extras:
        tokens += text_tokens(json.dumps(extras)) + TOOL_PROMPT_TOKENS
    return tokens


def snapshot(model: str, realism: Realism) -> str:
    return SNAPSHOTS.get(model, model) if realism.snapshots else model


def reasoning_tokens(model: str, output: int, asked: int | None, realism: Realism) -> int:
    """Reasoning tokens within ``output``: as asked (``x-fake-reasoning-tokens``), else a
    reasoning model's share."""
    if asked is not None:
        return min(output, asked)
    if realism.reasoning and model.startswith(REASONING_MODELS):
        return output // REASONING_SHARE
    return 0


def tier_of(requested: Any, realism: Realism, anthropic: bool = False) -> str | None:
    """The tier that bills a request, as the answer names it."""
    if anthropic:
        return "standard"
    if not realism.tiers:
        return None
    if requested in (None, "auto"):
        return "default"
    return str(requested)


def context_of(tier: str | None, *, batch: bool = False) -> PriceContext:
    if tier in (None, "default", "standard", "auto"):
        return PriceContext(batch=batch)
    return PriceContext(service_tier=tier, batch=batch)


class PromptCache:
    """Anthropic's prompt cache, as the fake keeps it: a prefix marked with
    ``cache_control`` is written (5 minutes, or 1 hour with ``"ttl": "1h"``) the first
    time, and read while it lives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, float] = {}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _marked(
        self, body: Mapping[str, Any], total_input: int
    ) -> tuple[str, int, str | None] | None:
        """The cache key of ``body``'s marked prefix, its tokens and its TTL; None
        where nothing is marked."""
        prefix, ttl = _cached_prefix(body)
        if prefix is None:
            return None
        tokens = min(
            total_input,
            prompt_tokens(prefix.get("messages") or [], prefix.get("system"), prefix.get("tools")),
        )
        key = hashlib.sha256(json.dumps(prefix, sort_keys=True, default=str).encode()).hexdigest()
        return key, tokens, ttl

    def reads(self, body: Mapping[str, Any], total_input: int) -> int:
        """The input tokens ``body`` would read from the cache now, writing nothing (a
        request the rate limits refuse leaves the cache as it found it)."""
        marked = self._marked(body, total_input)
        if marked is None:
            return 0
        key, tokens, _ = marked
        with self._lock:
            expires = self._entries.get(key)
        return tokens if expires is not None and expires > time.monotonic() else 0

    def split(self, body: Mapping[str, Any], total_input: int) -> tuple[int, int, int, int]:
        """``total_input`` tokens as (plain, read, written 5m, written 1h)."""
        marked = self._marked(body, total_input)
        if marked is None:
            return total_input, 0, 0, 0
        key, tokens, ttl = marked
        now = time.monotonic()
        with self._lock:
            expires = self._entries.get(key)
            if expires is not None and expires > now:
                return total_input - tokens, tokens, 0, 0
            self._entries[key] = now + (3600 if ttl == "1h" else 300)
        if ttl == "1h":
            return total_input - tokens, 0, 0, tokens
        return total_input - tokens, 0, tokens, 0


def _cached_prefix(body: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The part of a request up to its last ``cache_control`` marker (tools, system,
    messages: Anthropic's order), and the marker's TTL."""
    ttl: str | None = None
    last: tuple[str, int] | None = None
    top = body.get("cache_control")
    system = body.get("system")
    sections: dict[str, list[Any]] = {
        "tools": list(body.get("tools") or []),
        "system": list(system) if isinstance(system, list) else [],
        "messages": list(body.get("messages") or []),
    }
    for name in ("tools", "system", "messages"):
        for index, item in enumerate(sections[name]):
            for marker in _markers(item):
                last = (name, index)
                ttl = "1h" if marker.get("ttl") == "1h" else (ttl or "5m")
    if isinstance(top, Mapping):
        # the top-level marker caches up to the last block: the whole request
        ttl = "1h" if top.get("ttl") == "1h" else (ttl or "5m")
        last = ("messages", len(sections["messages"]) - 1)
    if last is None:
        return None, None
    name, index = last
    prefix: dict[str, Any] = {"tools": sections["tools"], "system": body.get("system")}
    if name == "tools":
        prefix = {"tools": sections["tools"][: index + 1]}
    elif name == "system":
        prefix = {"tools": sections["tools"], "system": sections["system"][: index + 1]}
    else:
        prefix["messages"] = sections["messages"][: index + 1]
    return prefix, ttl


def _markers(value: Any) -> list[Mapping[str, Any]]:
    found: list[Mapping[str, Any]] = []
    if isinstance(value, Mapping):
        marker = value.get("cache_control")
        if isinstance(marker, Mapping):
            found.append(marker)
        for v in value.values():
            if isinstance(v, Mapping | list):
                found.extend(_markers(v))
    elif isinstance(value, list):
        for v in value:
            found.extend(_markers(v))
    return found


def usage_total(usage: Usage) -> int:
    return usage.total_input_tokens + usage.output_tokens
