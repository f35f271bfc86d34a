"""OpenTelemetry spans drawn by the tracing hooks sink in a real ``celery worker``: a
PostgreSQL ledger, a Redis broker, the official openai SDK against the fake provider,
and the SDK's in-memory exporter in the pool process (tests/integration/tracing_tasks.py
hands its spans back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetExceeded, Ledger
from budget_tasks.testing import FakeProvider

from ..workers import Worker
from .test_beat import unknown_attempt
from .test_workers import requests_for

pytest.importorskip("opentelemetry.sdk")

INCLUDE = "tests.integration.worker_tasks,tests.integration.tracing_tasks"
MODEL = "gpt-4o-mini"
TEXT = "Quarterly report: revenue up, costs down."

Span = dict[str, Any]


def spans_of(client: Celery) -> list[Span]:
    return list(client.send_task("tests.tracing.spans").get(timeout=60))


def deliveries(spans: list[Span], operation: str) -> list[Span]:
    return [
        s
        for s in spans
        if s["name"] == "budget_tasks.deliver"
        and s["attributes"]["budget_tasks.operation.key"] == operation
    ]


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s["parent_id"] == parent["span_id"]]


def input_tokens(usage: dict[str, int]) -> int:
    """What the fake billed as input: plain, cache reads and cache writes."""
    parts = ("input_tokens", "cached_input_tokens", "cache_write_tokens", "cache_write_1h_tokens")
    return sum(usage.get(k, 0) for k in parts)


def check_call_span(call: Span, served: Any, attempt: str) -> None:
    """A provider call's span says what the fake provider served and billed."""
    a = call["attributes"]
    assert call["kind"] == "CLIENT"
    assert call["name"] == f"chat {MODEL}"
    assert a["gen_ai.system"] == a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == served.answered_by
    assert a["gen_ai.usage.input_tokens"] == input_tokens(served.usage) > 0
    assert a["gen_ai.usage.output_tokens"] == served.usage["output_tokens"] > 0
    assert a["budget_tasks.actual"] == served.billed > 0
    assert a["budget_tasks.attempt.key"] == attempt
    assert a["budget_tasks.call.outcome"] == "answered"


def test_deliveries_replays_denials_and_beat_jobs_as_spans_under_celerys_own(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("tiny", 1)
    pg_ledger.create_budget("team", 1_000_000)
    start_worker(options={"include": INCLUDE}, BUDGET_TASKS_TEST_CELERY_OTEL="1")

    # a first delivery: admitted, one provider call
    first = client.send_task("tests.summarize", args=["doc-t1", TEXT], task_id="t1-a")
    value = first.get(timeout=60)
    # the same document again (another message): replayed, no call
    again = client.send_task("tests.summarize", args=["doc-t1", TEXT], task_id="t1-b")
    assert again.get(timeout=60) == value
    # a tenant whose budget cannot hold the estimate: denied
    denied = client.send_task("tests.summarize", args=["doc-t2", TEXT, "tiny"])
    with pytest.raises(BudgetExceeded):
        denied.get(timeout=60)
    # two holds left sending and unknown long ago: the beat job flags both
    unknown_attempt(pg_ledger, "old-1")
    unknown_attempt(pg_ledger, "old-2")
    assert client.send_task("budget_tasks.flag_stale_holds").get(timeout=60) == 2

    spans = spans_of(client)
    [served] = requests_for(fake, "summarize:doc-t1", pg_ledger)
    [attempt] = [a for a in pg_ledger.attempts() if a.key.startswith("summarize:doc-t1")]

    admitted, replayed = deliveries(spans, "summarize:doc-t1")
    a = admitted["attributes"]
    assert a["budget_tasks.decision"] == "admitted"
    assert a["budget_tasks.task"] == "tests.summarize"
    assert a["budget_tasks.budget"] == "default"
    assert a["budget_tasks.attempt.key"] == attempt.key == "summarize:doc-t1#1"
    assert a["budget_tasks.estimate"] == attempt.amount > 0
    assert a["budget_tasks.actual"] == served.billed == attempt.actual
    assert a["budget_tasks.overrun"] == 0
    assert a["budget_tasks.outcome"] == "ok"
    [call] = children(spans, admitted)
    check_call_span(call, served, attempt.key)
    assert call["trace_id"] == admitted["trace_id"]

    assert replayed["attributes"]["budget_tasks.decision"] == "replay"
    assert replayed["attributes"]["budget_tasks.actual"] == 0
    assert children(spans, replayed) == []  # no provider call
    same_trace = [s for s in spans if s["trace_id"] == replayed["trace_id"]]
    assert [s for s in same_trace if s["kind"] == "CLIENT"] == []

    [refused] = deliveries(spans, "summarize:doc-t2")
    assert refused["attributes"]["budget_tasks.decision"] == "denied"
    assert refused["attributes"]["budget_tasks.budget"] == "tiny"
    assert refused["attributes"]["error.type"] == "BudgetExceeded"
    assert "budget_tasks.denied" in refused["events"]
    assert children(spans, refused) == []

    [job] = [s for s in spans if s["name"] == "budget_tasks.flag_stale_holds"]
    assert job["attributes"]["budget_tasks.count.flagged"] == 2
    assert job["events"].count("budget_tasks.stale") == 2

    # each delivery and the beat job nests under opentelemetry-instrumentation-celery's
    # span of the task that ran it
    by_id = {s["span_id"]: s for s in spans}
    for ours, task in (
        (admitted, "tests.summarize"),
        (replayed, "tests.summarize"),
        (refused, "tests.summarize"),
        (job, "budget_tasks.flag_stale_holds"),
    ):
        parent = by_id[ours["parent_id"]]
        assert parent["name"] == f"run/{task}"
        assert parent["attributes"]["celery.task_name"] == task


def test_the_reference_apps_guarded_sdk_call_is_a_child_of_its_delivery(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """Without Celery's instrumentation a delivery is a root span; the reference app's
    call (the SDK's own, through the guarded transport) is its own attempt under it."""
    start_worker(options={"include": INCLUDE})
    value = client.send_task("workers.summarize", args=["doc-r1", TEXT]).get(timeout=60)
    assert value["summary"]

    spans = spans_of(client)
    [delivery] = deliveries(spans, "summarize:doc-r1")
    [served] = requests_for(fake, "summarize:doc-r1", pg_ledger)
    [call] = children(spans, delivery)
    assert delivery["parent_id"] is None
    a = delivery["attributes"]
    assert a["budget_tasks.decision"] == "admitted"
    # the main attempt reserves nothing here: the SDK call reserved its own bound
    assert a["budget_tasks.estimate"] == 0
    assert a["budget_tasks.actual"] == served.billed
    assert a["budget_tasks.reserved"] > served.billed
    labelled = call["attributes"]["budget_tasks.attempt.key"]
    # the run was admitted with its call: its main call, reserving nothing, has no attempt
    assert "budget_tasks.attempt.key" not in a
    assert labelled.startswith("summarize:doc-r1:")
    check_call_span(call, served, labelled)


def test_a_send_an_error_ends_closes_its_span_with_what_its_hold_became(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """Two sends under one main attempt: the first answered and billed, the second
    refused with a 429. Each is its own span; the second ends with what the hold
    became (settled at the first's usage), and the delivery carries the charge."""
    start_worker(options={"include": INCLUDE})
    with pytest.raises(Exception, match="429"):
        client.send_task("tests.billed_then_429", args=[7]).get(timeout=60)

    spans = spans_of(client)
    [delivery] = deliveries(spans, "b429:7")
    billed, refused = requests_for(fake, "b429:7", pg_ledger)
    assert (billed.status, refused.status, refused.billed) == (200, 429, 0)
    first, second = sorted(
        children(spans, delivery), key=lambda s: s["attributes"]["budget_tasks.send"]
    )
    for call in (first, second):
        assert call["attributes"]["budget_tasks.attempt.key"] == "b429:7#1"
    check_call_span(first, billed, "b429:7#1")
    assert second["attributes"]["budget_tasks.call.outcome"] == "settled"
    assert "gen_ai.usage.input_tokens" not in second["attributes"]
    a = delivery["attributes"]
    assert (a["budget_tasks.decision"], a["budget_tasks.outcome"]) == ("admitted", "error")
    assert a["budget_tasks.actual"] == billed.billed == pg_ledger.balance("default").spent
    assert delivery["status"] == "ERROR"
