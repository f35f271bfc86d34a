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
import time
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


#: Issue 54's call (``benchmarks/rate_world.py``): a prompt of 400 bytes and an output
#: bound of 200. The ledger asks 616 tokens of the token window (the prompt's strict
#: bound, one token a byte, and the output bound); the provider counts 307 (the prompt
#: as it tokenizes it, and the bound): the 309 the provider did not count go back at
#: settlement. At 300 requests and 30,000 tokens a minute the token window binds.
WIDE_PROMPT_BYTES = 400
WIDE_OUTPUT_BOUND = 200


def wide_request(n: str) -> dict[str, Any]:
    prompt = f"count {n} ".ljust(WIDE_PROMPT_BYTES, ".")
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": WIDE_OUTPUT_BOUND,
        "messages": [{"role": "user", "content": prompt}],
    }


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.rated_wide",
    budget=lambda n, tenant="bench": tenant,
    idempotency_key=lambda n, tenant="bench": f"wide:{n}",
    estimate_cost=lambda n, tenant="bench": 0,
    max_retries=0,
)
def rated_wide(self: BudgetTask, n: str, tenant: str = "bench") -> int:
    completion = guarded().chat.completions.create(**wide_request(n))
    return int(completion.usage.total_tokens)


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.rated_celery",
    budget="bench",
    idempotency_key=lambda n: f"celery:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
    # Celery's own rate limit, per worker (set by the benchmark for each burst)
    rate_limit=os.environ.get("BENCH_CELERY_RATE_LIMIT") or None,
)
def rated_celery(self: BudgetTask, n: str) -> int:
    completion = guarded().chat.completions.create(**wide_request(n))
    return int(completion.usage.total_tokens)


@cache
def _limiter() -> Any:
    from limits import RateLimitItemPerMinute, storage, strategies

    url = os.environ["BENCH_LIMITS_STORAGE"]
    limiter = strategies.MovingWindowRateLimiter(storage.storage_from_string(url))
    requests = RateLimitItemPerMinute(int(os.environ["BENCH_LIMITS_REQUESTS"]))
    tokens = RateLimitItemPerMinute(int(os.environ["BENCH_LIMITS_TOKENS"]))
    return limiter, requests, tokens


def _wait_for_limits(cost: int) -> None:
    """The `limits` library's way: hit a moving window of requests and one of tokens
    (the request's strict bound: what it may use) on Redis, shared by every process;
    sleep until the window would hold it, and try again."""
    limiter, requests, tokens = _limiter()
    while True:
        if limiter.test(requests, "bench") and limiter.hit(tokens, "bench", cost=cost):
            limiter.hit(requests, "bench")
            return
        stats = limiter.get_window_stats(tokens, "bench")
        time.sleep(max(0.05, min(1.0, stats.reset_time - time.time())))


@app.task(
    base=BudgetTask,
    bind=True,
    name="bench.rated_limits",
    budget="bench",
    idempotency_key=lambda n: f"limits:{n}",
    estimate_cost=lambda n: 0,
    max_retries=0,
)
def rated_limits(self: BudgetTask, n: str) -> int:
    request = wide_request(n)
    bound = WIDE_PROMPT_BYTES + 16 + WIDE_OUTPUT_BOUND  # the prompt's bytes, framing, output
    _wait_for_limits(bound)
    completion = guarded().chat.completions.create(**request)
    return int(completion.usage.total_tokens)


def _count_admissions(url: str) -> None:
    """Count, in Redis at ``url`` (key ``bench:admissions``), every admission this
    worker asks of its ledger: a run's, a labelled call's, a reservation's, granted,
    refused or put in a rate window's line (rolled back, they leave no row to count);
    the calls that had to wait their turn (set ``bench:waited``), and when each joined
    its line (hash ``bench:joined``)."""
    import redis

    from budget_tasks.ledger.calls import CallLedger

    counter = redis.Redis.from_url(url)

    from budget_tasks.errors import RateWindowFull

    def counted(method: Any) -> Any:
        def admission(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter.incr("bench:admissions")
            try:
                return method(self, *args, **kwargs)
            except RateWindowFull as full:  # the call joined a window's line (or is in it)
                counter.sadd("bench:waited", str(full.key))
                counter.hsetnx("bench:joined", str(full.key), repr(time.time()))
                raise

        return admission

    for name in ("admit", "admit_call", "reserve"):
        setattr(CallLedger, name, counted(getattr(CallLedger, name)))


if os.environ.get("BENCH_COUNT_ADMISSIONS"):
    _count_admissions(os.environ["BENCH_COUNT_ADMISSIONS"])
