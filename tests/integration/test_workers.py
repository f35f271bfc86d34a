"""BudgetTask under real Celery delivery: a Redis broker, a PostgreSQL ledger, real
``celery worker`` processes, and the official openai SDK against the fake provider."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import BudgetExceeded, BudgetFrozen, Ledger, OutcomeUnknown
from budget_tasks.beat import reconcile_unknown
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..workers import Worker

SUMMARIZE = "tests.summarize"
RESEARCH = "tests.research"


def operation_counts(ledger: Ledger, key: str) -> tuple[int, int]:
    with ledger.engine.connect() as conn:
        deliveries, replays = conn.execute(
            text("SELECT deliveries, replays FROM operations WHERE key = :key"), {"key": key}
        ).one()
    return int(deliveries), int(replays)


def requests_for(fake: FakeProvider, prefix: str, ledger: Ledger) -> list[Any]:
    """The requests sent under ``ledger``'s attempt keys that start with ``prefix``."""
    return [s for s in fake.served_as(ledger) if (s.idempotency_key or "").startswith(prefix)]


def test_sigkill_mid_call_then_redelivery_keeps_the_hold_and_never_resends(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    worker = start_worker()
    fake.plan("delay=4", path="/chat/completions")
    result = client.send_task(SUMMARIZE, args=["doc-kill", "Board minutes."])
    wait_for(lambda: requests_for(fake, "summarize:doc-kill", pg_ledger), what="the provider call")
    [child] = worker.children()
    os.kill(child, signal.SIGKILL)  # mid-request: the provider is still working on it
    with pytest.raises(Exception, match="outcome of attempt 'summarize:doc-kill#1' is unknown"):
        result.get(timeout=60)
    assert len(requests_for(fake, "summarize:doc-kill", pg_ledger)) == 1
    [attempt] = pg_ledger.attempts()
    assert attempt.state == "unknown"
    bal = pg_ledger.balance("default")
    assert (bal.held, bal.spent) == (attempt.amount, 0)
    assert pg_ledger.audit() == []


def test_duplicate_deliveries_replay_one_provider_call(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker(concurrency=2)
    args = ["doc-dup", "Same document, sent twice."]
    first = client.send_task(SUMMARIZE, args=args, task_id="dup-1")
    value = first.get(timeout=60)
    # the same message again (same task id), and another message for the same document
    again = client.send_task(SUMMARIZE, args=args, task_id="dup-1")
    other = client.send_task(SUMMARIZE, args=args, task_id="dup-2")
    assert again.get(timeout=60) == value
    assert other.get(timeout=60) == value
    assert len(requests_for(fake, "summarize:doc-dup", pg_ledger)) == 1
    assert pg_ledger.balance("default").spent == value["cost"]
    assert pg_ledger.audit() == []


def test_two_task_ids_same_business_key_at_once_make_one_call(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker("a")
    start_worker("b")
    fake.plan("delay=2", path="/chat/completions")
    args = ["doc-twin", "Two clicks on the same button."]
    results = [client.send_task(SUMMARIZE, args=args) for _ in range(2)]
    values = [r.get(timeout=90) for r in results]
    assert values[0] == values[1]
    assert len(requests_for(fake, "summarize:doc-twin", pg_ledger)) == 1
    assert len(pg_ledger.attempts()) == 1


def test_visibility_timeout_redelivery_while_running_replays(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    settings = {"BUDGET_TASKS_VISIBILITY_TIMEOUT": "2", "BUDGET_TASKS_RESTORE_INTERVAL": "1"}
    start_worker("a", **settings)
    start_worker("b", **settings)
    fake.plan("delay=7", path="/chat/completions")
    result = client.send_task(SUMMARIZE, args=["doc-vis", "A long job."])
    value = result.get(timeout=120)
    assert len(requests_for(fake, "summarize:doc-vis", pg_ledger)) == 1
    assert value["cost"] == fake.billed_for("summarize:doc-vis#1", pg_ledger)
    # The broker handed the running message out again; that delivery found the lease
    # live, came back later and replayed the stored result.
    counts = wait_for(
        lambda: (c := operation_counts(pg_ledger, "summarize:doc-vis"))[1] >= 1 and c,
        timeout=60,
        what="the replay of the redelivered message",
    )
    deliveries, _ = counts
    assert deliveries >= 2  # the broker did hand the running message out again
    assert len(pg_ledger.attempts()) == 1


def test_two_hundred_tasks_against_a_cap_for_fifty(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    from budget_tasks.providers import estimates

    from .worker_tasks import fixed_request

    each = estimates.openai_chat(fixed_request(0)).amount
    pg_ledger.create_budget("capped", 50 * each)
    workers = [
        start_worker("a", concurrency=2, BUDGET_TASKS_BUDGET="capped"),
        start_worker("b", concurrency=2, BUDGET_TASKS_BUDGET="capped"),
    ]
    results = [client.send_task("tests.fixed_cost", args=[n]) for n in range(200)]
    outcomes = []
    for r in results:
        try:
            r.get(timeout=180)
            outcomes.append("ok")
        except Exception as exc:  # the task's own error, re-raised by Celery
            outcomes.append(type(exc).__name__)
    assert outcomes.count("ok") == 50
    assert outcomes.count("BudgetExceeded") == 150
    assert len(requests_for(fake, "fixed:", pg_ledger)) == 50
    bal = pg_ledger.balance("capped")
    assert bal.spent + bal.held == 50 * each == bal.cap
    assert pg_ledger.audit() == []
    # a denial is normal operation: one INFO line each in the worker log, no traceback
    log = "".join(w.log_path.read_text() for w in workers)
    denials = [line for line in log.splitlines() if "BudgetExceeded" in line]
    assert len(denials) == 150, denials[:5]
    assert all("INFO/" in line and "raised expected" in line for line in denials), denials[:5]
    assert "Traceback" not in log


def test_poison_message_stops_at_max_deliveries(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker()
    result = client.send_task("tests.crasher", args=[1])
    with pytest.raises(Exception, match="poison message"):
        result.get(timeout=120)
    with pg_ledger.engine.connect() as conn:
        status, runs = conn.execute(
            text("SELECT status, runs FROM operations WHERE key = 'crash:1'")
        ).one()
    assert (status, runs) == ("failed", 3)
    assert pg_ledger.attempts() == []
    assert fake.served() == []


def test_agent_task_spends_per_step_and_notifies_once(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker()
    value = client.send_task(RESEARCH, args=["tides", 3]).get(timeout=60)
    assert len(value["notes"]) == 3
    assert value["notified"] == "notified: tides after 3 steps"
    again = client.send_task(RESEARCH, args=["tides", 3]).get(timeout=60)
    assert again == value
    assert len(requests_for(fake, "research:tides:3:step:", pg_ledger)) == 3
    steps = [a for a in pg_ledger.attempts() if a.label == "step"]
    assert sum(a.actual or 0 for a in steps) == fake.state()["billed_total"]
    assert pg_ledger.audit() == []


def test_beat_jobs_through_a_real_worker_flag_then_reconcile_a_timeout(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker(
        BUDGET_TASKS_PROVIDER_TIMEOUT="1",
        BUDGET_TASKS_STALE_AFTER="0",
        BUDGET_TASKS_RECONCILE_MARGIN="0",
    )
    fake.plan("hang=2", path="/chat/completions")
    with pytest.raises(Exception, match=r"timed out|Timeout"):
        client.send_task(SUMMARIZE, args=["doc-late", "Slow."]).get(timeout=60)
    [attempt] = pg_ledger.attempts()
    assert attempt.state == "unknown"
    assert client.send_task("budget_tasks.flag_stale_holds").get(timeout=60) == 1
    assert client.send_task("budget_tasks.flag_stale_holds").get(timeout=60) == 0
    counts = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
    assert counts["found"] == 1
    settled = pg_ledger.attempt(attempt.key)
    assert (settled.state, settled.actual) == ("settled", fake.billed_for(attempt.key, pg_ledger))
    # the next delivery of that document replays the reconciled answer
    value = client.send_task(SUMMARIZE, args=["doc-late", "Slow."]).get(timeout=60)
    assert value == pg_ledger.operation("summarize:doc-late").result
    assert len(requests_for(fake, "summarize:doc-late", pg_ledger)) == 1
    assert client.send_task("budget_tasks.renew_periods").get(timeout=60) == 0
    assert pg_ledger.audit() == []


def test_whole_worker_killed_mid_call_then_a_new_worker_never_resends(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    settings = {"BUDGET_TASKS_VISIBILITY_TIMEOUT": "3", "BUDGET_TASKS_RESTORE_INTERVAL": "1"}
    first = start_worker("first", **settings)
    fake.plan("delay=4", path="/chat/completions")
    result = client.send_task(SUMMARIZE, args=["doc-crash", "Power cut."])
    wait_for(lambda: requests_for(fake, "summarize:doc-crash", pg_ledger), what="the provider call")
    os.killpg(first.proc.pid, signal.SIGKILL)  # the machine dies: no ack, no requeue
    first.proc.wait(timeout=10)
    start_worker("second", **settings)  # Redis hands the unacked message out again
    with pytest.raises(Exception, match="outcome of attempt 'summarize:doc-crash#1' is unknown"):
        result.get(timeout=90)
    assert len(requests_for(fake, "summarize:doc-crash", pg_ledger)) == 1
    [attempt] = pg_ledger.attempts()
    assert attempt.state == "unknown"
    assert pg_ledger.balance("default").held == attempt.amount
    assert pg_ledger.audit() == []


def test_metrics_scraped_from_a_worker_match_the_ledger(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    tmp_path: Path,
) -> None:
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from budget_tasks.providers import estimates

    from .worker_tasks import fixed_request

    each = estimates.openai_chat(fixed_request(0)).amount
    pg_ledger.create_budget("metered", 6 * each)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "prom").mkdir()
    start_worker(
        "metered",
        concurrency=2,
        BUDGET_TASKS_BUDGET="metered",
        BUDGET_TASKS_METRICS_PORT=str(port),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"),
    )
    outcomes = []
    for n in [*range(10), 0, 1]:  # ten tasks for a cap of six, then two redeliveries
        try:
            client.send_task("tests.fixed_cost", args=[n]).get(timeout=60)
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes.count("BudgetExceeded") == 4

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        scraped = response.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    attempts = pg_ledger.attempts()
    # pg_ledger keeps a test clock; the worker and the metrics read the real one
    real = Ledger(pg_url)
    bal = real.balance("metered")
    real.dispose()
    assert value("budget_tasks_admissions_total", budget="metered") == len(attempts) == 6
    assert value("budget_tasks_denials_total", budget="metered", reason="exceeded") == 4
    with pg_ledger.engine.connect() as conn:
        replays = conn.execute(text("SELECT sum(replays) FROM operations")).scalar()
    assert value("budget_tasks_replays_total", task="tests.fixed_cost") == replays == 2
    assert value("budget_tasks_actual_to_estimate_ratio_count", budget="metered") == 6
    assert value("budget_tasks_actual_to_estimate_ratio_sum", budget="metered") == 6.0
    for name in ("cap", "spent", "held", "available"):
        assert value(f"budget_tasks_{name}", budget="metered") == getattr(bal, name), name
    assert value("budget_tasks_usable", budget="metered") == max(bal.available, 0)
    # the counters no event touched yet read 0 (a healthy install's panels show 0, not
    # "no data"): made for the budget at the first scrape, and for every outcome
    assert value("budget_tasks_overruns_total", budget="metered") == 0
    assert value("budget_tasks_denials_total", budget="metered", reason="frozen") == 0
    assert value("budget_tasks_untrusted_answers_total", budget="metered", by="task") == 0
    assert value("budget_tasks_stale_holds_total", budget="metered") == 0
    assert value("budget_tasks_reconciliations_total", outcome="unknowable") == 0
    assert bal.spent == 6 * each
    assert len(requests_for(fake, "fixed:", pg_ledger)) == 6


def test_a_429_after_a_billed_call_settles_it_and_is_not_retried(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """In a real worker a 429 normally retries the run (a new attempt); after a billed
    call that would send the billed call again: the cost is settled, no retry."""
    start_worker()
    with pytest.raises(Exception, match="429"):
        client.send_task("tests.billed_then_429", args=[1]).get(timeout=60)
    time.sleep(1.5)  # a retry would come after rate_limit_countdown (0.2 s)
    sent = requests_for(fake, "b429:1", pg_ledger)
    assert [s.status for s in sent] == [200, 429]
    [attempt] = pg_ledger.attempts()
    assert (attempt.state, attempt.actual) == ("settled", fake.billed_for("b429:1#1", pg_ledger))
    assert attempt.actual > 0
    assert pg_ledger.operation("b429:1").status == "failed"
    assert pg_ledger.audit() == []


def test_a_task_that_retries_itself_after_a_429_releases_the_hold_and_runs_again(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """run leaves with Celery's Retry, raised while it handled the 429: the 429 says the
    call was not billed, so its hold is released (it was kept as unknown, and the retry
    met OutcomeUnknown), and the retry is a new attempt."""
    start_worker()
    assert client.send_task("tests.retries_itself", args=[1, "status=429"]).get(timeout=60) == 1
    sent = [s.status for s in requests_for(fake, "self-retry:1", pg_ledger)]
    assert sent == [429, 200]
    states = {a.key: (a.state, a.actual) for a in pg_ledger.attempts()}
    assert states["self-retry:1#1"] == ("released", 0)
    assert states["self-retry:1#2"][0] == "settled"
    assert pg_ledger.balance("default").held == 0 and pg_ledger.audit() == []


def test_the_librarys_own_retry_never_lifts_the_users_max_retries(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    """A 429 makes BudgetTask retry the message itself, without a limit; Celery keeps
    that limit on the shared task object, and autoretry_for used to read it for every
    later error: a request the provider refuses (400) was sent again without end,
    instead of 1 + max_retries times."""
    start_worker()
    fake.plan("status=429", count=1, path="/chat/completions")
    fake.plan("status=400", count=12, path="/chat/completions")
    with pytest.raises(Exception, match="400"):
        client.send_task("tests.autoretry_capped", args=[1]).get(timeout=60)
    time.sleep(1.0)  # a retry past the cap would come within this
    sent = [s.status for s in requests_for(fake, "capped:1", pg_ledger)]
    # the library's own retry after the 429, then the user's: 1 + max_retries=2 sends
    assert sent == [429, 400, 400, 400]
    assert pg_ledger.balance("default").held == 0


def test_a_step_rate_limited_is_retried_by_the_worker_as_a_new_attempt_of_that_step(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker()
    value = client.send_task(
        "tests.agent_steps", args=["tide"], kwargs={"faults": {"two": "status=429"}}
    ).get(timeout=60)
    assert value == ["one done", "two done"]
    sent = [(s.idempotency_key, s.status) for s in requests_for(fake, "steps:tide", pg_ledger)]
    assert sent == [
        ("steps:tide:one:1", 200),
        ("steps:tide:two:1", 429),
        ("steps:tide:two:1~2", 200),  # step one replayed from storage: not sent again
    ]
    states = {a.key: a.state for a in pg_ledger.attempts() if a.label}
    assert states == {
        "steps:tide:one:1": "settled",
        "steps:tide:two:1": "released",
        "steps:tide:two:1~2": "settled",
    }
    assert pg_ledger.holds() == [] and pg_ledger.audit() == []
    assert pg_ledger.balance("default").spent == fake.state()["billed_total"]


def test_retry_when_budget_frees_works_for_a_step(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    from .worker_tasks import ONE_CALL

    start_worker()
    room = pg_ledger.balance("default").available
    pg_ledger.calls.reserve("default", "blocker", room - ONE_CALL)  # room for one step only
    result = client.send_task("tests.agent_steps", args=["budget"])
    wait_for(
        lambda: "steps:budget#1" in {a.key for a in pg_ledger.attempts(states=["released"])},
        what="step two denied, the run's hold released",
    )
    assert pg_ledger.operation("steps:budget").status in ("pending", "running")
    assert pg_ledger.attempts(states=["unknown"]) == []  # no hold stranded as unknown
    pg_ledger.calls.release("blocker", "the budget frees up")
    assert result.get(timeout=60) == ["one done", "two done"]
    assert [s.idempotency_key for s in requests_for(fake, "steps:budget", pg_ledger)] == [
        "steps:budget:one:1",
        "steps:budget:two:1",
    ]
    assert pg_ledger.holds() == [] and pg_ledger.audit() == []


def reconcile_found(fake: FakeProvider, ledger: Ledger) -> None:
    """Beat's reconciliation, once: the call a kill left sending is found at the
    provider and settled with its answer."""
    lookups = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    counts = reconcile_unknown(
        ledger, lambda kind: lookups, margin=timedelta(0), requeue=lambda *_: None
    )
    assert counts["found"] == 1, counts


def guarded_posts(fake: FakeProvider, topic: str, ledger: Ledger) -> list[str]:
    return [
        s.idempotency_key or ""
        for s in fake.served_as(ledger)
        if s.method == "POST" and (s.idempotency_key or "").startswith(f"guarded:{topic}:")
    ]


def test_an_sdk_agent_killed_after_three_calls_replays_them_and_sends_the_rest_once(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """Five calls through the SDK's own code and the guarded transport; SIGKILL after
    call three, before the run's next commit, which call three's settlement waits for:
    the redelivery finds call three sending and sends nothing (its outcome is unknown).
    Beat finds it at the provider; the next delivery replays calls one to three from
    the ledger (no request) and sends four and five once. Each call is charged once,
    at the fake's bill."""
    start_worker()
    marker = tmp_path / "died-once"
    with pytest.raises(OutcomeUnknown):
        client.send_task("tests.guarded_agent", args=["tides", str(marker)]).get(timeout=90)
    assert marker.exists()
    assert guarded_posts(fake, "tides", pg_ledger) == [
        f"guarded:tides:openai.chat:{n}" for n in range(1, 4)
    ]
    reconcile_found(fake, pg_ledger)
    value = client.send_task("tests.guarded_agent", args=["tides", str(marker)]).get(timeout=90)
    assert len(value) == 5
    keys = guarded_posts(fake, "tides", pg_ledger)
    assert keys == [f"guarded:tides:openai.chat:{n}" for n in range(1, 6)]  # each once
    steps = {a.key: a for a in pg_ledger.attempts() if a.key.startswith("guarded:tides:")}
    billed = {s.idempotency_key: s.billed for s in fake.served_as(pg_ledger) if s.method == "POST"}
    assert {k: (a.state, a.actual) for k, a in steps.items()} == {
        k: ("settled", billed[k]) for k in keys
    }
    assert pg_ledger.balance("default").held == 0
    assert pg_ledger.audit() == []


def test_a_request_the_task_resends_after_a_429_stays_at_its_position_through_a_kill(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """The task's own code sends its request again after a 429: the resend is the next
    attempt of the same position, not the next position. SIGKILL once answered: the
    redelivery meets that position open and sends nothing; beat finds the answer, and
    the next delivery replays it. (The resend used to take position 2; the redelivery
    found position 1 released and sent the request a third time: one question
    answered and billed twice.)"""
    start_worker()
    fake.plan("status=429", count=1, path="/chat/completions")
    marker = tmp_path / "died-once"
    with pytest.raises(OutcomeUnknown):
        client.send_task("tests.retrying_agent", args=["surf", str(marker)]).get(timeout=90)
    assert marker.exists()
    reconcile_found(fake, pg_ledger)
    value = client.send_task("tests.retrying_agent", args=["surf", str(marker)]).get(timeout=90)
    assert value
    sent = [
        (s.idempotency_key, s.status)
        for s in fake.served_as(pg_ledger)
        if s.method == "POST" and (s.idempotency_key or "").startswith("retrying:surf:")
    ]
    assert sent == [("retrying:surf:openai.chat:1", 429), ("retrying:surf:openai.chat:1~2", 200)]
    states = {a.key: (a.state, a.actual) for a in pg_ledger.attempts() if a.label}
    billed = fake.billed_for("retrying:surf:openai.chat:1~2", pg_ledger)
    assert states == {
        "retrying:surf:openai.chat:1": ("released", 0),
        "retrying:surf:openai.chat:1~2": ("settled", billed),
    }
    assert pg_ledger.balance("default").held == 0 and pg_ledger.audit() == []


def test_a_redelivery_that_asks_something_else_at_a_replayed_position_is_a_conflict(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    start_worker()
    marker = tmp_path / "died-once"
    with pytest.raises(OutcomeUnknown):  # killed after call three (see above)
        client.send_task("tests.guarded_agent", args=["ebb", str(marker), 2]).get(timeout=90)
    reconcile_found(fake, pg_ledger)
    result = client.send_task("tests.guarded_agent", args=["ebb", str(marker), 2])
    with pytest.raises(Exception, match=r"CallConflict|another request"):
        result.get(timeout=90)
    assert guarded_posts(fake, "ebb", pg_ledger) == [
        f"guarded:ebb:openai.chat:{n}" for n in range(1, 4)
    ]
    assert pg_ledger.operation("guarded:ebb").status == "failed"
    assert pg_ledger.balance("default").held == 0


def test_the_sdks_own_calls_through_the_guarded_transport_in_a_real_worker(
    client: Celery, start_worker: Callable[..., Worker], fake: FakeProvider, pg_ledger: Ledger
) -> None:
    start_worker()
    value = client.send_task("tests.sdk_tour").get(timeout=90)
    assert value == {
        "tool_round_trip": ["lookup", "stop"],
        "n": 3,
        "structured": True,
        "stream_usage_False": 0,
        "stream_usage_True": 1,
        "anthropic": ["tool_use", "tool_use"],
    }
    sent = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
    assert len(sent) == 7
    charged = {a.key: (a.state, a.actual) for a in pg_ledger.attempts() if "#" not in a.key}
    assert charged == {s.idempotency_key: ("settled", s.billed) for s in sent}
    assert pg_ledger.balance("default").spent == sum(s.billed for s in sent)
    assert pg_ledger.audit() == []


OWN_APP = """
from pathlib import Path

from celery import Celery

import budget_tasks

here = Path(__file__).parent
app = Celery("own", broker=f"sqla+sqlite:///{here}/broker.db")
budget_tasks.configure(app)
"""


def test_a_users_own_app_serves_metrics_from_the_environment(tmp_path: Path, pg_url: str) -> None:
    """Not the reference app: a module of the user's with only configure(app). Its
    worker reads BUDGET_TASKS_METRICS_PORT and the ledger URL from the environment and
    serves the ledger's gauges."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    ledger = Ledger(pg_url)
    ledger.create_budget("own-budget", 12_345)
    ledger.dispose()
    (tmp_path / "own.py").write_text(OWN_APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "BUDGET_TASKS_METRICS_PORT": str(port),
        "BUDGET_TASKS_LEDGER_URL": pg_url,
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "own", "worker", "--pool", "solo", "-l", "INFO"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    scraped = ""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and worker.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    scraped = r.read().decode()
                break
            except OSError:
                time.sleep(0.5)
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
    assert scraped, err.decode()[-2000:]
    assert 'budget_tasks_cap{budget="own-budget"} 12345.0' in scraped


@pytest.mark.parametrize("shape", ["escrowed tenant", "sliced budget"])
def test_real_workers_on_a_hot_budget_stop_at_exactly_its_cap(
    shape: str,
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
) -> None:
    """Escrow and slices through real workers (prefork, two of two children each): the
    deliveries admit on a tenant's grants or a budget's slices, and the cap is exact."""
    from budget_tasks.providers import estimates

    from .worker_tasks import fixed_request

    each = estimates.openai_chat(fixed_request(0)).amount
    if shape == "escrowed tenant":
        pg_ledger.create_budget("org", 20 * each)
        pg_ledger.create_budget("hot", 100 * each, parent="org", escrow=True)
        limit = "org"
    else:
        pg_ledger.create_budget("hot", 20 * each, slices=4)
        limit = "hot"
    for name in ("a", "b"):
        start_worker(name, concurrency=2, BUDGET_TASKS_BUDGET="hot")
    results = [client.send_task("tests.fixed_cost", args=[n]) for n in range(60)]
    refused = []
    for r in results:
        try:
            r.get(timeout=180)
        except BudgetExceeded as exc:
            refused.append(exc.budget)
    assert (len(results) - len(refused), set(refused)) == (20, {limit})
    assert len(requests_for(fake, "fixed:", pg_ledger)) == 20
    hot, capped = pg_ledger.balance("hot"), pg_ledger.balance(limit)
    assert hot.spent + hot.held == 20 * each
    assert capped.available == 0
    if shape == "escrowed tenant":
        # org's cap, all granted and used: org shows its tenant's spending, none unused
        assert hot.drawn == 20 * each
        assert (capped.spent + capped.held, capped.granted) == (20 * each, 0)
    assert pg_ledger.audit() == []


def test_retention_through_a_real_worker_archives_a_month_past_the_window(
    client: Celery,
    start_worker: Callable[..., Worker],
    pg_url: str,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    from datetime import UTC, datetime

    from budget_tasks.testing import ManualClock

    # an empty month long past any window, and no setting yet: the job keeps all
    past = Ledger(pg_url, clock=ManualClock(datetime(2025, 3, 5, tzinfo=UTC)))
    past.upkeep.make_partitions(ahead=0)
    past.dispose()
    keeper = start_worker("keeps")
    assert "skipped" in client.send_task("budget_tasks.retain_ledger").get(timeout=60)
    keeper.stop()
    archive = tmp_path / "archive"
    archive.mkdir()
    start_worker(
        "retains",
        BUDGET_TASKS_LEDGER_RETENTION_DAYS="30",
        BUDGET_TASKS_ARCHIVE_DIR=str(archive),
    )
    done = client.send_task("budget_tasks.retain_ledger").get(timeout=60)
    assert "journal_y2025m03" in done["archived"]
    manifest = (archive / "journal_y2025m03" / "MANIFEST.json").read_text()
    assert '"journal_rows": 0' in manifest
    assert "journal_y2025m03" in {
        p.name for p in pg_ledger.upkeep.retention(None) if p.state == "archived"
    }


def test_a_worker_sends_celery_signals_for_denied_replayed_and_unknown(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    tmp_path: Path,
) -> None:
    """Receivers connected in the worker's own modules, as a user's alert would be."""
    import json

    from budget_tasks.providers import estimates

    from .worker_tasks import fixed_request

    received = tmp_path / "signals.jsonl"
    each = estimates.openai_chat(fixed_request(2)).amount
    pg_ledger.create_budget("signalled", 10_000_000)
    start_worker(BUDGET_TASKS_BUDGET="signalled", BUDGET_TASKS_TEST_SIGNALS=str(received))
    assert client.send_task("tests.fixed_cost", args=[1]).get(timeout=60)
    assert client.send_task("tests.fixed_cost", args=[1]).get(timeout=60)  # a replay
    with pytest.raises(Exception, match="fake 500"):  # a 5xx: the call may have billed
        client.send_task(
            "tests.agent_steps", args=["signals"], kwargs={"faults": {"one": "status=500"}}
        ).get(timeout=60)
    pg_ledger.freeze("signalled")
    with pytest.raises(BudgetFrozen):
        client.send_task("tests.fixed_cost", args=[2]).get(timeout=60)
    lines = [json.loads(line) for line in received.read_text().splitlines()]
    by_signal = {line["signal"]: line for line in lines}
    assert sorted(line["signal"] for line in lines) == [
        "budget_denied",
        "delivery_replayed",
        "outcome_unknown",
    ]
    denied = by_signal["budget_denied"]
    assert (denied["sender"], denied["reason"], denied["amount"]) == (
        "signalled",
        "frozen",
        str(each),
    )
    assert by_signal["delivery_replayed"]["task"] == "tests.fixed_cost"
    assert by_signal["outcome_unknown"]["task"] == "tests.agent_steps"
    assert by_signal["outcome_unknown"]["attempt"].startswith("steps:signals:one")
