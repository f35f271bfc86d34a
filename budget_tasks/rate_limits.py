"""The providers' rate limits as an app names them: which windows a call takes from
(its scopes), and the limits the app's configuration sets in the ledger.

A call to ``provider`` takes from every window of that provider whose scope is one of:
the model it asks for, that model's name without a snapshot date, each group of models
the app names that holds it (``budget_rate_groups``), ``*`` (every model of the
provider: an organisation's or project's shared quota), and ``key:<hint>`` (the API key
it is sent with, by the hint the vendors' consoles show). A scope with no limit set
holds nothing back and costs nothing.

Limits are set in the ledger, so that every worker on every host takes from the same
windows: with ``budget-tasks limits set``, or by ``budget_rate_limits`` in the app's
configuration, which each worker sets as it starts::

    app.conf.budget_rate_limits = {"openai": {"gpt-4o-mini": {"requests": 600, "tokens": 60_000}}}
    app.conf.budget_rate_groups = {"openai": {"mini": ["gpt-4o-mini", "gpt-4.1-mini"]}}
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _validate as check
from ._rate_ask import RATE_KINDS
from ._trust import Bound
from .ledger.rates import MOST_PER_MINUTE
from .ledger.records import RateClaim
from .providers.base import SNAPSHOT_SUFFIX, Vendor

#: Every model of a provider.
ANY_MODEL = "*"
#: What a scope naming an API key starts with (then the key's hint).
KEY_SCOPE = "key:"

_groups: dict[str, dict[str, frozenset[str]]] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: ``per_minute`` of ``kind`` for ``provider``'s ``scope``."""

    provider: str
    scope: str
    kind: str
    per_minute: int


def set_groups(groups: Mapping[str, Mapping[str, Iterable[str]]]) -> None:
    """Name groups of models that share a quota, per provider (this process's; the
    worker sets them from ``budget_rate_groups``): a call to a model in a group takes
    from that group's windows too."""
    made: dict[str, dict[str, frozenset[str]]] = {}
    for provider, named in _mapping(groups, "budget_rate_groups").items():
        check.text(provider, "provider", max_length=64)
        made[provider] = {}
        for group, models in _mapping(named, f"budget_rate_groups[{provider!r}]").items():
            check.text(group, "rate group", max_length=100)
            if isinstance(models, str) or not isinstance(models, Iterable):
                raise TypeError(f"rate group {group!r} lists its models, not {models!r}")
            made[provider][group] = frozenset(
                check.text(model, "model", max_length=100) for model in models
            )
    with _lock:
        _groups.clear()
        _groups.update(made)


def own_scopes(model: str | None) -> tuple[str, ...]:
    """The scopes that are a model's own: its name, and its name without a snapshot
    date (once where they are the same)."""
    if not model:
        return ()
    return tuple(dict.fromkeys(name[:100] for name in (model, SNAPSHOT_SUFFIX.sub("", model))))


def scopes_of(provider: str, model: str | None, credential: str | None) -> tuple[str, ...]:
    """The scopes a call to ``provider``'s ``model`` with the key ``credential`` (its
    hint) takes from (see the module)."""
    own = own_scopes(model)
    scopes = list(own)
    if model:
        names = {model, SNAPSHOT_SUFFIX.sub("", model)}
        with _lock:
            named = _groups.get(provider, {})
            scopes += sorted(g for g, models in named.items() if names & models)
    scopes.append(ANY_MODEL)
    if credential:
        scopes.append(KEY_SCOPE + credential)
    return tuple(dict.fromkeys(scope[:100] for scope in scopes))


def claim_of(
    vendor: Vendor | None,
    provider: str,
    model: str | None,
    credential: str | None,
    bound: Bound | None,
) -> RateClaim:
    """What a call takes from its rate windows as it is sent (see the module): its
    vendor's count of the request (one request, its input and the output it allows)."""
    ask = (vendor or Vendor()).rate_ask(bound)
    scopes = scopes_of(provider, model, credential)
    return RateClaim(provider, scopes, ask, own_scopes(model))


def limits_of(config: Mapping[str, Any]) -> list[Limit]:
    """The limits ``config`` names (``budget_rate_limits``: provider -> scope -> kind ->
    per minute), checked: a kind not known, or a limit that is not a positive count,
    is refused whole."""
    limits = []
    for provider, scopes in _mapping(config, "budget_rate_limits").items():
        check.text(provider, "provider", max_length=64)
        for scope, kinds in _mapping(scopes, f"budget_rate_limits[{provider!r}]").items():
            check.text(scope, "rate scope", max_length=100)
            for kind, per_minute in _mapping(kinds, f"the limits of {scope!r}").items():
                if kind not in RATE_KINDS:
                    raise ValueError(
                        f"a rate limit is one of {', '.join(RATE_KINDS)} a minute, not {kind!r}"
                    )
                if check.count(per_minute, f"{kind} a minute") == 0:
                    raise ValueError(f"{provider} {scope} {kind}: a limit of 0 admits nothing")
                if per_minute > MOST_PER_MINUTE:
                    raise ValueError(
                        f"{provider} {scope} {kind}: a limit a minute is at most "
                        f"{MOST_PER_MINUTE:,}, not {per_minute:,}"
                    )
                limits.append(Limit(provider, scope, kind, per_minute))
    return limits


def apply_limits(rates: Any, config: Mapping[str, Any]) -> list[Limit]:
    """Set every limit ``config`` names on ``rates`` (a ledger's ``rates``); what was
    set. Limits it does not name are left as they are."""
    limits = limits_of(config)
    for limit in limits:
        rates.set_limit(limit.provider, limit.scope, limit.kind, limit.per_minute)
    return limits


def _mapping(value: Any, name: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping, not {type(value).__name__}")
    return value
