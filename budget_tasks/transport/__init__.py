"""The guarded transport: the SDKs' own code (or any library that takes an HTTP client)
unchanged, each billable request its own reserved attempt.

Install it with :func:`guarded_http_client` / :func:`guarded_async_http_client` (an
``httpx2`` client, which the official ``openai`` and ``anthropic`` SDKs take as
``http_client=``), or build the SDK's client with :func:`guarded_openai_client`,
:func:`guarded_anthropic_client` and their async twins, or any registered vendor's with
:func:`guarded_client` (retries locked off). Every POST
is judged by the vendors' rules (:mod:`budget_tasks.providers.registry`): free requests
pass, billable ones that cannot be bounded are refused before sending
(:class:`~budget_tasks.errors.RefusedEndpoint`), and each metered one, inside a
BudgetTask's ``run``, is:

1. estimated from its JSON body (an upper bound; a body it cannot bound is refused
   before any byte is sent, naming the field: ``EstimateRefused``);
2. reserved, as the next call of its endpoint in this operation (its *position*:
   ``op:<label/>endpoint:n``), and granted;
3. sent under the attempt's provider key (``Idempotency-Key``), its answer read
   (decoded: the real APIs compress), its usage priced and settled;
4. stored, response bytes and all, so that a redelivery that makes the same call at the
   same position gets the stored response back without sending (a different request
   body there is :class:`~budget_tasks.errors.CallConflict`; a call whose outcome is
   unknown raises ``OutcomeUnknown``, never a resend).

A request the SDK sends again on its own (``x-stainless-retry-count``) is refused.
Streams pass to the SDK as they arrive and settle at their end. Outside a BudgetTask a
billable request is refused (:class:`~budget_tasks.errors.UnguardedCall`) unless the
client was built with ``allow_unguarded=True``. Parallel calls inside ``run`` (threads,
``asyncio.gather``) need a :func:`call_label` per branch, else they are refused.
"""

from ..errors import ParallelCallsUnlabelled
from .clients import (
    guarded_anthropic_client,
    guarded_async_anthropic_client,
    guarded_async_http_client,
    guarded_async_openai_client,
    guarded_client,
    guarded_http_client,
    guarded_openai_client,
)
from .positions import call_label
from .scopes import LabelsLost, ManyRuns

__all__ = [
    "LabelsLost",
    "ManyRuns",
    "ParallelCallsUnlabelled",
    "call_label",
    "guarded_anthropic_client",
    "guarded_async_anthropic_client",
    "guarded_async_http_client",
    "guarded_async_openai_client",
    "guarded_client",
    "guarded_http_client",
    "guarded_openai_client",
]
