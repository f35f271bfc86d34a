"""Ask a provider, after the fact, what became of an attempt whose outcome is unknown.

Each lookup answers :class:`Found` (the actual charge and the result), :class:`NotFound`
(confirmed: no charge), :class:`Pending` (ask again later) or :class:`Unknowable` (the
API keeps no record: an operator must resolve the hold). A provider's "not found"
counts as NotFound only once the attempt is older than the longest the provider could
still be working on it (``settle_after``: the client timeout plus a margin); before
that it means Pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ..pricing import PriceTable, Usage, default_prices
from . import usage as usage_of
from .calls import ATTEMPT_METADATA_KEY, chat_result, message_result
from .clients import require_no_retries


@dataclass(frozen=True, slots=True)
class Found:
    actual: int
    usage: Usage
    result: dict[str, Any]


@dataclass(frozen=True, slots=True)
class NotFound:
    reason: str


@dataclass(frozen=True, slots=True)
class Pending:
    reason: str


@dataclass(frozen=True, slots=True)
class Unknowable:
    reason: str


Lookup = Found | NotFound | Pending | Unknowable


def _not_found(
    reason: str, sent_at: datetime, settle_after: timedelta, now: datetime | None
) -> NotFound | Pending:
    age = (now or datetime.now(UTC)) - sent_at
    if age < settle_after:
        return Pending(f"{reason}, but the attempt is {age} old (< {settle_after}): not yet")
    return NotFound(reason)


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def _found(model: str, used: Usage, result: dict[str, Any], prices: PriceTable | None) -> Found:
    return Found((prices or default_prices()).cost(model, used), used, result)


def lookup_openai_chat(
    client: Any,
    *,
    model: str,
    sent_at: datetime,
    settle_after: timedelta,
    completion_id: str | None = None,
    attempt_key: str | None = None,
    now: datetime | None = None,
    prices: PriceTable | None = None,
) -> Lookup:
    """A stored chat completion: retrieve it by id, or, when the id never arrived, list
    stored completions by the attempt key in their metadata.

    "Not found" is believed only where the provider shows that it stores completions:
    a known id that 404s was answered (so billed) and is not stored (storage off,
    expired): Unknowable; a list route that 404s does not exist: Unknowable; an empty
    list counts as NotFound only if the store holds other completions (else storage
    may be off) and the attempt is past ``settle_after``."""
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
                return _not_found(
                    f"no stored completion for {attempt_key}", sent_at, settle_after, now
                )
            completion = page.data[0]
    except Exception as exc:
        if _status(exc) == 404:
            if completion_id is not None:
                return Unknowable(
                    f"completion {completion_id} was answered but is not stored "
                    "(storage off or expired)"
                )
            return Unknowable("the provider has no stored-completions route")
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    if completion.usage is None:
        return Pending(f"completion {completion.id} has no usage yet")
    result = chat_result(completion)
    return _found(model, usage_of.from_openai_chat(completion.usage), result, prices)


def lookup_openai_response(
    client: Any,
    *,
    model: str,
    response_id: str | None,
    sent_at: datetime,
    settle_after: timedelta,
    now: datetime | None = None,
    prices: PriceTable | None = None,
) -> Lookup:
    """A Responses API response (background mode), retrieved by id."""
    require_no_retries(client)
    if response_id is None:
        return Unknowable("the Responses API cannot be searched without the response id")
    try:
        response = client.responses.retrieve(response_id)
    except Exception as exc:
        if _status(exc) == 404:
            return _not_found(f"response {response_id} not found", sent_at, settle_after, now)
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    if response.status in ("queued", "in_progress"):
        return Pending(f"response {response_id} is {response.status}")
    result = {"id": response.id, "status": response.status, "output_text": response.output_text}
    if response.usage is None:
        # Ended (failed, cancelled) without any usage: nothing was billed.
        return NotFound(f"response {response_id} ended {response.status} without usage")
    return _found(model, usage_of.from_openai_response(response.usage), result, prices)


def lookup_anthropic_batch(
    client: Any,
    *,
    model: str,
    batch_id: str,
    custom_id: str,
    sent_at: datetime,
    settle_after: timedelta,
    now: datetime | None = None,
    prices: PriceTable | None = None,
) -> Lookup:
    """One request of an Anthropic Message Batch, by batch id and custom_id."""
    require_no_retries(client)
    try:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status != "ended":
            return Pending(f"batch {batch_id} is {batch.processing_status}")
        for item in client.messages.batches.results(batch_id):
            if item.custom_id != custom_id:
                continue
            if item.result.type != "succeeded":
                return NotFound(f"batch request {custom_id} {item.result.type}: not billed")
            message = item.result.message
            used = usage_of.from_anthropic(message.usage)
            return _found(model, used, message_result(message), prices)
    except Exception as exc:
        if _status(exc) == 404:
            return _not_found(f"batch {batch_id} not found", sent_at, settle_after, now)
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    return NotFound(f"batch {batch_id} has no request {custom_id}")


def lookup_anthropic_batch_total(
    client: Any,
    *,
    batch_id: str,
    sent_at: datetime,
    settle_after: timedelta,
    now: datetime | None = None,
    prices: PriceTable | None = None,
) -> Lookup:
    """A whole Anthropic Message Batch, by its id: once it has ended, the sum of what its
    succeeded requests used, each at its own model's price (errored, canceled and
    expired requests are not billed)."""
    require_no_retries(client)
    table = prices or default_prices()
    try:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status != "ended":
            return Pending(f"batch {batch_id} is {batch.processing_status}")
        total, succeeded, failed = 0, 0, 0
        tokens = Usage()
        for item in client.messages.batches.results(batch_id):
            if item.result.type != "succeeded":
                failed += 1
                continue
            message = item.result.message
            used = usage_of.from_anthropic(message.usage)
            total += table.cost(message.model, used)
            tokens = Usage(
                input_tokens=tokens.input_tokens + used.input_tokens,
                cached_input_tokens=tokens.cached_input_tokens + used.cached_input_tokens,
                cache_write_tokens=tokens.cache_write_tokens + used.cache_write_tokens,
                output_tokens=tokens.output_tokens + used.output_tokens,
            )
            succeeded += 1
    except Exception as exc:
        if _status(exc) == 404:
            return _not_found(f"batch {batch_id} not found", sent_at, settle_after, now)
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    result = {"id": batch_id, "succeeded": succeeded, "not_billed": failed}
    return Found(total, tokens, result)


def lookup_anthropic_message(**_: Any) -> Lookup:
    """Anthropic's Messages API keeps no record to ask: the hold waits for an operator."""
    return Unknowable("the Anthropic Messages API has no lookup; resolve the hold by hand")
