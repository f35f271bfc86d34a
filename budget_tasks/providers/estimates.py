"""Upper-bound estimates from the very parameters a call will send, one function per
billable endpoint (each vendor's own module holds them; see
:mod:`budget_tasks.providers.bounds` for what is counted and what is refused)."""

from __future__ import annotations

from .anthropic.estimates import batch as anthropic_batch
from .anthropic.estimates import message as anthropic_message
from .openai.estimates import chat as openai_chat
from .openai.estimates import completions as openai_completions
from .openai.estimates import embeddings as openai_embeddings
from .openai.estimates import images as openai_images
from .openai.estimates import response as openai_response
from .openai.estimates import speech as openai_speech

__all__ = [
    "anthropic_batch",
    "anthropic_message",
    "openai_chat",
    "openai_completions",
    "openai_embeddings",
    "openai_images",
    "openai_response",
    "openai_speech",
]
