"""The tasks the benchmarks run in a real worker (``-I benchmarks.bench_tasks``).

``bench.plain`` and ``bench.budgeted`` make the same provider call, plain and budgeted
(overhead and replay figures): the plain task through the SDK client with retries off,
the BudgetTask as the Quick start writes it (``estimate_cost`` 0, the SDK's own call
through the guarded client, which reserves the call's bound); with ``delay=S`` the fake
provider takes S seconds to answer that call (the ``x-fake-fault: delay=S`` header on
the request itself, so each call of either kind gets exactly that delay).
``bench.cheap`` is a BudgetTask with no provider call: it reserves a tiny estimate,
records a usage and settles, so 10,000 of them fit in the memory figure's time.
``bench.rated`` makes one short chat call through the guarded client for the rate
limits held across the fleet (``rate_fleet.py``).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from budget_tasks import BudgetTask
from budget_tasks.providers.registry import openai_client
from budget_tasks.transport import guarded_openai_client
from workers.app import app


@cache
def client() -> Any:
    """The plain SDK client (retries off) both kinds of task call through."""
    return openai_client(base_url=os.environ.get("OPENAI_BASE_URL"), api_key="sk-bench")


@cache
def guarded() -> Any:
    """The Quick start's client: the official SDK, retries off, each call metered."""
    return guarded_openai_client(base_url=os.environ.get("OPENAI_BASE_URL"), api_key="sk-bench")


REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "ping"}],
}


def _request(delay: float) -> dict[str, Any]:
    if not delay:
        return REQUEST
    return {**REQUEST, "extra_headers": {"x-fake-fault": f"delay={delay:g}"}}


@app.task(name="bench.plain")
def plain(n: str, delay: float = 0.0) -> int:
    request = _request(delay)
    # the key the fake files the call under, as a guarded call sends its attempt's
    headers = {**request.get("extra_headers", {}), "Idempotency-Key": f"plain:{n}"}
    completion = client().chat.completions.create(**{**request, "extra_headers": headers})
    return int(completion.usage.total_tokens)


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.budgeted",
    budget="bench",
    idempotency_key=lambda n, delay=0.0: f"budgeted:{n}",
    estimate_cost=lambda n, delay=0.0: 0,  # the call reserves its own bound
)
def budgeted(self: BudgetTask, n: str, delay: float = 0.0) -> int:
    completion = guarded().chat.completions.create(**_request(delay))
    return int(completion.usage.total_tokens)


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.cheap",
    budget="bench",
    idempotency_key=lambda n: f"cheap:{n}",
    estimate_cost=lambda n: 10,
)
def cheap(self: BudgetTask, n: str) -> int:
    self.attempt.record_usage(7)
    return 7


#: Issue 45's call (``bench.rated``, benchmarks/rate_fleet.py): a short prompt and an
#: output bound of 48. The ledger takes about 80 tokens a call on admission (its upper
#: estimate of the prompt, about 30, plus the bound; unused input goes back at settlement),
#: the provider counts about 60 (the prompt exactly, plus the bound). At 600 requests
#: and 60,000 tokens a minute every call takes from both windows and the token window
#: runs at about four fifths of its limit, so both are held, but the request window is
#: the one that binds: with 100 tokens a call they would bind together, with more the
#: token window alone.
RATED_OUTPUT_BOUND = 48


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.rated",
    budget="bench",
    idempotency_key=lambda n: f"rated:{n}",
    estimate_cost=lambda n: 0,  # the call reserves its own bound
    # no retry of the user's: a wait for a window, and a 429 (retried after its
    # retry-after by budget-tasks), must not fail the task
    max_retries=0,
)
def rated(self: BudgetTask, n: str) -> int:
    completion = guarded().chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=RATED_OUTPUT_BOUND,
        messages=[{"role": "user", "content": f"count {n}"}],
    )
    return int(completion.usage.total_tokens)
