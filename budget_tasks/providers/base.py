"""One shape for every vendor: which requests bill (a vendor's rules), how a billable
request is bounded and what its answer says it used (an endpoint), how a call is found
again afterwards (a lookup). A vendor module fills these in; the transport, beat and
the CLI read them through :mod:`~budget_tasks.providers.registry`.

A vendor's base class here does nothing on its own: every hook has a safe default (no
lookup: an operator resolves the hold), in the way of dramatiq's middleware.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from .. import bypass
from .._rate_ask import RateAsk
from .._trust import Bound
from ..errors import RetriesEnabled, UnusableApiKey, UsageUnreadable
from ..pricing import Estimate, Prices, Usage, default_prices
from ..pricing.usage import STANDARD, PriceContext
from .lookups import Lookup, Unknowable
from .rate_headers import RateState, state_of
from .reports import CostLine, KeyInfo, ReportQuery, UsageLine


@dataclass(frozen=True, slots=True)
class Part:
    """What one model used in an answer, and how it was billed (an answer may hold
    several: a batch's requests, an image's SVG authoring)."""

    model: str
    usage: Usage
    context: PriceContext = STANDARD
    #: the model the request asked for, where the answer names another
    asked: str | None = None


@dataclass(frozen=True, slots=True)
class Reported:
    """What an answer says was used: its priced parts and its id."""

    parts: tuple[Part, ...]
    response_id: str | None = None

    @property
    def usage(self) -> Usage:
        total = Usage()
        for part in self.parts:
            total = total + part.usage
        return total

    def cost(self, prices: Prices | None, provider: str | None, at: datetime | None) -> int:
        """The answer's charge: each part at its own model's price, in the context the
        answer says billed it, at the time of the call."""
        table = prices or default_prices()
        total = 0
        for part in self.parts:
            context = part.context if at is None else _at(part.context, at)
            costs = []
            for model in _models(part):
                if table.knows(model, provider) or model == part.model:
                    costs.append(table.cost(model, part.usage, provider=provider, context=context))
            total += max(costs)
        return total


def _models(part: Part) -> list[str]:
    """The models a part may be priced at: the one that answered, and, where that is
    not a snapshot of the one asked for, the one asked for too (the dearer stands: an
    answer's word alone never prices a call below its request)."""
    asked = part.asked
    if (
        not asked
        or part.model == asked
        or SNAPSHOT_SUFFIX.fullmatch(part.model.removeprefix(asked))
    ):
        return [part.model]
    return [part.model, asked]


#: What a snapshot adds to the end of its alias: ``-2024-08-06``, ``-0125`` or
#: ``-20251001``.
SNAPSHOT_SUFFIX = re.compile(r"-(\d{4}(-\d{2}-\d{2})?|\d{8})$")


def _at(context: PriceContext, at: datetime) -> PriceContext:
    return PriceContext(context.service_tier, context.batch, at, context.speed)


class Estimator(Protocol):
    """An upper bound from a request's JSON body, at ``prices`` (None: this process's);
    ``image_tokens`` is the most one image (or other media item) may cost, where the
    caller knows it (else media is refused)."""

    def __call__(
        self,
        params: Mapping[str, Any],
        prices: Prices | None = ...,
        /,
        *,
        image_tokens: int | None = ...,
    ) -> Estimate: ...


#: What an answer (its JSON, None for a body that is not JSON) and the request's body
#: say was used; None where the answer carries no usage yet (a background Response).
UsageReader = Callable[[Any, Mapping[str, Any]], "Reported | None"]
#: The same from a stream's events (decoded JSON, in order).
StreamReader = Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], "Reported | None"]


@dataclass(frozen=True)
class Endpoint:
    """A billable endpoint: how to bound a request to it and read what it used."""

    name: str
    estimate: Estimator
    usage: UsageReader
    #: the usage of a streamed answer (None: this endpoint does not stream)
    stream_usage: StreamReader | None = None
    #: which lookup finds a call again (by its request body)
    lookup: Callable[[Mapping[str, Any]], str] = lambda body: "none"
    #: "json": the answer is JSON; "bytes": it is not (audio), and ``usage`` reads the
    #: request alone
    answer: str = "json"
    #: whether the vendor's usage reports count its tokens (the drift check compares
    #: them); images and speech are counted in images and characters
    tokens_reported: bool = True


class Kind(enum.Enum):
    """What the guard does with a request."""

    METERED = "metered"  # reserved, sent, settled, stored
    FREE = "free"  # bills nothing: passes (reviewed, with its reason)
    REFUSED = "refused"  # may bill and cannot be bounded here: refused before sending


@dataclass(frozen=True)
class Rule:
    """Requests whose path matches ``pattern`` (searched; the longest match among a
    vendor's rules wins) are of ``kind``; ``name`` lets a client allow a refused one."""

    pattern: str
    kind: Kind
    why: str
    endpoint: Endpoint | None = None
    name: str = ""
    compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", re.compile(self.pattern))
        if (self.kind is Kind.METERED) != (self.endpoint is not None):
            raise ValueError(
                f"rule {self.pattern!r}: a metered rule, and only one, names its endpoint"
            )

    def match_length(self, path: str) -> int:
        """How much of ``path`` this rule matches (0: none)."""
        found = self.compiled.search(path)
        return 0 if found is None else max(1, found.end() - found.start())


def field_of(obj: Any, name: str) -> Any:
    """A field of an answer, from its JSON (a mapping) or the SDK's object."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def count_of(value: Any, field: str = "count") -> int:
    """A token count from an answer: 0 where it is missing; an int as it is; a float or
    digits rounded up. Anything else (a negative number, letters, a bool) raises
    UsageUnreadable: a count that cannot be read is never read as 0."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return math.ceil(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise UsageUnreadable(field, repr(value)[:80])


def usage_object(value: Any, field: str = "usage", *, needs: tuple[str, ...] = ()) -> Any:
    """An answer's usage, where it is an object (a mapping or the SDK's model) that
    carries the totals it ``needs`` (a usage without them says nothing it can be
    charged by)."""
    if value is None and not needs:
        return value
    if not (isinstance(value, Mapping) or hasattr(type(value), "model_fields")):
        raise UsageUnreadable(field, repr(value)[:80])
    for name in needs:
        if field_of(value, name) is None:
            raise UsageUnreadable(f"{field}.{name}", "None")
    return value


def as_json(obj: Any) -> Any:
    """An SDK object as JSON (its ``model_dump``), or the object if it has none."""
    dump = getattr(obj, "model_dump", None)
    return dump(mode="json") if callable(dump) else obj


def request_digest(body: Mapping[str, Any]) -> str:
    """The digest of a request body: what a call is (its stored answer replays, and an
    answer found at the provider is adopted, only for the same digest)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


#: How to get an SDK client for a vendor's lookups (beat gives one built from env).
Clients = Callable[[str], Any]


@dataclass(frozen=True)
class LookupFacts:
    """What a lookup knows of the attempt it looks for."""

    lookup: str
    model: str
    key: str
    provider_key: str
    response_id: str | None
    sent_at: datetime
    settle_after: timedelta | None
    now: datetime | None
    request: str | None = None


class Vendor:
    """A provider: its hosts, rules, prices and lookups (see the module).

    ``price_provider`` names the vendor in the maintained price source (genai-prices'
    provider id); ``hosts`` are the API hosts it serves on (a request to one of them is
    judged by this vendor's rules alone)."""

    name: str = ""
    hosts: tuple[str, ...] = ()
    price_provider: str | None = None
    rules: tuple[Rule, ...] = ()
    #: the lookups this vendor answers (names recorded on attempts)
    lookups: tuple[str, ...] = ()
    #: every usage field of the SDK's usage types: how it is priced, or why it needs no
    #: price of its own (a reviewed list, checked against the installed SDK)
    usage_fields: Mapping[str, str] = {}
    #: its official SDK: the module and its client classes (sync, async) that the
    #: guarded clients subclass
    sdk: str = ""
    sdk_clients: tuple[str, str] = ("", "")
    #: where its SDK reads a key, a bearer token and a base URL from the environment,
    #: and the client arguments that carry a credential
    key_env: str = ""
    token_env: str = ""
    base_url_env: str = ""
    credential_arguments: tuple[str, ...] = ("api_key",)
    #: where an admin key for the organisation's usage and cost reports is read from
    #: (unset: this vendor's reports are not read, and its drift is not checked)
    admin_key_env: str = ""
    #: what reads those reports: a module (or object) with ``usage_report``,
    #: ``cost_report`` and ``api_keys`` of the shapes below (None: it has none)
    report_reader: Any = None
    #: what its cost report can be grouped by (of ``reports.GROUPINGS``)
    cost_groupings: tuple[str, ...] = ("model", "project")
    #: the rate-limit headers its answers carry, by limit (``rate_headers.KINDS``):
    #: the headers of the limit, what remains and its reset; and whether a reset is a
    #: time (else a duration)
    rate_limit_headers: Mapping[str, tuple[str, str, str]] = {}
    rate_resets_at_a_time: bool = False

    def stores_by_default(self, endpoint: Endpoint) -> bool:
        """Whether the provider keeps a request to ``endpoint`` where the request does
        not say (a kept answer can be looked up again by reconciliation)."""
        return False

    def marked_for_lookup(
        self, endpoint: Endpoint, body: Mapping[str, Any], provider_key: str, digest: str
    ) -> dict[str, Any] | None:
        """The request body as sent, marked with the attempt's provider key and the
        request's digest where the provider keeps the answer under them (so that a
        lookup finds it, and adopts it only for the same request); None: sent as it
        is."""
        return None

    def look_up(self, facts: LookupFacts, clients: Clients, prices: Prices | None) -> Lookup:
        """Ask the provider what became of a call (default: it keeps no record)."""
        return Unknowable(f"{self.name} keeps no record of {facts.lookup} to look up")

    def rate_ask(self, bound: Bound | None) -> RateAsk:
        """What a request counts against this vendor's rate limits as it is sent: one
        request, and its input with the most output it allows (``bound``; None: it
        counts no tokens), as both vendors take it on arrival."""
        if bound is None:
            return RateAsk()
        both = bound.input_tokens + bound.output_tokens
        return RateAsk(1, both, bound.input_tokens, bound.output_tokens)

    def rate_counted(self, usage: Usage, bound: Bound | None) -> RateAsk:
        """What this vendor counted a call as in the end, from its answer's ``usage``:
        what its admission took and this does not count goes back to its windows.
        OpenAI's rule (the default): its input as the answer counts it, and the most
        output it allowed, never corrected by what it produced."""
        output = usage.output_tokens if bound is None else bound.output_tokens
        return RateAsk(1, usage.input_total + output, usage.input_total, output)

    def rate_state(self, headers: Mapping[str, str], now: datetime) -> RateState:
        """What an answer's ``headers`` say of this vendor's rate limits (see
        :mod:`.rate_headers`); empty where it names none."""
        return state_of(headers, now, self.rate_limit_headers, self.rate_resets_at_a_time)

    # -- usage and cost reports (see :mod:`.reports`) -------------------------------------

    def usage_report(self, admin: Any, query: ReportQuery) -> list[UsageLine] | None:
        """The organisation's usage over ``query``, every page of it, read with
        ``admin`` (:meth:`admin_client`); None: this vendor has no usage report."""
        reader = self.report_reader
        return None if reader is None else list(reader.usage_report(admin, query))

    def cost_report(self, admin: Any, query: ReportQuery) -> list[CostLine] | None:
        """The organisation's costs by day over ``query``; None: no cost report."""
        reader = self.report_reader
        return None if reader is None else list(reader.cost_report(admin, query))

    def api_keys(self, admin: Any) -> list[KeyInfo] | None:
        """The organisation's API keys, each with its hint and project; None: the
        vendor does not list them (drift cannot be told by key or project)."""
        reader = self.report_reader
        return None if reader is None else list(reader.api_keys(admin))

    def admin_client(self, timeout: float) -> Any | None:
        """An SDK client that reads the reports, with the admin key from
        ``admin_key_env`` and the base URL its SDK reads; None where no admin key is
        set (drift is off for this vendor)."""
        key = os.environ.get(self.admin_key_env) if self.admin_key_env else None
        if not key:
            return None
        return sdk_client(
            self,
            base_url=os.environ.get(self.base_url_env) if self.base_url_env else None,
            api_key=key,
            timeout=timeout,
        )

    def client(self, timeout: float) -> Any:
        """An SDK client for this vendor's lookups, from the environment (beat): its
        key and base URL from the variables its SDK reads."""
        return sdk_client(
            self,
            base_url=os.environ.get(self.base_url_env) if self.base_url_env else None,
            api_key=os.environ.get(self.key_env, "unset") if self.key_env else "unset",
            timeout=timeout,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def refuse_retries(name: str, kwargs: dict[str, Any]) -> None:
    """Refuse (RetriesEnabled) SDK client arguments that turn its own retries on."""
    if kwargs.get("max_retries", 0) != 0:
        raise RetriesEnabled(name, kwargs["max_retries"])


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
    refuse_retries(f"{vendor.sdk}.{name}(...)", kwargs)
    check_api_key(vendor, kwargs)
    bypass.know(str(kwargs["base_url"]) if kwargs.get("base_url") else None)
    client_class = getattr(importlib.import_module(vendor.sdk), name)
    return client_class(**{**kwargs, "max_retries": 0})


@dataclass(frozen=True, slots=True)
class Sent:
    """A completed billable call: what it returned, what it used and what it cost."""

    provider: str
    model: str
    request_id: str | None
    response_id: str | None
    usage: Usage | None
    cost: int | None
    result: dict[str, Any]
    #: the SDK's own response object; for a stream, the list of the SDK's own events
    #: (chunks) in the order they came
    response: Any = None
    #: the most tokens the request allowed (what its usage is vetted against), where
    #: its estimate could count them
    bound: Bound | None = None
    #: the hint of the API key it was sent with (``reports.hint_of``; never the key)
    credential: str | None = None
    #: whether the vendor's usage reports count its tokens (its endpoint's
    #: ``tokens_reported``)
    tokens_reported: bool = True
    #: what the vendor's rate limits count it as in the end (``Vendor.rate_counted``)
    rate_counted: RateAsk | None = None
