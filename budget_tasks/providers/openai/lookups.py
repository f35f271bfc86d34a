"""Finding an OpenAI call again: a stored chat completion (by id, or by the attempt's
provider key in its metadata), a Response (by id)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from ...pricing import Prices
from ..base import as_json
from ..clients import require_no_retries
from ..lookups import Found, Lookup, NotFound, Pending, Unknowable, not_found, status_of
from . import usage as usage_of

#: The metadata keys under which a stored chat completion carries its attempt's
#: provider key (an opaque digest of the installation and attempt key) and the digest
#: of its request, so reconciliation finds it when the response id never arrived and
#: never adopts another request's answer.
ATTEMPT_METADATA_KEY = "budget_tasks_attempt"
REQUEST_METADATA_KEY = "budget_tasks_request"


def chat_result(completion: Any) -> dict[str, Any]:
    """What a task keeps of a chat completion: the first choice's text, and the whole
    completion as JSON under ``response`` (every choice, tool calls, refusals)."""
    choice = completion.choices[0] if completion.choices else None
    return {
        "id": completion.id,
        "content": choice.message.content if choice else None,
        "finish_reason": choice.finish_reason if choice else None,
        "response": as_json(completion),
    }


def _priced(
    answer: Any, read: Callable[..., Any], model: str, prices: Prices | None, sent_at: datetime
) -> tuple[int, Any] | None:
    reported = read(answer, {"model": model})
    if reported is None:
        return None
    return reported.cost(prices, "openai", sent_at), reported.usage


def lookup_openai_chat(
    client: Any,
    *,
    model: str,
    sent_at: datetime,
    settle_after: timedelta | None,
    completion_id: str | None = None,
    attempt_key: str | None = None,
    request: str | None = None,
    now: datetime | None = None,
    prices: Prices | None = None,
) -> Lookup:
    """A stored chat completion: retrieve it by id, or, when the id never arrived, list
    stored completions by the attempt's provider key (``attempt_key``) in their metadata.

    "Not found" is believed only where the provider shows that it stores completions:
    a known id that 404s was answered (so billed) and is not stored (storage off,
    expired): Unknowable; a list route that 404s does not exist: Unknowable; an empty
    list counts as NotFound only if the store holds other completions (else storage
    may be off) and the attempt is past ``settle_after``. A found completion whose
    request digest (``request``) differs from the attempt's is another request's (a
    different installation sharing the key, or a different body): not adopted."""
    require_no_retries(client)
    if completion_id is None and attempt_key is None:
        return Unknowable("neither a completion id nor an attempt key to look for")
    try:
        if completion_id is not None:
            completion = client.chat.completions.retrieve(completion_id)
        else:
            page = client.chat.completions.list(metadata={ATTEMPT_METADATA_KEY: attempt_key})
            if not page.data:
                if not client.chat.completions.list(limit=1).data:
                    return Unknowable(
                        "the provider shows no stored completions at all: storage may be off, "
                        "so not finding this one proves nothing"
                    )
                return not_found(
                    f"no stored completion for {attempt_key}", sent_at, settle_after, now
                )
            completion = page.data[0]
    except Exception as exc:
        if status_of(exc) == 404:
            if completion_id is not None:
                return Unknowable(
                    f"completion {completion_id} was answered but is not stored "
                    "(storage off or expired)"
                )
            return Unknowable("the provider has no stored-completions route")
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    if request is not None:
        theirs = (getattr(completion, "metadata", None) or {}).get(REQUEST_METADATA_KEY)
        if theirs is not None and theirs != request:
            return Unknowable(
                f"completion {completion.id} answers another request than this attempt's "
                "(its request digest differs): not adopted"
            )
    priced = _priced(completion, usage_of.chat, model, prices, sent_at)
    if priced is None:
        return Pending(f"completion {completion.id} has no usage yet")
    actual, used = priced
    result = chat_result(completion)
    if request is not None:
        result["request"] = request
    return Found(actual, used, result)


def lookup_openai_response(
    client: Any,
    *,
    model: str,
    response_id: str | None,
    sent_at: datetime,
    settle_after: timedelta | None,
    now: datetime | None = None,
    prices: Prices | None = None,
) -> Lookup:
    """A Response (background mode, or any stored one), retrieved by id."""
    require_no_retries(client)
    if response_id is None:
        return Unknowable("the Responses API cannot be searched without the response id")
    try:
        response = client.responses.retrieve(response_id)
    except Exception as exc:
        if status_of(exc) == 404:
            # its id came back with an answer: it was created, and may have billed before
            # it was deleted (or expired); not finding it now proves nothing
            return Unknowable(f"response {response_id} was created and is gone (deleted?)")
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    if response.status in ("queued", "in_progress"):
        return Pending(f"response {response_id} is {response.status}")
    result = {"id": response.id, "status": response.status, "output_text": response.output_text}
    priced = _priced(response, usage_of.response, model, prices, sent_at)
    if priced is None:
        if response.status == "failed":
            # failed before it generated anything: nothing was billed
            return NotFound(f"response {response_id} failed without usage")
        # cancelled or incomplete: it may have generated, and billed, part of it
        return Unknowable(f"response {response_id} ended {response.status} without usage")
    actual, used = priced
    return Found(actual, used, result)
