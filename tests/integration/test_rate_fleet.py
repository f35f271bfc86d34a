"""Rate limits held across a fleet of real ``celery worker`` processes: the official
SDK through the guarded transport to the fake provider, whose own limits answer 429
as the vendor's do; the ledger's windows, taken with each call's money, keep the
fleet under them, and a wait brings the message back without spending a retry."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from celery import Celery

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider

from ..workers import Worker


def signals_of(path: Path, name: str) -> list[dict[str, str]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if line["signal"] == name]


def test_a_fleet_under_a_rate_limit_sends_nothing_past_it_and_loses_no_task(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """Forty tasks on four worker processes against 30 requests a minute, held by the
    provider and by the ledger alike: the first 30 are sent at once, the rest as the
    window refills (one every 2 s), waited for in the process for a short gap and by
    the message coming back for a longer one, although each task allows no retry.
    The provider refuses none."""
    received = tmp_path / "signals.jsonl"
    fake.set_limits("openai", "gpt-4o-mini", requests=30)
    pg_ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 30)
    start_worker(concurrency=4, BUDGET_TASKS_TEST_SIGNALS=str(received))
    sent = [client.send_task("tests.rated_chat", args=[n]) for n in range(40)]
    used = [result.get(timeout=180) for result in sent]
    assert len(used) == 40 and min(used) > 0
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert fake.state()["rate_limited"] == 0
    assert len(posts) == 40 and {s.status for s in posts} == {200}
    waits = [float(line["wait"]) for line in signals_of(received, "rate_limited")]
    # ten calls waited; some longer than the 5 s a process waits: their messages came
    # back (max_retries=0, and none failed)
    assert len(waits) >= 10 and max(waits) > 5
    assert {line["by"] for line in signals_of(received, "rate_limited")} == {"ledger"}
    attempts = [a for a in pg_ledger.attempts() if a.label and a.key.startswith("rated:")]
    assert len(attempts) == 40 and {a.state for a in attempts} == {"settled"}
    assert pg_ledger.balance("default").spent == sum(s.billed for s in posts)


def test_a_limit_set_too_high_is_lowered_to_the_one_the_provider_states(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
) -> None:
    """The ledger is told 120 requests a minute for the model; the provider allows 30
    and says so in every answer's headers: the model's window is lowered to 30 by the
    first settlements, and the fleet is refused no more than the calls already out."""
    fake.set_limits("openai", "gpt-4o-mini", requests=30)
    pg_ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 120)
    start_worker(concurrency=4)
    sent = [client.send_task("tests.rated_chat", args=[n]) for n in range(34)]
    used = [result.get(timeout=180) for result in sent]
    assert len(used) == 34 and min(used) > 0
    [window] = pg_ledger.rates.windows()
    assert window.per_minute == 30
    posts = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    refused = [s for s in posts if s.status == 429]
    # at most what four processes had out before the first answers came back
    assert len(refused) <= 4
    assert sum(s.status == 200 for s in posts) == 34


def test_a_quota_shared_with_other_software_ends_its_429s(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """Another program spends all of the provider's 30 requests a minute just before
    the fleet's burst, past the ledger (the next is the provider's in 2 s). The
    answers say what remains, and a 429 how long to wait: the window narrows to them,
    so the refusals stop while the burst is still going, and every task ends well
    (each refused call released and sent again as a new attempt)."""
    import openai

    received = tmp_path / "signals.jsonl"
    fake.set_limits("openai", "gpt-4o-mini", requests=30)
    pg_ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", 30)
    other = openai.OpenAI(base_url=fake.openai_base_url, api_key="sk-other", max_retries=0)
    start_worker(concurrency=4, BUDGET_TASKS_TEST_SIGNALS=str(received))
    for _ in range(30):  # just before the burst, so the provider has not refilled it
        other.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=8,
            messages=[{"role": "user", "content": "elsewhere"}],
        )
    sent = [client.send_task("tests.rated_chat", args=[n]) for n in range(12)]
    used = [result.get(timeout=180) for result in sent]
    assert len(used) == 12 and min(used) > 0
    ours = [
        s for s in fake.served_as(pg_ledger) if s.idempotency_key and "rated:" in s.idempotency_key
    ]
    refused = [i for i, s in enumerate(ours) if s.status == 429]
    assert refused, "the shared quota was never felt: the test shows nothing"
    # the refusals end: none in the second half of what was sent
    assert max(refused) < len(ours) // 2
    assert sum(s.status == 200 for s in ours) == 12
    by_provider = [
        line for line in signals_of(received, "rate_limited") if line["by"] == "provider"
    ]
    assert len(by_provider) == len(refused)
    # the calls' own attempts (a run that comes back has a main attempt of 0 too)
    attempts = [a for a in pg_ledger.attempts() if a.label and a.key.startswith("rated:")]
    assert sorted(a.state for a in attempts) == ["released"] * len(refused) + ["settled"] * 12


def test_anthropics_output_window_gets_back_what_a_message_did_not_write(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """Anthropic counts ``max_tokens`` of output when a message arrives and gives back
    what it did not write; the ledger's window does the same at settlement. Thirty
    messages of max 100 that write 10 each fit in 600 output tokens a minute one after
    another: none waits, none is refused, and the window holds what they did not use."""
    received = tmp_path / "signals.jsonl"
    fake.set_limits("anthropic", "claude-haiku-4-5", output_tokens=600)
    pg_ledger.rates.set_limit("anthropic", "claude-haiku-4-5", "output_tokens", 600)
    start_worker(concurrency=1, BUDGET_TASKS_TEST_SIGNALS=str(received))
    for n in range(30):  # one after another: each settles before the next is admitted
        assert client.send_task("tests.rated_claude", args=[n]).get(timeout=60) == 10
    assert fake.state()["rate_limited"] == 0
    assert signals_of(received, "rate_limited") == []
    [window] = pg_ledger.rates.windows()
    # 30 messages wrote 300 tokens within a few seconds: about 300 remain (plus a
    # refill of 10 a second since the first, never past 600)
    assert 300 <= window.available <= 600 and window.per_minute == 600
    attempts = [a for a in pg_ledger.attempts() if a.label]
    assert len(attempts) == 30 and {a.output_tokens for a in attempts} == {10}


def test_a_worker_sets_the_apps_rate_limits_in_the_ledger_as_it_starts(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """``budget_rate_limits`` (here from BUDGET_TASKS_RATE_LIMITS) is set in the ledger
    by the worker as it starts, and its calls take from it."""
    limits = '{"openai": {"gpt-4o-mini": {"requests": 7, "tokens": 9000}}}'
    start_worker(BUDGET_TASKS_RATE_LIMITS=limits)
    shown = {(w.scope, w.kind): w.per_minute for w in pg_ledger.rates.windows()}
    assert shown == {("gpt-4o-mini", "requests"): 7, ("gpt-4o-mini", "tokens"): 9000}
    assert client.send_task("tests.rated_chat", args=[1]).get(timeout=60) > 0
    requests = {w.kind: w for w in pg_ledger.rates.windows()}["requests"]
    assert 6 <= requests.available < 7  # one taken, a little refilled since
