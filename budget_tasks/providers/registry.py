"""The vendors this process knows, and the one decision the guard makes with them: is a
request metered, free, or refused?

The decision, for a POST (every other method bills nothing):

1. the vendor is the one the client was built for (``guarded_openai_client`` says
   OpenAI), else the one that serves the request's host (``api.openai.com``);
2. of that vendor's rules that match the path, one that may bill (metered or
   refused) beats a free one; among those, the one that matches the most of the path
   decides, the most restrictive where two match as much;
3. a request to a host no vendor claims, from a client built for none (a plain guarded
   http client, a framework on top of it), is judged by every vendor's rules, the same
   way;
4. a POST that no rule matches is refused: deny by default.

Register an OpenAI-compatible gateway as a vendor of its own (its hosts, its price
provider or your own table)::

    from budget_tasks.providers import OpenAI, register
    register(OpenAI("gateway", hosts=["llm-gateway.internal"], price_provider="openai"))
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .. import bypass
from ..errors import BudgetTasksError
from .anthropic import Anthropic
from .base import Endpoint, Kind, Rule, Vendor, sdk_client
from .openai import OpenAI

#: Most restrictive first: where two rules match as much of a path, the first wins.
_RESTRICTIVE = (Kind.REFUSED, Kind.METERED, Kind.FREE)


@dataclass(frozen=True)
class Route:
    """The guard's decision for one request."""

    kind: Kind
    why: str
    vendor: Vendor | None = None
    rule: Rule | None = None

    @property
    def endpoint(self) -> Endpoint | None:
        return None if self.rule is None else self.rule.endpoint

    @property
    def name(self) -> str:
        """The rule's name (a client may allow a refused rule by it)."""
        return "" if self.rule is None else self.rule.name


class UnknownVendor(BudgetTasksError, LookupError):
    """A vendor name no registered vendor has."""

    template = "no vendor named {vendor!r} is registered"
    vendor: str


#: How many decided routes a registry keeps.
_ROUTES_KEPT = 1024


class Registry:
    """Vendors by name and by host (see the module)."""

    def __init__(self, vendors: Iterable[Vendor] = ()) -> None:
        self._lock = threading.Lock()
        self._vendors: dict[str, Vendor] = {}
        self._hosts: dict[str, Vendor] = {}
        #: routes decided, by request: every guarded call asks again for the same few
        self._routes: dict[tuple[str, str, str, str | None], Route] = {}
        for vendor in vendors:
            self.register(vendor)

    def register(self, vendor: Vendor) -> Vendor:
        """Add ``vendor`` (replacing one of the same name); its hosts become its own."""
        if not vendor.name:
            raise ValueError("a vendor needs a name")
        with self._lock:
            old = self._vendors.get(vendor.name)
            if old is not None:
                for host in old.hosts:
                    self._hosts.pop(host.lower(), None)
            self._vendors[vendor.name] = vendor
            for host in vendor.hosts:
                self._hosts[host.lower()] = vendor
            self._routes = {}
        # its endpoints are known provider endpoints: opened unguarded, they are refused
        for host in vendor.hosts:
            bypass.know(f"https://{host}")
        bypass.know_env(vendor.base_url_env)
        return vendor

    def unregister(self, name: str) -> None:
        """Forget the vendor named ``name`` (and its hosts)."""
        with self._lock:
            old = self._vendors.pop(name, None)
            for host in old.hosts if old is not None else ():
                if self._hosts.get(host.lower()) is old:
                    del self._hosts[host.lower()]
            self._routes = {}

    def vendor(self, name: str) -> Vendor:
        try:
            return self._vendors[name]
        except KeyError:
            raise UnknownVendor(name) from None

    def find(self, name: str) -> Vendor | None:
        """The vendor named ``name``, or None."""
        return self._vendors.get(name)

    def vendors(self) -> list[Vendor]:
        return list(self._vendors.values())

    def for_lookup(self, lookup: str) -> Vendor | None:
        """The vendor a recorded lookup name (``openai.chat``) belongs to."""
        name = lookup.split(".", 1)[0]
        return self._vendors.get(name)

    def route(self, method: str, host: str, path: str, vendor: str | None = None) -> Route:
        """Metered, free or refused (see the module)."""
        request = (method, host, path, vendor)
        routes = self._routes
        found = routes.get(request)
        if found is None:
            found = self._decide(method, host, path, vendor)
            if len(routes) >= _ROUTES_KEPT:  # paths with ids are many: start again
                routes.clear()
            routes[request] = found
        return found

    def _decide(self, method: str, host: str, path: str, vendor: str | None) -> Route:
        if method.upper() != "POST":
            return Route(Kind.FREE, f"a {method.upper()} bills nothing")
        chosen = self.vendor(vendor) if vendor else self._hosts.get(host.lower())
        candidates = [chosen] if chosen is not None else self.vendors()
        best: tuple[int, int, int, Rule, Vendor] | None = None
        for v in candidates:
            for rule in v.rules:
                length = rule.match_length(path)
                if not length:
                    continue
                # a rule that may bill beats any free one, whatever their lengths: a free
                # rule that swallows the rest of a path (the admin API's) must not let a
                # gateway's /.../chat/completions through unmetered
                rank = (rule.kind is not Kind.FREE, length, -_RESTRICTIVE.index(rule.kind))
                if best is None or rank > best[:3]:
                    best = (*rank, rule, v)
        if best is None:
            who = chosen.name if chosen is not None else "no registered vendor"
            return Route(
                Kind.REFUSED,
                f"POST {path} to {host}: {who} says whether it bills, so it is refused "
                "(deny by default; register the endpoint's vendor, or allow it by name)",
                chosen,
            )
        rule, v = best[3], best[4]
        return Route(rule.kind, rule.why, v, rule)


#: This process's vendors: OpenAI and Anthropic, and any you register.
registry = Registry([OpenAI(), Anthropic()])


def register(vendor: Vendor) -> Vendor:
    """Register ``vendor`` with this process's registry (see the module)."""
    return registry.register(vendor)


def openai_client(**kwargs: Any) -> Any:
    """An ``openai.OpenAI`` client with ``max_retries=0`` (needs the ``[openai]`` extra)."""
    return sdk_client(registry.vendor("openai"), **kwargs)


def anthropic_client(**kwargs: Any) -> Any:
    """An ``anthropic.Anthropic`` client with ``max_retries=0`` (``[anthropic]`` extra)."""
    return sdk_client(registry.vendor("anthropic"), **kwargs)
