"""Finding an Anthropic call again: Messages keep no record; a Message Batch is read by
its id once it has ended, each request at its own snapshot's batch price."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from ...pricing import Prices, Usage
from ..base import as_json
from ..clients import require_no_retries
from ..lookups import Found, Lookup, Pending, Unknowable, status_of
from . import usage as usage_of


def message_result(message: Any) -> dict[str, Any]:
    """What a task keeps of an Anthropic message: its text, and the whole message as
    JSON under ``response`` (tool_use blocks included)."""
    text = "".join(getattr(block, "text", "") for block in message.content)
    return {
        "id": message.id,
        "content": text,
        "stop_reason": message.stop_reason,
        "response": as_json(message),
    }


def lookup_anthropic_message(**_: Any) -> Lookup:
    """Anthropic's Messages API keeps no record to ask: the hold waits for an operator."""
    return Unknowable("the Anthropic Messages API has no lookup; resolve the hold by hand")


def _gone(batch_id: str) -> Unknowable:
    # its id came back when it was created: its requests may have billed before it was
    # deleted; not finding it now proves nothing
    return Unknowable(f"batch {batch_id} was created and is gone (deleted?)")


def lookup_anthropic_batch_total(
    client: Any,
    *,
    batch_id: str,
    sent_at: datetime,
    settle_after: timedelta | None,
    now: datetime | None = None,
    prices: Prices | None = None,
) -> Lookup:
    """A whole Anthropic Message Batch, by its id: once it has ended, the sum of what its
    succeeded requests used, each at its own snapshot's batch price (errored, canceled
    and expired requests are not billed)."""
    require_no_retries(client)
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
            reported = usage_of.message(message, {"model": message.model}, batch=True)
            if reported is None:
                return Pending(f"batch {batch_id}: request {item.custom_id} has no usage")
            total += reported.cost(prices, "anthropic", sent_at)
            tokens = tokens + reported.usage
            succeeded += 1
    except Exception as exc:
        if status_of(exc) == 404:
            return _gone(batch_id)
        return Pending(f"lookup failed: {type(exc).__name__}: {exc}")
    result = {"id": batch_id, "succeeded": succeeded, "not_billed": failed}
    return Found(total, tokens, result)
