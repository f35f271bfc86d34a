"""The reference app's BudgetTask jobs. They charge the budget named by env ``BUDGET_TASKS_BUDGET``
(default ``default``) and call the OpenAI-compatible API at ``OPENAI_BASE_URL``
through the official SDK, with retries off."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from budget_tasks import BudgetTask, CallFacts
from budget_tasks.providers import estimates, openai_chat, openai_client
from budget_tasks.providers.calls import LOOKUP_OPENAI_CHAT
from budget_tasks.providers.clients import client_timeout

from .app import app

BUDGET = os.environ.get("BUDGET_TASKS_BUDGET", "default")
MODEL = os.environ.get("BUDGET_TASKS_MODEL", "gpt-4o-mini")
MAX_OUTPUT_TOKENS = 256


@cache
def client() -> Any:
    return openai_client(
        base_url=os.environ.get("OPENAI_BASE_URL"),
        api_key=os.environ.get("OPENAI_API_KEY", "sk-not-needed-for-the-fake-provider"),
        timeout=float(os.environ.get("BUDGET_TASKS_PROVIDER_TIMEOUT", "60")),
    )


def summary_request(text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Summarise the document in two sentences."},
            {"role": "user", "content": text},
        ],
        "max_completion_tokens": MAX_OUTPUT_TOKENS,
    }


@app.task(  # type: ignore[untyped-decorator]
    base=BudgetTask,
    bind=True,
    name="workers.summarize",  # the same name wherever the module is imported from
    # a tenant's jobs charge that tenant's budget; without one, BUDGET_TASKS_BUDGET
    budget=lambda document_id, text, tenant=None: tenant or BUDGET,
    idempotency_key=lambda document_id, text, tenant=None: f"summarize:{document_id}",
    estimate_cost=lambda document_id, text, tenant=None: (
        estimates.openai_chat(summary_request(text)).amount
    ),
    # what the call is, known before it is sent: written with the admission
    describe_call=lambda document_id, text, tenant=None: CallFacts(
        LOOKUP_OPENAI_CHAT, MODEL, client_timeout(client())
    ),
)
def summarize(
    self: BudgetTask, document_id: str, text: str, tenant: str | None = None
) -> dict[str, Any]:
    """Summarise one document for ``tenant``; a second message for the same document
    replays."""
    # attempt= sends the attempt key as Idempotency-Key, records what the call is (for
    # reconciliation), its request id as soon as the headers arrive, and its cost.
    sent = openai_chat(client(), attempt=self.attempt, **summary_request(text))
    return {"document_id": document_id, "summary": sent.result["content"], "cost": sent.cost}


def step_request(topic: str, notes: list[str]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You research a topic one step at a time."},
            {"role": "user", "content": f"Topic: {topic}\nNotes so far: {' | '.join(notes)}"},
        ],
        "max_completion_tokens": 128,
    }


def step_estimate(topic: str, notes: list[str]) -> int:
    return estimates.openai_chat(step_request(topic, notes)).amount


@app.task(  # type: ignore[untyped-decorator]
    base=BudgetTask,
    bind=True,
    name="workers.research",
    budget=BUDGET,
    idempotency_key=lambda topic, steps=3: f"research:{topic}:{steps}",
    # the task's own hold covers its bookkeeping; each step reserves for itself
    estimate_cost=lambda topic, steps=3: 0,
)
def research(self: BudgetTask, topic: str, steps: int = 3) -> dict[str, Any]:
    """An agent loop: several billable calls, each its own attempt, then one side
    effect (a notification) that must not repeat."""
    notes: list[str] = []
    for _ in range(steps):
        # Notes are capped so that the estimate taken here bounds the request.
        with self.spend(step_estimate(topic, notes[-2:]), "step") as call:
            if not call.replayed:
                sent = openai_chat(client(), attempt=call, **step_request(topic, notes[-2:]))
                call.result = sent.result["content"]  # what a redelivery replays
        notes.append(str(call.result)[:200])
    notified = self.once("notify", notify, topic, len(notes))
    return {"topic": topic, "notes": notes, "notified": notified}


def notify(topic: str, steps: int) -> str:
    """Stands for an e-mail or a CRM write: it must happen once per operation."""
    return f"notified: {topic} after {steps} steps"
