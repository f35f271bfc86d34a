"""The fake provider's rate limits, enforced as the vendors enforce theirs: off until
set, per vendor and model (the model as asked; ``"*"``: one quota shared by every
model of the vendor that has none of its own), per minute, each a token bucket that
holds the limit and refills continuously (limit/60 a second, as both vendors document).

What a request counts (:class:`Ask`), as the vendors count it: OpenAI, one request and
its input plus the most output it may produce, taken on arrival and never corrected;
Anthropic, one request, its input less what it reads from the prompt cache, and its
``max_tokens`` of output, taken on arrival and corrected to what it produced once
billed (:meth:`Limiter.settle`). A request that does not fit takes nothing and is
answered 429 in its vendor's shape (:meth:`Limiter.refusal`); every answer of a limited
model carries the vendor's rate-limit headers, read from the buckets
(:meth:`Limiter.headers`).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..pricing import Prices, Usage
from .fake_billing import PromptCache
from .fake_reports import ANTHROPIC, OPENAI

ANY_MODEL = "*"
KINDS = ("requests", "tokens", "input_tokens", "output_tokens")
#: The limits each vendor has (OpenAI counts input and output together only).
VENDOR_KINDS = {OPENAI: ("requests", "tokens"), ANTHROPIC: KINDS}
#: The output a request may produce when it names no bound (what the fake then bills
#: at most).
DEFAULT_OUTPUT_BOUND = 4096

_OPENAI_WHAT = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}
_ANTHROPIC_WORDS = {
    "requests": "requests",
    "tokens": "tokens",
    "input_tokens": "input tokens",
    "output_tokens": "output tokens",
}
Headers = list[tuple[str, str]]
#: How a limit is written on the command line (``--limit``).
LIMIT_FORM = "VENDOR:MODEL:KIND=N[,KIND=N...]"
LIMIT_EXAMPLE = "openai:gpt-4o-mini:requests=600,tokens=60000"
_WHOLE = re.compile(r"[0-9]+(?:_[0-9]+)*")


@dataclass(frozen=True)
class LimitSpec:
    """The limits a minute asked for one vendor's model (``"*"``: every model of the
    vendor without limits of its own): :meth:`Limiter.set`'s arguments."""

    vendor: str
    model: str
    limits: dict[str, int]


def parse_limit(text: str, prices: Prices | None = None) -> LimitSpec:
    """One ``--limit``: ``VENDOR:MODEL:KIND=N[,KIND=N...]``, e.g.
    ``openai:gpt-4o-mini:requests=600,tokens=60000`` (a model's name may hold colons: a
    fine-tuned one's does). KIND is one the vendor has (:data:`VENDOR_KINDS`; ``-`` for
    ``_`` is read too); N a whole number a minute, from 1. With ``prices``, MODEL is one
    they price (the fake answers any other 404) or ``*``. Raises ValueError saying what
    is wrong."""
    vendor, _, rest = text.partition(":")
    model, _, kinds = rest.rpartition(":")
    vendor, model = vendor.strip(), model.strip()
    if not (vendor and model and kinds.strip()):
        raise ValueError(f"{text!r} is not {LIMIT_FORM} (e.g. {LIMIT_EXAMPLE})")
    if vendor not in VENDOR_KINDS:
        raise ValueError(f"{text!r}: no vendor {vendor!r} (one of {', '.join(VENDOR_KINDS)})")
    if prices is not None and model != ANY_MODEL and not prices.knows(model, vendor):
        raise ValueError(
            f"{text!r}: the fake serves no {vendor} model {model!r} (it would answer it 404)"
        )
    limits: dict[str, int] = {}
    for part in kinds.split(","):
        kind, equals, value = (piece.strip() for piece in part.partition("="))
        kind = kind.replace("-", "_")
        if not equals or not kind:
            raise ValueError(f"{text!r}: {part.strip()!r} is not KIND=N (e.g. requests=600)")
        if kind not in VENDOR_KINDS[vendor]:
            raise ValueError(
                f"{text!r}: {vendor} has no {kind!r} limit (its limits: "
                f"{', '.join(VENDOR_KINDS[vendor])})"
            )
        if kind in limits:
            raise ValueError(f"{text!r}: {kind} is given twice")
        if not _WHOLE.fullmatch(value):
            raise ValueError(f"{text!r}: {kind}={value} is not a whole number a minute")
        if int(value) == 0:
            raise ValueError(f"{text!r}: {kind}=0 would admit nothing (leave the kind out)")
        limits[kind] = int(value)
    return LimitSpec(vendor, model, limits)


def parse_limits(texts: Iterable[str], prices: Prices | None = None) -> list[LimitSpec]:
    """Every ``--limit`` (:func:`parse_limit`), one spec per vendor and model: the
    kinds of one model given apart are put together; one given twice is refused."""
    specs: dict[tuple[str, str], LimitSpec] = {}
    for text in texts:
        spec = parse_limit(text, prices)
        held = specs.setdefault((spec.vendor, spec.model), LimitSpec(spec.vendor, spec.model, {}))
        for kind, value in spec.limits.items():
            if kind in held.limits:
                raise ValueError(f"{text!r}: {spec.vendor} {spec.model} {kind} is given twice")
            held.limits[kind] = value
    return list(specs.values())


def describe(spec: LimitSpec) -> str:
    """``openai gpt-4o-mini: requests 600, tokens 60,000 a minute``."""
    kinds = ", ".join(f"{kind} {value:,}" for kind, value in spec.limits.items())
    return f"{spec.vendor} {spec.model}: {kinds} a minute"


@dataclass(frozen=True)
class Ask:
    """What one request counts against its limits."""

    input: int = 0
    output: int = 0
    requests: int = 1

    def of(self, kind: str) -> int:
        if kind == "requests":
            return self.requests
        if kind == "input_tokens":
            return self.input
        if kind == "output_tokens":
            return self.output
        return self.input + self.output


def output_bound(limit: Any) -> int:
    """The most output a request may produce: its max tokens, else the fake's default."""
    return limit if isinstance(limit, int) and limit > 0 else DEFAULT_OUTPUT_BOUND


def openai_ask(input_tokens: int, limit: Any, choices: int = 1) -> Ask:
    """An OpenAI request: its input plus the bound on each choice's output."""
    return Ask(input_tokens, output_bound(limit) * choices)


def anthropic_ask(cache: PromptCache | None, body: Mapping[str, Any], used: Usage) -> Ask:
    """An Anthropic message: its input but cache reads (``used`` is its usage before the
    cache is consulted), and ``max_tokens`` of output."""
    reads = cache_reads(cache, body, used.input_tokens) if cache is not None else 0
    return Ask(used.input_tokens - reads, output_bound(body.get("max_tokens")))


def cache_reads(cache: PromptCache, body: Mapping[str, Any], total_input: int) -> int:
    """The input tokens ``body`` would read from ``cache`` now (nothing written)."""
    return cache.reads(body, total_input)


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's headers and messages write it (Go's format, to the
    millisecond, rounded up so that waiting it is enough): ``12ms``, ``1.5s``, ``6m0s``."""
    ms = math.ceil(round(max(seconds, 0.0) * 1000, 6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{hours}h" if hours else ""
    if hours or minutes:
        text += f"{minutes}m"
    return text + f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".") + "s"


def rfc3339_after(seconds: float) -> str:
    """The UTC time ``seconds`` from now, as Anthropic's reset headers write it (to the
    second, rounded up)."""
    at = datetime.fromtimestamp(math.ceil(time.time() + max(seconds, 0.0)), UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def unlimited_headers(anthropic: bool) -> Headers:
    """The rate-limit headers of a model without limits: a quota far from reached."""
    if anthropic:
        return [
            (f"anthropic-ratelimit-{kind}-{name}", value)
            for kind in ("requests", "tokens", "input-tokens", "output-tokens")
            for name, value in (
                ("limit", "100000"),
                ("remaining", "99999"),
                ("reset", "2099-01-01T00:00:00Z"),
            )
        ]
    return [
        (f"x-ratelimit-{name}-{kind}", value)
        for kind in ("requests", "tokens")
        for name, value in (("limit", "100000"), ("remaining", "99999"), ("reset", "6ms"))
    ]


class Bucket:
    """Holds up to ``capacity``, refilled continuously at ``capacity`` a minute."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self._at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self.capacity / 60)
        self._at = now

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    def wait(self, amount: int) -> float:
        """Seconds until ``amount`` fits (until full, for more than it holds)."""
        return max(0.0, min(amount, self.capacity) - self.level) * 60 / self.capacity

    def until_full(self) -> float:
        return self.wait(self.capacity)


@dataclass
class Scope:
    """One vendor's limits for a model (or ``"*"``) and their buckets."""

    vendor: str
    model: str
    limits: dict[str, int]
    buckets: dict[str, Bucket]


@dataclass
class Admission:
    """What :meth:`Limiter.admit` decided for one request."""

    scope: Scope
    #: the model the request asked for (None: a batch, which names none)
    model: str | None
    ask: Ask
    #: the limit that refused it (None: admitted, ``ask`` taken)
    refused: str | None = None
    #: seconds until every limit has room for it (refused only)
    wait: float = 0.0
    #: how much of the refusing limit was in use
    used: int = 0


class Limiter:
    """The rate limits of one fake provider; thread-safe (the server is threaded)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: a monotonic clock in seconds (a test may freeze it)
        self.clock = clock
        self._lock = threading.Lock()
        self._scopes: dict[tuple[str, str], Scope] = {}
        #: requests refused since the last :meth:`reset`
        self.refused = 0

    def set(
        self,
        vendor: str,
        model: str = ANY_MODEL,
        *,
        requests: int | None = None,
        tokens: int | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """Limit ``vendor``'s ``model`` per minute (None: not that one; none at all: the
        model's limits removed). Its buckets start full."""
        if vendor not in VENDOR_KINDS:
            raise ValueError(f"unknown vendor {vendor!r} (one of {sorted(VENDOR_KINDS)})")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a model name or '*'")
        asked = {
            "requests": requests,
            "tokens": tokens,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
        }
        limits: dict[str, int] = {}
        for kind, value in asked.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{kind} must be a positive whole number per minute or None")
            if kind not in VENDOR_KINDS[vendor]:
                raise ValueError(f"{vendor} has no {kind} limit ({VENDOR_KINDS[vendor]})")
            limits[kind] = value
        with self._lock:
            if not limits:
                self._scopes.pop((vendor, model), None)
                return
            now = self.clock()
            buckets = {kind: Bucket(value, now) for kind, value in limits.items()}
            self._scopes[(vendor, model)] = Scope(vendor, model, limits, buckets)

    def change(self, vendor: str, model: str = ANY_MODEL, **limits: int) -> None:
        """Change limits of ``vendor``'s ``model`` that are set, as a provider changing
        an account's tier does: each bucket keeps what it holds (never more than its new
        limit) and refills at the new rate from now."""
        with self._lock:
            scope = self._scopes[(vendor, model)]
            now = self.clock()
            for kind, value in limits.items():
                bucket = scope.buckets[kind]
                bucket.refill(now)
                bucket.capacity = value
                bucket.level = min(bucket.level, float(value))
                scope.limits[kind] = value

    def spend(self, vendor: str, model: str = ANY_MODEL, **amounts: int) -> None:
        """What other software sharing the quota sent past this client: taken from the
        buckets of ``vendor``'s ``model`` (they may go below 0: the next request waits
        for the refill)."""
        with self._lock:
            scope = self._scopes[(vendor, model)]
            now = self.clock()
            for kind, amount in amounts.items():
                bucket = scope.buckets[kind]
                bucket.refill(now)
                bucket.level -= amount

    def clear(self) -> None:
        """Remove every limit."""
        with self._lock:
            self._scopes.clear()

    def reset(self) -> None:
        """Remove every limit and forget the refusals."""
        with self._lock:
            self._scopes.clear()
            self.refused = 0

    def configured(self) -> list[dict[str, Any]]:
        """The limits set, one entry per vendor and model."""
        with self._lock:
            return [
                {"vendor": s.vendor, "model": s.model, **s.limits} for s in self._scopes.values()
            ]

    def admit(self, vendor: str, model: str | None, ask: Ask) -> Admission | None:
        """Take ``ask`` from the limits of ``vendor``'s ``model`` (its own, else ``"*"``),
        every limit or none; None when none applies."""
        with self._lock:
            scope = self._scopes.get((vendor, model)) if model else None
            scope = scope or self._scopes.get((vendor, ANY_MODEL))
            if scope is None:
                return None
            now = self.clock()
            waits: dict[str, float] = {}
            for kind, bucket in scope.buckets.items():
                bucket.refill(now)
                if bucket.level < ask.of(kind):
                    waits[kind] = bucket.wait(ask.of(kind))
            if not waits:
                for kind, bucket in scope.buckets.items():
                    bucket.level -= ask.of(kind)
                return Admission(scope, model, ask)
            self.refused += 1
            # the message names the limit that keeps it out longest; retry-after waits
            # for every one
            kind = max(waits, key=lambda k: waits[k])
            bucket = scope.buckets[kind]
            used = bucket.capacity - bucket.remaining
            return Admission(scope, model, ask, kind, max(waits.values()), used)

    def settle(self, admission: Admission, usage: Usage) -> None:
        """Correct an admitted Anthropic message's take to its ``usage`` once billed (its
        input but cache reads, the output it produced): what it reserved and did not
        use goes back."""
        if admission.refused is not None:
            return
        counted = usage.input_tokens + usage.cache_write_tokens + usage.cache_write_1h_tokens
        used = Ask(counted, usage.output_tokens, admission.ask.requests)
        with self._lock:
            now = self.clock()
            for kind, bucket in admission.scope.buckets.items():
                bucket.refill(now)
                back = admission.ask.of(kind) - used.of(kind)
                bucket.level = min(bucket.capacity, bucket.level + back)

    def headers(self, admission: Admission) -> Headers:
        """The vendor's rate-limit headers for the limits set on the request's scope."""
        with self._lock:
            now = self.clock()
            state = []
            for kind, bucket in admission.scope.buckets.items():
                bucket.refill(now)
                state.append((kind, bucket.capacity, bucket.remaining, bucket.until_full()))
        if admission.scope.vendor == ANTHROPIC:
            out: Headers = []
            for kind, limit, remaining, full_in in state:
                name = f"anthropic-ratelimit-{kind.replace('_', '-')}"
                out += [
                    (f"{name}-limit", str(limit)),
                    (f"{name}-remaining", str(remaining)),
                    (f"{name}-reset", rfc3339_after(full_in)),
                ]
            return out
        return [
            *((f"x-ratelimit-limit-{k}", str(limit)) for k, limit, _, _ in state),
            *((f"x-ratelimit-remaining-{k}", str(left)) for k, _, left, _ in state),
            *((f"x-ratelimit-reset-{k}", go_duration(full)) for k, _, _, full in state),
        ]

    def refusal(self, admission: Admission) -> tuple[dict[str, Any], Headers]:
        """A refused request's 429: the vendor's error body, and its retry headers."""
        kind = admission.refused
        assert kind is not None
        scope = admission.scope
        limit, asked = scope.limits[kind], admission.ask.of(kind)
        seconds = max(1, math.ceil(round(admission.wait, 6)))
        if scope.vendor == ANTHROPIC:
            model = f" (model: {admission.model})" if admission.model else ""
            message = (
                f"This request would exceed your organization's rate limit of {limit:,} "
                f"{_ANTHROPIC_WORDS[kind]} per minute{model}. For details, refer to: "
                "https://docs.claude.com/en/api/rate-limits. You can see the response "
                "headers for current usage. Please reduce the prompt length or the maximum "
                "tokens requested, or try again later."
            )
            body = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
            return body, [("retry-after", str(seconds))]
        where = f"{admission.model} in organization org-fake on {_OPENAI_WHAT[kind]}"
        if asked > limit:
            message = (
                f"Request too large for {where}: Limit {limit}, Requested {asked}. The input "
                "or output tokens must be reduced in order to run successfully."
            )
        else:
            message = (
                f"Rate limit reached for {where}: Limit {limit}, Used {admission.used}, "
                f"Requested {asked}. Please try again in {go_duration(admission.wait)}."
            )
        message += " Visit https://platform.openai.com/account/rate-limits to learn more."
        error = {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}
        milliseconds = max(1, math.ceil(round(admission.wait * 1000, 6)))
        return {"error": error}, [
            ("retry-after", str(seconds)),
            ("retry-after-ms", str(milliseconds)),
        ]
