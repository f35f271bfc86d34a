"""The rate limits' Prometheus metrics: the windows read from a PostgreSQL ledger at
each scrape (limit, what each holds, calls booked ahead), and the calls held back,
counted by the hooks sink as a real task's admission is booked ahead by the ledger."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from budget_tasks import BudgetTask, Ledger
from budget_tasks.errors import RateWindowFull
from budget_tasks.hooks import hooks
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger.records import RateAsk, RateClaim
from budget_tasks.metrics import RATE_LIMITED, RATE_WAIT, registry_for
from budget_tasks.testing import FakeProvider, ManualClock
from budget_tasks.transport import guarded_openai_client


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A counter's or histogram's sample, 0 where it has none yet."""
    return sample(registry, name, **labels) or 0.0


def test_each_window_is_read_from_the_ledger_at_each_scrape(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    scope = f"team-{uuid.uuid4().hex[:6]}"  # counters are the process's: a scope of its own
    rates = pg_ledger.rates
    rates.set_limit("openai", scope, "requests", 3)
    rates.set_limit("openai", scope, "tokens", 60_000)
    assert rates.take("openai", scope, RateAsk(requests=0, tokens=1_200)).granted
    pg_ledger.create_budget("team", 1_000_000)
    claim = RateClaim("openai", (scope,), RateAsk(requests=1))
    for n in range(3):
        pg_ledger.calls.reserve("team", f"k{n}", 100, grant=CallFacts(rate=claim))
    with pytest.raises(RateWindowFull):  # the fourth is booked ahead: the window owes it
        pg_ledger.calls.reserve("team", "k3", 100, grant=CallFacts(rate=claim))

    registry = registry_for(pg_ledger)
    requests = {"provider": "openai", "scope": scope, "kind": "requests"}
    tokens = {"provider": "openai", "scope": scope, "kind": "tokens"}
    assert sample(registry, "budget_tasks_rate_window_limit", **requests) == 3
    assert sample(registry, "budget_tasks_rate_window_limit", **tokens) == 60_000
    assert sample(registry, "budget_tasks_rate_window_available", **requests) == -1
    assert sample(registry, "budget_tasks_rate_window_available", **tokens) == 58_800
    assert sample(registry, "budget_tasks_rate_window_booked", **requests) == 1
    assert sample(registry, "budget_tasks_rate_window_booked", **tokens) == 0
    # a window's provider and scope read 0 held back, by either, before the first
    for by in ("ledger", "provider"):
        held = {"provider": "openai", "scope": scope, "by": by}
        assert sample(registry, "budget_tasks_rate_limited_total", **held) == 0

    # read at the scrape, not kept: a refill shows, a cleared window goes
    clock.advance(seconds=0.3)  # 300 tokens (1,000 a second) and 0.015 of a request
    assert sample(registry, "budget_tasks_rate_window_available", **tokens) == 59_100
    assert sample(registry, "budget_tasks_rate_window_available", **requests) == -0.985
    assert rates.clear_limit("openai", scope, "tokens") == 1
    assert sample(registry, "budget_tasks_rate_window_limit", **tokens) is None
    assert sample(registry, "budget_tasks_rate_window_limit", **requests) == 3


def test_a_call_the_ledger_books_ahead_is_counted_with_its_wait(
    pg_ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """An eager task's call through the guarded SDK client finds its window empty
    (20 requests a minute, all taken): the ledger puts it in line, its turn up to 3 s
    ahead, the task waits in its process (eager mode has no retry to come back by)
    and sends; the sink counts one call held back by the ledger and its wait."""
    app = Celery("rate-metrics", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=pg_url)
    client = guarded_openai_client(base_url=fake.openai_base_url, api_key="sk-test", timeout=30.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"rate-metrics-{uuid.uuid4().hex[:8]}.chat",
        budget="team",
        idempotency_key=lambda n: f"rated-metrics:{n}",
        estimate_cost=lambda n: 0,
    )
    def chat(self: BudgetTask, n: int) -> int:
        answer: Any = client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=16,
            messages=[{"role": "user", "content": f"count {n}"}],
        )
        return int(answer.usage.total_tokens)

    # the task's ledger keeps the real time: so does the one that drains the window
    ledger = Ledger(pg_url)
    ledger.create_budget("team", 10_000_000)
    ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 20)
    assert ledger.rates.take("openai", "gpt-4o-mini", RateAsk(requests=20)).granted
    registry = registry_for(ledger)
    held = {"provider": "openai", "scope": "gpt-4o-mini", "by": "ledger"}
    waited = {"provider": "openai", "by": "ledger"}
    before = {
        "held": count(registry, "budget_tasks_rate_limited_total", **held),
        "count": count(registry, "budget_tasks_rate_wait_seconds_count", **waited),
        "sum": count(registry, "budget_tasks_rate_wait_seconds_sum", **waited),
        "le5": count(registry, "budget_tasks_rate_wait_seconds_bucket", le="5.0", **waited),
        "le05": count(registry, "budget_tasks_rate_wait_seconds_bucket", le="0.5", **waited),
    }
    assert chat.delay(1).get() > 0
    assert [s.status for s in fake.served() if s.method == "POST"] == [200]

    assert count(registry, "budget_tasks_rate_limited_total", **held) == before["held"] + 1
    assert count(registry, "budget_tasks_rate_wait_seconds_count", **waited) == before["count"] + 1
    # one request refills in 3 s at 20 a minute: the wait told was at most that (and
    # more than half a second: the task asked within 2.5 s of the window's draining)
    wait = count(registry, "budget_tasks_rate_wait_seconds_sum", **waited) - before["sum"]
    assert 0.5 < wait <= 3.0
    le5 = count(registry, "budget_tasks_rate_wait_seconds_bucket", le="5.0", **waited)
    le05 = count(registry, "budget_tasks_rate_wait_seconds_bucket", le="0.5", **waited)
    assert (le5 - before["le5"], le05 - before["le05"]) == (1, 0)
    # the booked call took what it was booked for: the window no longer owes it
    window = {"provider": "openai", "scope": "gpt-4o-mini", "kind": "requests"}
    assert sample(registry, "budget_tasks_rate_window_booked", **window) == 0
    ledger.dispose()


def test_a_429_told_to_the_hooks_is_counted_by_the_provider() -> None:
    registry = CollectorRegistry()
    registry.register(RATE_LIMITED)
    registry.register(RATE_WAIT)
    scope = f"claude-{uuid.uuid4().hex[:6]}"
    held = {"provider": "anthropic", "scope": scope, "by": "provider"}
    waited = {"provider": "anthropic", "by": "provider"}
    before = {
        le: count(registry, "budget_tasks_rate_wait_seconds_bucket", le=le, **waited)
        for le in ("0.1", "1.0", "2.5")
    }
    # a 429 without a retry-after (0), then one asking for 2 s
    hooks.rate_limited(provider="anthropic", scope=scope, kind="requests", wait=0.0, by="provider")
    hooks.rate_limited(provider="anthropic", scope=scope, kind="tokens", wait=2.0, by="provider")
    assert count(registry, "budget_tasks_rate_limited_total", **held) == 2
    after = {
        le: count(registry, "budget_tasks_rate_wait_seconds_bucket", le=le, **waited) - was
        for le, was in before.items()
    }
    assert after == {"0.1": 1, "1.0": 1, "2.5": 2}
    # the ledger's count of the same scope is apart
    assert sample(registry, "budget_tasks_rate_limited_total", **{**held, "by": "ledger"}) in (
        None,
        0,
    )


def test_a_workers_metrics_serve_the_drift_gauge_too(pg_ledger: Ledger) -> None:
    """The drift gauge was left out of what a worker serves without
    PROMETHEUS_MULTIPROC_DIR (a solo or threads pool): the hourly check set it unseen."""
    from budget_tasks.metrics import PROVIDER_DRIFT

    PROVIDER_DRIFT.labels("openai", "model", "gpt-4o-mini", "cost").set(18)
    registry = registry_for(pg_ledger)
    drift = dict(provider="openai", by="model", group="gpt-4o-mini", measure="cost")
    assert sample(registry, "budget_tasks_provider_drift", **drift) == 18
    PROVIDER_DRIFT.remove("openai", "model", "gpt-4o-mini", "cost")
