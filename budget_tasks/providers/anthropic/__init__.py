"""Anthropic: which requests bill and how, its usage, prices and lookups.

Metered: Messages (plain and streamed) and Message Batches (held at the sum of their
requests' bounds, settled when the batch has ended, at the batch price). Free: token
counting, file uploads, cancels, the admin API. Refused: sessions, agents' runs,
deployments and anything this module does not name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from types import MappingProxyType

from ..._rate_ask import RateAsk
from ..._trust import Bound
from ...pricing import Prices, Usage
from ..base import Clients, Endpoint, Kind, LookupFacts, Rule, Vendor
from ..lookups import Lookup, Unknowable
from . import estimates
from . import reports as org_reports
from . import usage as usage_of
from .lookups import (
    lookup_anthropic_batch_total,
    lookup_anthropic_message,
)

_ID = r"[^/]+"


class Anthropic(Vendor):
    """Anthropic's API (and any API that speaks it, on the hosts you give)."""

    sdk = "anthropic"
    sdk_clients = ("Anthropic", "AsyncAnthropic")
    key_env = "ANTHROPIC_API_KEY"
    token_env = "ANTHROPIC_AUTH_TOKEN"  # noqa: S105  (the variable's name, not a token)
    base_url_env = "ANTHROPIC_BASE_URL"
    credential_arguments = ("api_key", "auth_token")
    admin_key_env = "ANTHROPIC_ADMIN_KEY"
    report_reader = org_reports
    rate_limit_headers: Mapping[str, tuple[str, str, str]] = MappingProxyType(
        {
            kind: (f"{name}-limit", f"{name}-remaining", f"{name}-reset")
            for kind, name in (
                ("requests", "anthropic-ratelimit-requests"),
                ("tokens", "anthropic-ratelimit-tokens"),
                ("input_tokens", "anthropic-ratelimit-input-tokens"),
                ("output_tokens", "anthropic-ratelimit-output-tokens"),
            )
        }
    )
    rate_resets_at_a_time = True

    def rate_counted(self, usage: Usage, bound: Bound | None) -> RateAsk:
        """Anthropic's rule: input tokens a minute do not count cache reads, and output
        tokens are corrected to what the message produced."""
        counted = usage.input_total - usage.cached_input_tokens
        return RateAsk(1, counted + usage.output_tokens, counted, usage.output_tokens)

    def __init__(
        self,
        name: str = "anthropic",
        *,
        hosts: Sequence[str] = ("api.anthropic.com",),
        price_provider: str | None = "anthropic",
        admin_key_env: str | None = None,
    ) -> None:
        self.name = name
        # another endpoint's traffic is not Anthropic's organisation's: its drift is
        # checked only where it is given an admin key variable of its own
        if admin_key_env is None:
            admin_key_env = type(self).admin_key_env if name == "anthropic" else ""
        self.admin_key_env = admin_key_env
        self.hosts = tuple(hosts)
        self.price_provider = price_provider
        self.lookups = (f"{name}.messages", f"{name}.batch")
        self.usage_fields = usage_of.USAGE_FIELDS
        self.rules = self._rules()

    def _rules(self) -> tuple[Rule, ...]:
        provider, p = self.price_provider, self.name

        def free(pattern: str, why: str) -> Rule:
            return Rule(pattern, Kind.FREE, why)

        def refused(pattern: str, name: str, why: str) -> Rule:
            return Rule(pattern, Kind.REFUSED, why, name=f"{p}.{name}")

        messages = Endpoint(
            f"{p}.messages",
            partial(estimates.message, provider=provider),
            usage_of.message,
            usage_of.message_stream,
            lookup=lambda body: f"{p}.messages",
        )
        batches = Endpoint(
            f"{p}.batches",
            partial(estimates.batch, provider=provider),
            usage_of.batch_created,
            lookup=lambda body: f"{p}.batch",
        )
        return (
            Rule(
                r"/v1/messages$",
                Kind.METERED,
                "billed by the tokens it uses",
                messages,
                messages.name,
            ),
            Rule(
                r"/v1/messages/batches$",
                Kind.METERED,
                "billed when the batch ends",
                batches,
                batches.name,
            ),
            free(r"/v1/messages/count_tokens$", "counts a request's input tokens"),
            free(rf"/v1/messages/batches/{_ID}/cancel$", "cancels a batch"),
            free(r"/v1/files$", "uploads a file (a request that uses it is bounded or refused)"),
            free(r"/v1/organizations(/.*)?$", "the admin API bills nothing"),
            free(r"/v1/compliance(/.*)?$", "the compliance API bills nothing"),
            free(rf"/v1/skills(/{_ID}/versions)?$", "stores a skill"),
            free(r"/v1/user_profiles(/.*)?$", "manages user profiles"),
            free(r"/v1/vaults(/.*)?$", "stores credentials"),
            free(r"/v1/tunnels(/.*)?$", "manages tunnels"),
            free(rf"/v1/agents(/{_ID}(/archive)?)?$", "stores an agent's definition"),
            free(rf"/v1/environments(/{_ID}(/archive)?)?$", "stores an environment's definition"),
            free(r"/v1/memory_stores(/.*)?$", "stores memories"),
            refused(
                r"/v1/sessions(/.*)?$", "sessions", "a session runs the model on events unseen here"
            ),
            refused(
                r"/v1/deployments(/.*)?$",
                "deployments",
                "a deployment's runs bill model calls unseen here",
            ),
            refused(
                rf"/v1/environments/{_ID}/work(/.*)?$",
                "environments.work",
                "work in an environment bills model calls unseen here",
            ),
            refused(r"/v1/dreams(/.*)?$", "dreams", "its price is not known here"),
        )

    def look_up(self, facts: LookupFacts, clients: Clients, prices: Prices | None) -> Lookup:
        kind = facts.lookup.removeprefix(f"{self.name}.")
        if kind == "messages":
            return lookup_anthropic_message()
        if kind == "batch":
            if facts.response_id is None:
                return Unknowable("the batch's id never arrived: an operator resolves it")
            return lookup_anthropic_batch_total(
                clients(self.name),
                batch_id=facts.response_id,
                sent_at=facts.sent_at,
                settle_after=facts.settle_after,
                now=facts.now,
                prices=prices,
            )
        return Unknowable(f"{self.name} has no lookup named {facts.lookup!r}")


__all__ = ["Anthropic"]
