"""Reconciliation lookups through the real SDKs against the fake provider: every
outcome, and "not found" meaning "pending" until the provider cannot still be working."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import openai
import pytest

from budget_tasks.errors import RetriesEnabled
from budget_tasks.providers import Found, NotFound, Pending, Unknowable
from budget_tasks.providers.anthropic.lookups import (
    lookup_anthropic_batch_total,
    lookup_anthropic_message,
)
from budget_tasks.providers.clients import settle_after
from budget_tasks.providers.openai.lookups import lookup_openai_chat, lookup_openai_response
from budget_tasks.providers.registry import anthropic_client, openai_client
from budget_tasks.testing import FakeProvider
from tests.support.sdk_calls import openai_chat, openai_response

PROMPT = [{"role": "user", "content": "What did the board decide?"}]
WINDOW = timedelta(seconds=30)
LONG_AGO = datetime.now(UTC) - timedelta(hours=1)


@pytest.fixture
def oai(fake: FakeProvider) -> Any:
    return openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)


@pytest.fixture
def claude(fake: FakeProvider) -> Any:
    return anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)


def test_settle_after_is_the_client_timeout_plus_a_margin(oai: Any) -> None:
    assert settle_after(oai, timedelta(minutes=1)) >= timedelta(seconds=61)


def test_chat_found_by_id_with_the_billed_actual(fake: FakeProvider, oai: Any) -> None:
    sent = openai_chat(
        oai, key="k1", model="gpt-4o-mini", messages=PROMPT, max_completion_tokens=40
    )
    found = lookup_openai_chat(
        oai,
        model="gpt-4o-mini",
        completion_id=sent.response_id,
        sent_at=LONG_AGO,
        settle_after=WINDOW,
    )
    assert isinstance(found, Found)
    assert found.actual == sent.cost == fake.billed_for("k1")
    assert found.result["content"] == sent.result["content"]


def test_chat_found_by_attempt_key_when_the_answer_never_arrived(
    fake: FakeProvider, oai: Any
) -> None:
    seen: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        openai_chat(
            oai,
            key="k-lost",
            model="gpt-4o-mini",
            messages=PROMPT,
            max_completion_tokens=40,
            on_request_id=seen.append,
            extra_headers={"x-fake-fault": "reset"},
        )
    assert seen == []  # no response, no id
    found = lookup_openai_chat(
        oai, model="gpt-4o-mini", attempt_key="k-lost", sent_at=LONG_AGO, settle_after=WINDOW
    )
    assert isinstance(found, Found)
    assert found.actual == fake.billed_for("k-lost") > 0


def test_chat_timeout_then_found(fake: FakeProvider, oai: Any) -> None:
    with pytest.raises(openai.APITimeoutError):
        openai_chat(
            oai,
            key="k-slow",
            model="gpt-4o-mini",
            messages=PROMPT,
            max_completion_tokens=40,
            extra_headers={"x-fake-fault": "hang=2"},
        )
    found = lookup_openai_chat(
        oai, model="gpt-4o-mini", attempt_key="k-slow", sent_at=LONG_AGO, settle_after=WINDOW
    )
    assert isinstance(found, Found)
    assert found.actual == fake.billed_for("k-slow")


def test_chat_not_found_is_pending_inside_the_window_then_not_found(oai: Any) -> None:
    # The provider stores completions (one is there): "not found" can mean something.
    openai_chat(oai, key="k-other", model="gpt-4o-mini", messages=PROMPT, max_completion_tokens=8)
    now = datetime.now(UTC)
    young = lookup_openai_chat(
        oai,
        model="gpt-4o-mini",
        attempt_key="never-sent",
        sent_at=now - timedelta(seconds=5),
        settle_after=WINDOW,
        now=now,
    )
    assert isinstance(young, Pending)
    old = lookup_openai_chat(
        oai,
        model="gpt-4o-mini",
        attempt_key="never-sent",
        sent_at=now - timedelta(seconds=31),
        settle_after=WINDOW,
        now=now,
    )
    assert isinstance(old, NotFound)
    # A completion id is known only for a call that was answered, so billed: if it is
    # not stored, that says nothing about the bill.
    by_id = lookup_openai_chat(
        oai,
        model="gpt-4o-mini",
        completion_id="chatcmpl-nope",
        sent_at=LONG_AGO,
        settle_after=WINDOW,
    )
    assert isinstance(by_id, Unknowable)
    assert isinstance(
        lookup_openai_chat(oai, model="gpt-4o-mini", sent_at=LONG_AGO, settle_after=WINDOW),
        Unknowable,
    )


def test_chat_not_stored_cannot_be_found(fake: FakeProvider, oai: Any) -> None:
    openai_chat(
        oai,
        key="k-nostore",
        model="gpt-4o-mini",
        messages=PROMPT,
        max_completion_tokens=8,
        store_for_lookup=False,
    )
    result = lookup_openai_chat(
        oai, model="gpt-4o-mini", attempt_key="k-nostore", sent_at=LONG_AGO, settle_after=WINDOW
    )
    # Billed, and nothing stored anywhere: never taken for "not billed"
    assert fake.billed_for("k-nostore") > 0
    assert isinstance(result, Unknowable)  # which is why openai_chat stores by default


@pytest.mark.parametrize("storage", ["off", "no-route"])
def test_a_provider_without_stored_completions_never_says_not_billed(
    fake: FakeProvider, oai: Any, storage: str
) -> None:
    """Storage off (zero data retention) or no stored-completions route at all: a
    billed call that cannot be found must not count as one never billed."""
    fake.completion_storage = storage
    for key in ("k-before", "k-lost"):
        openai_chat(oai, key=key, model="gpt-4o-mini", messages=PROMPT, max_completion_tokens=8)
    assert fake.billed_for("k-lost") > 0
    result = lookup_openai_chat(
        oai, model="gpt-4o-mini", attempt_key="k-lost", sent_at=LONG_AGO, settle_after=WINDOW
    )
    assert isinstance(result, Unknowable), result


def test_background_response_pending_then_found(fake: FakeProvider, oai: Any) -> None:
    sent = openai_response(
        oai,
        key="k-bg",
        model="gpt-4o-mini",
        input="Plan the week.",
        max_output_tokens=30,
        background=True,
        extra_headers={"x-fake-work-seconds": "1"},
    )
    pending = lookup_openai_response(
        oai,
        model="gpt-4o-mini",
        response_id=sent.response_id,
        sent_at=LONG_AGO,
        settle_after=WINDOW,
    )
    assert isinstance(pending, Pending)
    time.sleep(1.1)
    found = lookup_openai_response(
        oai,
        model="gpt-4o-mini",
        response_id=sent.response_id,
        sent_at=LONG_AGO,
        settle_after=WINDOW,
    )
    assert isinstance(found, Found)
    assert found.actual == fake.billed_for("k-bg") > 0
    assert found.result["output_text"]


def test_a_response_whose_id_is_gone_or_unknown_is_unknowable(oai: Any) -> None:
    """An id came back when the response was created: it may have billed before it
    was deleted, so a 404 for it proves nothing, however old the attempt."""
    now = datetime.now(UTC)
    for sent_at in (now, LONG_AGO):
        gone = lookup_openai_response(
            oai, model="gpt-4o-mini", response_id="resp_nope", sent_at=sent_at, settle_after=WINDOW
        )
        assert isinstance(gone, Unknowable) and "gone" in gone.reason
    assert isinstance(
        lookup_openai_response(
            oai, model="gpt-4o-mini", response_id=None, sent_at=LONG_AGO, settle_after=WINDOW
        ),
        Unknowable,
    )


def test_anthropic_batch_pending_then_found_at_what_its_succeeded_requests_billed(
    fake: FakeProvider, claude: Any
) -> None:
    batch = claude.messages.batches.create(
        requests=[
            {
                "custom_id": "ok",
                "params": {"model": "claude-haiku-4-5", "max_tokens": 30, "messages": PROMPT},
            },
            {
                "custom_id": "bad",
                "params": {"model": "claude-nope", "max_tokens": 30, "messages": PROMPT},
            },
        ],
        extra_headers={"x-fake-work-seconds": "1"},
    )
    args = {"batch_id": batch.id, "sent_at": LONG_AGO, "settle_after": WINDOW}
    assert isinstance(lookup_anthropic_batch_total(claude, **args), Pending)
    time.sleep(1.1)
    found = lookup_anthropic_batch_total(claude, **args)
    assert isinstance(found, Found)
    # the errored request is not billed: the total is the one that succeeded
    assert found.actual == fake.state()["billed_total"] > 0
    assert (found.result["succeeded"], found.result["not_billed"]) == (1, 1)
    missing = {**args, "batch_id": "msgbatch_nope"}  # created, then deleted: may have billed
    assert isinstance(lookup_anthropic_batch_total(claude, **missing), Unknowable)


def test_anthropic_messages_are_unknowable() -> None:
    result = lookup_anthropic_message(request_id="req_1")
    assert isinstance(result, Unknowable)
    assert "operator" in result.reason or "by hand" in result.reason


def test_lookups_refuse_clients_with_retries(fake: FakeProvider) -> None:
    with pytest.raises(RetriesEnabled):
        lookup_openai_chat(
            openai.OpenAI(base_url=fake.openai_base_url, api_key="x"),
            model="gpt-4o-mini",
            attempt_key="k",
            sent_at=LONG_AGO,
            settle_after=WINDOW,
        )
    with pytest.raises(RetriesEnabled):
        lookup_anthropic_batch_total(
            anthropic.Anthropic(base_url=fake.url, api_key="x"),
            batch_id="b",
            sent_at=LONG_AGO,
            settle_after=WINDOW,
        )
    assert fake.served() == []
