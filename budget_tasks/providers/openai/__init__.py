"""OpenAI: which requests bill and how, its usage, prices and lookups.

Metered (reserved at their bound, settled at what the answer reports): chat
completions, Responses, embeddings, legacy completions, image generation with the GPT
image models, and speech from per-character models. Refused, because the request does
not bound what they bill: batches (their requests sit in a file), image edits and
variations and audio transcription (billed by the size of the media they upload),
Assistants runs, realtime and live sessions, videos, containers, fine-tuning,
evaluation runs, vector stores (billed by the day) and anything this module does not
name. Free: the reviewed list below (uploads, moderation, token counts, stored
completions' metadata, cancels, the admin API...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

from ...pricing import Estimate, Prices
from ..base import Clients, Endpoint, Kind, LookupFacts, Rule, Vendor
from ..lookups import Lookup, Unknowable
from . import estimates
from . import reports as org_reports
from . import usage as usage_of
from .lookups import (
    ATTEMPT_METADATA_KEY,
    REQUEST_METADATA_KEY,
    lookup_openai_chat,
    lookup_openai_response,
)

#: Lookup names recorded on attempts.
LOOKUP_CHAT = "openai.chat"
LOOKUP_RESPONSES = "openai.responses"

_ID = r"[^/]+"


class OpenAI(Vendor):
    """OpenAI's API (and any API that speaks it, on the hosts you give).

    ``project_tier``: the service tier your project bills a request that leaves the
    tier to it (``auto`` or none); unset, such a request is bounded at the dearest of
    the default and priority tiers, since a project may be set to priority.
    ``stores_chat``: whether a chat completion is stored unless the request says
    (OpenAI's own API does; a gateway that speaks its API may not): unset, only the
    vendor named ``openai`` does."""

    sdk = "openai"
    sdk_clients = ("OpenAI", "AsyncOpenAI")
    key_env = "OPENAI_API_KEY"
    base_url_env = "OPENAI_BASE_URL"
    admin_key_env = "OPENAI_ADMIN_KEY"
    report_reader = org_reports
    cost_groupings = ("model", "api_key", "project")
    rate_limit_headers: Mapping[str, tuple[str, str, str]] = MappingProxyType(
        {
            kind: (
                f"x-ratelimit-limit-{kind}",
                f"x-ratelimit-remaining-{kind}",
                f"x-ratelimit-reset-{kind}",
            )
            for kind in ("requests", "tokens")
        }
    )

    def __init__(
        self,
        name: str = "openai",
        *,
        hosts: Sequence[str] = ("api.openai.com", "eu.api.openai.com", "us.api.openai.com"),
        price_provider: str | None = "openai",
        project_tier: str | None = None,
        stores_chat: bool | None = None,
        admin_key_env: str | None = None,
    ) -> None:
        self.name = name
        # a gateway's traffic is not the OpenAI organisation's: its drift is checked
        # only where it is given an admin key variable of its own
        if admin_key_env is None:
            admin_key_env = type(self).admin_key_env if name == "openai" else ""
        self.admin_key_env = admin_key_env
        self.stores_chat = name == "openai" if stores_chat is None else stores_chat
        self.hosts = tuple(hosts)
        self.price_provider = price_provider
        self.auto_tiers = (project_tier,) if project_tier else estimates.AUTO_TIERS
        self.lookups = (f"{name}.chat", f"{name}.responses")
        self.usage_fields = usage_of.USAGE_FIELDS
        self.rules = self._rules()

    def stores_by_default(self, endpoint: Endpoint) -> bool:
        return self.stores_chat and endpoint.name == f"{self.name}.chat"

    def marked_for_lookup(
        self, endpoint: Endpoint, body: Mapping[str, Any], provider_key: str, digest: str
    ) -> dict[str, Any] | None:
        """A stored chat completion carries both in its metadata."""
        if endpoint.name != f"{self.name}.chat" or not body.get("store"):
            return None
        metadata = {
            **(body.get("metadata") or {}),
            ATTEMPT_METADATA_KEY: provider_key,
            REQUEST_METADATA_KEY: digest,
        }
        return {**body, "metadata": metadata}

    # -- estimates, bound to this vendor's prices and tiers ---------------------------

    def estimate_chat(
        self,
        body: Mapping[str, Any],
        prices: Prices | None = None,
        *,
        image_tokens: int | None = None,
    ) -> Estimate:
        return estimates.chat(
            body,
            prices,
            image_tokens=image_tokens,
            provider=self.price_provider,
            auto_tiers=self.auto_tiers,
        )

    def estimate_response(
        self,
        body: Mapping[str, Any],
        prices: Prices | None = None,
        *,
        image_tokens: int | None = None,
    ) -> Estimate:
        return estimates.response(
            body,
            prices,
            image_tokens=image_tokens,
            provider=self.price_provider,
            auto_tiers=self.auto_tiers,
        )

    def _rules(self) -> tuple[Rule, ...]:
        provider = self.price_provider

        def metered(
            pattern: str, endpoint: Endpoint, why: str = "billed by the tokens it uses"
        ) -> Rule:
            return Rule(pattern, Kind.METERED, why, endpoint, endpoint.name)

        def free(pattern: str, why: str) -> Rule:
            return Rule(pattern, Kind.FREE, why)

        def refused(pattern: str, name: str, why: str) -> Rule:
            return Rule(pattern, Kind.REFUSED, why, name=f"{self.name}.{name}")

        p = self.name
        return (
            metered(
                r"/chat/completions$",
                Endpoint(
                    f"{p}.chat",
                    self.estimate_chat,
                    usage_of.chat,
                    usage_of.chat_stream,
                    lookup=lambda body: f"{p}.chat" if body.get("store") else "none",
                ),
            ),
            metered(
                r"/responses$",
                Endpoint(
                    f"{p}.responses",
                    self.estimate_response,
                    usage_of.response,
                    usage_of.response_stream,
                    lookup=lambda body: f"{p}.responses",
                ),
            ),
            metered(
                r"/embeddings$",
                Endpoint(
                    f"{p}.embeddings",
                    partial(estimates.embeddings, provider=provider),
                    usage_of.embeddings,
                ),
            ),
            metered(
                r"/completions$",
                Endpoint(
                    f"{p}.completions",
                    partial(estimates.completions, provider=provider),
                    usage_of.chat,
                    usage_of.chat_stream,
                ),
            ),
            metered(
                r"/images/generations$",
                Endpoint(
                    f"{p}.images",
                    partial(estimates.images, provider=provider),
                    usage_of.images,
                    tokens_reported=False,  # the images usage report counts images
                ),
            ),
            metered(
                r"/audio/speech$",
                Endpoint(
                    f"{p}.speech",
                    partial(estimates.speech, provider=provider),
                    usage_of.speech,
                    answer="bytes",
                    tokens_reported=False,  # the speech usage report counts characters
                ),
                "billed by the characters of its input (per-character voices only)",
            ),
            # reviewed: bills nothing
            free(rf"/chat/completions/{_ID}$", "updates a stored completion's metadata"),
            free(r"/responses/input_tokens$", "counts a request's input tokens"),
            free(rf"/responses/{_ID}/cancel$", "cancels a background response"),
            free(r"/moderations$", "moderation is free"),
            free(r"/files$", "uploads a file (a request that uses it is bounded or refused)"),
            free(rf"/uploads(/{_ID}/(parts|complete|cancel))?$", "uploads a file in parts"),
            free(rf"/batches/{_ID}/cancel$", "cancels a batch"),
            free(rf"/fine_tuning/jobs/{_ID}/(cancel|pause|resume)$", "changes a job's state"),
            free(r"/fine_tuning/alpha/graders/validate$", "validates a grader"),
            free(rf"/fine_tuning/checkpoints/{_ID}/permissions$", "shares a checkpoint"),
            free(r"/organization(/.*)?$", "the admin API bills nothing"),
            free(r"/projects/.+$", "the admin API bills nothing"),
            free(rf"/webhook_endpoints(/{_ID}(/(rotate_secret|test))?)?$", "manages webhooks"),
            free(
                rf"/conversations(/{_ID}(/items)?)?$",
                "stores items (a response using them is refused)",
            ),
            free(rf"/assistants(/{_ID})?$", "stores an assistant's definition"),
            free(rf"/threads(/{_ID}(/messages(/{_ID})?)?)?$", "stores a thread and its messages"),
            free(rf"/threads/{_ID}/runs/{_ID}(/cancel)?$", "updates or cancels a run"),
            free(rf"/evals(/{_ID})?$", "stores an evaluation's definition"),
            free(rf"/evals/{_ID}/runs/{_ID}/cancel$", "cancels an evaluation run"),
            free(rf"/skills(/{_ID}(/versions)?)?$", "stores a skill"),
            free(rf"/chatkit/sessions/{_ID}/cancel$", "cancels a session"),
            free(rf"/realtime/calls/{_ID}/(hangup|reject)$", "ends a call"),
            free(rf"/live/sessions/{_ID}/(hangup|reject)$", "ends a session"),
            free(rf"/vaults(/{_ID}(/credentials(/{_ID})?)?)?$", "stores credentials"),
            free(rf"/agents/environments/templates(/{_ID})?$", "stores an environment template"),
            # reviewed: may bill, and the request does not bound it
            refused(
                r"/responses/compact$",
                "responses.compact",
                "compaction runs the model on items unseen here",
            ),
            refused(
                r"/batches$", "batches", "a batch's requests sit in an uploaded file, unseen here"
            ),
            refused(
                r"/images/(edits|variations)$",
                "images.edits",
                "billed by the size of the images it uploads",
            ),
            refused(
                r"/audio/(transcriptions|translations)$",
                "audio.transcriptions",
                "billed by the length of the audio it uploads",
            ),
            refused(
                rf"/audio/(voices|voice_consents(/{_ID})?)$",
                "audio.voices",
                "creating a custom voice may bill; its price is not known here",
            ),
            refused(
                r"/videos(/characters|/edits|/extensions)?$", "videos", "billed per second of video"
            ),
            refused(rf"/videos/{_ID}/remix$", "videos", "billed per second of video"),
            refused(
                rf"/threads(/{_ID})?/runs$",
                "threads.runs",
                "a run bills the model's tokens on a thread unseen here",
            ),
            refused(
                rf"/threads/{_ID}/runs/{_ID}/submit_tool_outputs$",
                "threads.runs",
                "continues a run that bills the model's tokens",
            ),
            refused(
                rf"/evals/{_ID}/runs$",
                "evals.runs",
                "an evaluation run bills every model call it makes",
            ),
            refused(
                r"/fine_tuning/jobs$", "fine_tuning", "training bills by the tokens it trains on"
            ),
            refused(
                r"/fine_tuning/alpha/graders/run$", "fine_tuning", "a grader run may call a model"
            ),
            refused(rf"/containers(/{_ID}/files)?$", "containers", "a container bills per session"),
            refused(
                r"/vector_stores(/.*)?$",
                "vector_stores",
                "storage bills by the day, searches and file processing per use",
            ),
            refused(
                r"/realtime/(client_secrets|sessions|transcription_sessions|calls)$",
                "realtime",
                "a realtime session bills over a connection the guard does not see",
            ),
            refused(
                r"/realtime/translations/client_secrets$",
                "realtime",
                "a realtime session bills over a connection the guard does not see",
            ),
            refused(
                rf"/realtime/calls/{_ID}/(accept|refer)$",
                "realtime",
                "a realtime call bills over a connection the guard does not see",
            ),
            refused(
                rf"/live/sessions(/{_ID}(/(accept|fork|refer))?)?$",
                "live",
                "a live session bills over a connection the guard does not see",
            ),
            refused(
                r"/chatkit/sessions$",
                "chatkit",
                "a ChatKit session bills the model's tokens unseen here",
            ),
            refused(
                r"/agents(/.*)?$",
                "agents",
                "an agent's sessions and automations bill model calls unseen here",
            ),
            refused(
                r"/content_provenance_checks$",
                "content_provenance_checks",
                "its price is not known here",
            ),
            refused(r"/decisions$", "decisions", "its price is not known here"),
            refused(r"/safety(/.*)?$", "safety", "its price is not known here"),
        )

    # -- lookups ---------------------------------------------------------------------------

    def look_up(self, facts: LookupFacts, clients: Clients, prices: Prices | None) -> Lookup:
        kind = facts.lookup.removeprefix(f"{self.name}.")
        if kind == "chat":
            return lookup_openai_chat(
                clients(self.name),
                model=facts.model,
                completion_id=facts.response_id,
                attempt_key=facts.provider_key,
                request=facts.request,
                sent_at=facts.sent_at,
                settle_after=facts.settle_after,
                now=facts.now,
                prices=prices,
            )
        if kind == "responses":
            return lookup_openai_response(
                clients(self.name),
                model=facts.model,
                response_id=facts.response_id,
                sent_at=facts.sent_at,
                settle_after=facts.settle_after,
                now=facts.now,
                prices=prices,
            )
        return Unknowable(f"{self.name} has no lookup named {facts.lookup!r}")


__all__ = ["OpenAI"]
