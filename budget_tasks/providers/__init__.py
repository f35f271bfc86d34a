"""Guarded provider clients, error classification, usage and reconciliation lookups.

This package never imports the ledger: the task layer wires the two together.
"""

from .calls import ATTEMPT_METADATA_KEY, Sent, anthropic_message, openai_chat, openai_response
from .clients import anthropic_client, openai_client, require_no_retries, settle_after
from .lookups import (
    Found,
    Lookup,
    NotFound,
    Pending,
    Unknowable,
    lookup_anthropic_batch,
    lookup_anthropic_message,
    lookup_openai_chat,
    lookup_openai_response,
)
from .outcomes import ErrorOutcome, classify

__all__ = [
    "ATTEMPT_METADATA_KEY",
    "ErrorOutcome",
    "Found",
    "Lookup",
    "NotFound",
    "Pending",
    "Sent",
    "Unknowable",
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
    "require_no_retries",
    "settle_after",
]
