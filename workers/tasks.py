"""The reference app's jobs: the Quick start's task, and an agent loop. Every call goes
through the guarded client (the official openai SDK, retries off), so each request
reserves its own upper bound before it is sent and settles at what it cost; a
redelivery or a second enqueue replays each answer instead of sending it again.

They charge the budget named by the job's ``tenant`` (else env ``BUDGET_TASKS_BUDGET``,
default ``default``) and call the OpenAI API at ``OPENAI_BASE_URL`` (``budget-tasks
fake-provider`` offline) with ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import os
from typing import Any

from budget_tasks import BudgetTask
from budget_tasks.transport import guarded_openai_client

from .app import app

BUDGET = os.environ.get("BUDGET_TASKS_BUDGET", "default")
MODEL = os.environ.get("BUDGET_TASKS_MODEL", "gpt-4o-mini")

# Built at import, as a module does: it needs no key to be built (the CLI and tests
# import this module without secrets), and reads the SDK's variables.
client = guarded_openai_client(timeout=float(os.environ.get("BUDGET_TASKS_PROVIDER_TIMEOUT", "60")))


class Summarize(BudgetTask):
    """Summarise one document for a tenant; a second message for the same document
    replays its summary."""

    name = "workers.summarize"  # the same name wherever the module is imported from

    def budget(self, document_id: str, text: str, tenant: str | None = None) -> str:
        return tenant or BUDGET  # a tenant's jobs charge that tenant's budget

    def idempotency_key(self, document_id: str, text: str, tenant: str | None = None) -> str:
        return f"summarize:{document_id}"  # a redelivery or a second enqueue replays

    def estimate_cost(self, document_id: str, text: str, tenant: str | None = None) -> int:
        return 0  # each SDK call below reserves its own upper bound, from its request

    def run(self, document_id: str, text: str, tenant: str | None = None) -> dict[str, Any]:
        # the SDK's own call and object; its cost has settled its hold when it returns
        completion = client.chat.completions.create(**summary_request(text))
        return {"document_id": document_id, "summary": completion.choices[0].message.content}


def summary_request(text: str) -> dict[str, Any]:
    """The request a summary sends: its ``max_completion_tokens`` bounds what it bills."""
    return {
        "model": MODEL,
        "max_completion_tokens": 256,
        "messages": [
            {"role": "system", "content": "Summarise the document in two sentences."},
            {"role": "user", "content": text},
        ],
    }


summarize = app.register_task(Summarize())


@app.task(  # type: ignore[untyped-decorator]
    base=BudgetTask,
    bind=True,
    name="workers.research",
    budget=BUDGET,
    idempotency_key=lambda topic, steps=3: f"research:{topic}:{steps}",
    estimate_cost=lambda topic, steps=3: 0,  # each step's call reserves for itself
)
def research(self: BudgetTask, topic: str, steps: int = 3) -> dict[str, Any]:
    """An agent loop: several billable calls, each its own attempt at its own position
    (``research:...:openai.chat:1``, ``:2``, ...), then one side effect (a notification)
    that must not repeat."""
    notes: list[str] = []
    for _ in range(steps):
        completion = client.chat.completions.create(
            model=MODEL,
            max_completion_tokens=128,
            messages=[
                {"role": "system", "content": "You research a topic one step at a time."},
                # notes are capped, so the request (and its bound) stays small
                {"role": "user", "content": f"Topic: {topic}\nNotes: {' | '.join(notes[-2:])}"},
            ],
        )
        notes.append(str(completion.choices[0].message.content)[:200])
    notified = self.once("notify", notify, topic, len(notes))
    return {"topic": topic, "notes": notes, "notified": notified}


def notify(topic: str, steps: int) -> str:
    """Stands for an e-mail or a CRM write: it must happen once per operation."""
    return f"notified: {topic} after {steps} steps"
