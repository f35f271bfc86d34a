"""Extra tasks that the test workers load (``celery worker -I``) beside workers.tasks:
among them the call helpers' shape of the reference tasks (``tests.summarize`` with a
main estimate and ``attempt=self.attempt``, ``tests.research`` with ``spend()``
blocks), which the reference app itself writes with the guarded client."""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import Any

import openai

from budget_tasks import BudgetTask, CallFacts
from budget_tasks.providers import estimates
from budget_tasks.providers.clients import client_timeout
from budget_tasks.providers.registry import openai_client
from tests.support.sdk_calls import LOOKUP_OPENAI_CHAT, openai_chat
from workers.app import app
from workers.tasks import BUDGET, MODEL, notify


@functools.cache
def client() -> Any:
    """The plain SDK client (retries off) the call helpers are given."""
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
        "max_completion_tokens": 256,
    }


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.summarize",
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
    """One call under the task's main attempt (``summarize:<id>#1``)."""
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


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.research",
    budget=BUDGET,
    idempotency_key=lambda topic, steps=3: f"research:{topic}:{steps}",
    estimate_cost=lambda topic, steps=3: 0,
)
def research(self: BudgetTask, topic: str, steps: int = 3) -> dict[str, Any]:
    """Steps in ``spend()`` blocks, then a side effect under ``once``."""
    notes: list[str] = []
    for _ in range(steps):
        request = step_request(topic, notes[-2:])
        with self.spend(estimates.openai_chat(request).amount, "step") as call:
            if not call.replayed:
                sent = openai_chat(client(), attempt=call, **request)
                call.result = sent.result["content"]  # what a redelivery replays
        notes.append(str(call.result)[:200])
    notified = self.once("notify", notify, topic, len(notes))
    return {"topic": topic, "notes": notes, "notified": notified}


def fixed_request(n: int) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": 32,
        "messages": [{"role": "user", "content": "Classify ticket 0000."}],
    }


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.fixed_cost",
    idempotency_key=lambda n: f"fixed:{n}",
    estimate_cost=lambda n: estimates.openai_chat(fixed_request(n)).amount,
)
def fixed_cost(self: BudgetTask, n: int) -> int:
    """Calls the provider and reports no usage: charged exactly its reservation, so the
    number of admissions under a cap is exact."""
    openai_chat(client(), key=self.attempt.key, **fixed_request(n))
    return n


def _die(n: int) -> int:
    os.kill(os.getpid(), signal.SIGKILL)  # a segfault, an OOM kill: the child is gone
    return 0


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.crasher",
    max_deliveries=3,
    idempotency_key=lambda n: f"crash:{n}",
    estimate_cost=_die,
)
def crasher(self: BudgetTask, n: int) -> int:
    return n


def _fault(spec: str) -> dict[str, Any]:
    return {"extra_headers": {"x-fake-fault": spec}}


ONE_CALL = estimates.openai_chat(fixed_request(0)).amount


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.billed_then_429",
    rate_limit_countdown=0.2,
    idempotency_key=lambda n: f"b429:{n}",
    estimate_cost=lambda n: 2 * ONE_CALL,
)
def billed_then_429(self: BudgetTask, n: int) -> int:
    """A billed call, then a second call that the provider rate-limits: the first call's
    cost is settled, and the run is not retried (that would send it again)."""
    openai_chat(client(), attempt=self.attempt, **fixed_request(n))
    openai_chat(client(), attempt=self.attempt, **_fault("status=429"), **fixed_request(n))
    return n


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.agent_steps",
    rate_limit_countdown=0.2,
    retry_when_budget_frees=0.5,
    idempotency_key=lambda topic, faults=None: f"steps:{topic}",
    fingerprint=lambda topic, faults=None: topic,
    estimate_cost=lambda topic, faults=None: 0,
)
def agent_steps(self: BudgetTask, topic: str, faults: dict[str, str] | None = None) -> list[str]:
    """Two labelled calls; ``faults`` names a fault for a step's first attempt."""
    notes = []
    for step in ("one", "two"):
        with self.spend(ONE_CALL, step) as call:
            if not call.replayed:
                first = call.attempt_key.endswith(":1")
                extra = _fault(faults[step]) if faults and step in faults and first else {}
                openai_chat(client(), attempt=call, **extra, **fixed_request(0))
                call.result = f"{step} done"
        notes.append(str(call.result))
    return notes


@functools.cache
def guarded() -> Any:
    from budget_tasks.transport import guarded_openai_client

    return guarded_openai_client(
        base_url=os.environ.get("OPENAI_BASE_URL"), api_key="sk-test", timeout=30.0
    )


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.guarded_agent",
    idempotency_key=lambda topic, marker, change_at=0: f"guarded:{topic}",
    fingerprint=lambda topic, marker, change_at=0: topic,
    estimate_cost=lambda topic, marker, change_at=0: 0,
)
def guarded_agent(self: BudgetTask, topic: str, marker: str, change_at: int = 0) -> list[str]:
    """Five calls through the SDK's own code (the guarded transport meters them). The
    first delivery SIGKILLs itself after call three (``marker`` does not exist yet);
    ``change_at`` makes the redelivery's call of that number ask something else."""
    first = not os.path.exists(marker)
    answers = []
    for n in range(1, 6):
        question = f"{topic}: step {n}" + (" (rephrased)" if n == change_at and not first else "")
        completion = guarded().chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=32,
            messages=[{"role": "user", "content": question}],
        )
        answers.append(completion.choices[0].message.content)
        if n == 3 and first:
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return answers


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.retrying_agent",
    idempotency_key=lambda topic, marker: f"retrying:{topic}",
    fingerprint=lambda topic, marker: topic,
    estimate_cost=lambda topic, marker: 0,
)
def retrying_agent(self: BudgetTask, topic: str, marker: str) -> str:
    """One question through the guarded client, sent again by the task's own code after
    a 429 (the SDK's retries are off). The first delivery SIGKILLs itself once it has
    its answer (``marker`` does not exist yet)."""
    first = not os.path.exists(marker)
    for _ in range(3):
        try:
            completion = guarded().chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=32,
                messages=[{"role": "user", "content": f"{topic}: one question"}],
            )
            break
        except openai.RateLimitError:
            continue
    if first:
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return str(completion.choices[0].message.content)


@functools.cache
def guarded_claude() -> Any:
    from budget_tasks.transport import guarded_anthropic_client

    base = (os.environ.get("OPENAI_BASE_URL") or "").removesuffix("/v1")
    return guarded_anthropic_client(base_url=base, api_key="sk-test", timeout=30.0)


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.sdk_tour",
    idempotency_key=lambda: "tour:1",
    estimate_cost=lambda: 0,
)
def sdk_tour(self: BudgetTask) -> dict[str, Any]:
    """The SDKs' own calls, as a team writes them: a tool round trip, n=3, structured
    output, a stream with and without usage, Anthropic tool use."""
    oai, claude = guarded(), guarded_claude()
    out: dict[str, Any] = {}
    ask = [{"role": "user", "content": "What does 'ebb' mean?"}]
    first = oai.chat.completions.create(
        model="gpt-4o-mini", max_completion_tokens=32, tools=[TOOL], messages=ask
    )
    [call] = first.choices[0].message.tool_calls
    ask += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "the tide going out"},
    ]
    second = oai.chat.completions.create(
        model="gpt-4o-mini", max_completion_tokens=32, tools=[TOOL], messages=ask
    )
    out["tool_round_trip"] = [call.function.name, second.choices[0].finish_reason]
    three = oai.chat.completions.create(
        model="gpt-4o-mini", max_completion_tokens=16, n=3, messages=ask[:1]
    )
    out["n"] = len(three.choices)
    shaped = oai.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=16,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "word", "schema": {"type": "object"}},
        },
        messages=ask[:1],
    )
    out["structured"] = bool(shaped.choices[0].message.content)
    for with_usage in (False, True):
        options = {"stream_options": {"include_usage": True}} if with_usage else {}
        chunks = list(
            oai.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=16,
                stream=True,
                messages=ask[:1],
                **options,
            )
        )
        out[f"stream_usage_{with_usage}"] = sum(c.usage is not None for c in chunks)
    tools = [{"name": "lookup", "description": "Look up.", "input_schema": {"type": "object"}}]
    used = claude.messages.create(
        model="claude-haiku-4-5",
        max_tokens=16,
        tools=tools,
        messages=[{"role": "user", "content": "And 'flow'?"}],
    )
    out["anthropic"] = [used.stop_reason, used.content[0].type]
    return out


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.autoretry_capped",
    rate_limit_countdown=0.1,
    autoretry_for=(openai.BadRequestError,),
    max_retries=2,
    default_retry_delay=0,
    idempotency_key=lambda n: f"capped:{n}",
    estimate_cost=lambda n: ONE_CALL,
)
def autoretry_capped(self: BudgetTask, n: int) -> int:
    """A user's task that lets Celery retry it (autoretry_for, max_retries=2)."""
    openai_chat(client(), attempt=self.attempt, **fixed_request(n))
    return n


@app.task(
    base=BudgetTask,
    bind=True,
    budget=BUDGET,
    name="tests.retries_itself",
    max_retries=3,
    idempotency_key=lambda n, fault=None: f"self-retry:{n}",
    estimate_cost=lambda n, fault=None: ONE_CALL,
)
def retries_itself(self: BudgetTask, n: int, fault: str | None = None) -> int:
    """A user's task that calls self.retry() after a 429 (the provider refused, billed
    nothing): its hold is released, not kept as unknown, and the retry runs."""
    first = fault if fault and self.request.retries == 0 else None
    try:
        openai_chat(
            client(), attempt=self.attempt, **(_fault(first) if first else {}), **fixed_request(n)
        )
    except openai.RateLimitError as exc:
        raise self.retry(exc=exc, countdown=0) from exc
    return n


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.own_client_summary",
    budget=BUDGET,
    idempotency_key=lambda document_id, text: f"own-client:{document_id}",
    estimate_cost=lambda document_id, text: estimates.openai_chat(summary_request(text)).amount,
)
def own_client_summary(self: BudgetTask, document_id: str, text: str) -> str:
    """A call through a client the team built itself (the SDK's own class, retries off),
    with the key as the deployment hands it over (``LEAK_TEST_KEY``: read from a secret
    file, it may keep its last newline)."""
    own = openai.OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL"),
        api_key=os.environ["LEAK_TEST_KEY"],
        max_retries=0,
        timeout=30.0,
    )
    try:
        sent = openai_chat(own, attempt=self.attempt, **summary_request(text))
    except openai.APIConnectionError:
        # as a team's own code logs a failure: the traceback, with every cause in it
        logging.getLogger("tests.own_client").exception("the summary call failed")
        raise
    return str(sent.result["content"])


#: Where the workers write the budget-tasks signals they received (one JSON line each),
#: when a test names a file: the receivers are connected in the worker, as a user's are.
SIGNALS_FILE = os.environ.get("BUDGET_TASKS_TEST_SIGNALS")
if SIGNALS_FILE:
    import json

    from budget_tasks import signals

    def _record(name: str) -> Any:
        def receiver(sender: Any = None, **facts: Any) -> None:
            facts.pop("signal", None)
            line = {"signal": name, "sender": str(sender), **{k: str(v) for k, v in facts.items()}}
            with open(str(SIGNALS_FILE), "a") as out:
                out.write(json.dumps(line) + "\n")

        return receiver

    for _name in ("budget_denied", "delivery_replayed", "outcome_unknown", "rate_limited"):
        getattr(signals, _name).connect(_record(_name), weak=False)


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.rated_chat",
    budget=BUDGET,
    idempotency_key=lambda n: f"rated:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
    rate_wait_in_process=float(os.environ.get("BUDGET_TASKS_TEST_RATE_WAIT", "5")),
)
def rated_chat(self: BudgetTask, n: int) -> int:
    """One short chat through the guarded client: a call the fleet's rate windows admit
    (``max_retries=0``: a wait for a window must not spend a retry)."""
    answer = guarded().chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=16,
        messages=[{"role": "user", "content": f"count {n}"}],
    )
    return int(answer.usage.total_tokens)


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.rated_claude",
    budget=BUDGET,
    idempotency_key=lambda n: f"rated-claude:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
)
def rated_claude(self: BudgetTask, n: int) -> int:
    """One message through the guarded Anthropic client: it may write 100 tokens and
    writes 10, so its output window gets 90 back when it settles."""
    answer = guarded_claude().messages.create(
        model="claude-haiku-4-5",
        max_tokens=100,
        messages=[{"role": "user", "content": f"count {n}"}],
        extra_headers={"x-fake-output-tokens": "10"},
    )
    return int(answer.usage.output_tokens)


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.rated_chat_patient",
    budget=BUDGET,
    idempotency_key=lambda n: f"patient:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
    rate_wait_in_process=120.0,
)
def rated_chat_patient(self: BudgetTask, n: int) -> int:
    """``tests.rated_chat`` that waits up to two minutes in the process for its turn."""
    return int(rated_chat.run(n))


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.rated_async_pair",
    budget=BUDGET,
    idempotency_key=lambda n: f"pair:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
    rate_wait_in_process=60.0,
)
def rated_async_pair(self: BudgetTask, n: int) -> list[str]:
    """Two calls of one run at once through the guarded async client: first one to a
    model whose window is full (it waits its turn), then, a moment later, one to a
    model with no limit. The labels, in the order their answers came."""
    import asyncio

    from budget_tasks.transport import call_label, guarded_async_openai_client

    async def both() -> list[str]:
        api = guarded_async_openai_client(
            base_url=os.environ.get("OPENAI_BASE_URL"), api_key="sk-test", timeout=30.0
        )
        answered: list[str] = []

        async def ask(label: str, model: str, after: float) -> None:
            await asyncio.sleep(after)
            with call_label(label):
                await api.chat.completions.create(
                    model=model,
                    max_completion_tokens=8,
                    messages=[{"role": "user", "content": f"{label} {n}"}],
                )
            answered.append(label)

        await asyncio.gather(ask("limited", "gpt-4o-mini", 0), ask("free", "gpt-4.1-nano", 0.3))
        await api.close()
        return answered

    return asyncio.run(both())


@app.task(
    base=BudgetTask,
    bind=True,
    name="tests.async_spend",
    budget=BUDGET,
    idempotency_key=lambda topic: f"async-spend:{topic}",
    estimate_cost=lambda topic: 0,
)
def async_spend(self: BudgetTask, topic: str) -> list[str]:
    """Two labelled calls in async code, each opened with ``async with self.spend``."""
    import asyncio

    async def steps() -> list[str]:
        notes = []
        for step in ("outline", "draft"):
            request = {**fixed_request(0), "messages": [{"role": "user", "content": step}]}
            async with self.spend(estimates.openai_chat(request).amount, step) as call:
                if not call.replayed:
                    openai_chat(client(), attempt=call, **request)
                    call.result = f"{step} of {topic}"
            notes.append(str(call.result))
        return notes

    return asyncio.run(steps())
