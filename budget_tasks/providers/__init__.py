"""The providers: one package per vendor behind one small interface
(:class:`~budget_tasks.providers.base.Vendor`: which requests bill, the estimate, the
usage and its price, the error classes, the lookup) and a registry the transport, beat
and the CLI use; plus the guarded call helpers and the SDK clients with retries off.

This package never imports the ledger: the task layer wires the two together.
"""

from .anthropic import (
    Anthropic,
    lookup_anthropic_batch,
    lookup_anthropic_message,
)
from .base import Kind, LookupFacts, Reported, Vendor
from .calls import Sent, anthropic_message, openai_chat, openai_response
from .clients import require_no_retries, settle_after
from .lookups import Found, Lookup, NotFound, Pending, Unknowable
from .openai import OpenAI, lookup_openai_chat, lookup_openai_response
from .outcomes import ErrorOutcome, classify
from .registry import (
    UnknownVendor,
    anthropic_client,
    openai_client,
    register,
    registry,
)

__all__ = [
    "Anthropic",
    "ErrorOutcome",
    "Found",
    "Kind",
    "Lookup",
    "LookupFacts",
    "NotFound",
    "OpenAI",
    "Pending",
    "Reported",
    "Sent",
    "Unknowable",
    "UnknownVendor",
    "Vendor",
    "anthropic_client",
    "anthropic_message",
    "classify",
    "lookup_anthropic_batch",
    "lookup_anthropic_message",
    "lookup_openai_chat",
    "lookup_openai_response",
    "openai_chat",
    "openai_client",
    "openai_response",
    "register",
    "registry",
    "require_no_retries",
    "settle_after",
]
