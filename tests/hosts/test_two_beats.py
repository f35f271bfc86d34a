"""Scenario 5: two beats on two hosts for an hour of ledger time.

Hosts a and b each run a worker and a real ``celery beat``. The ledger's clock runs
120 times as fast as the real one in every worker (an hour in 30 s), and each beat
sends the jobs it runs every minute once per ledger minute, on the minute (as crontab
entries fire), so the two beats send each job together and the two hosts' workers run
the copies at the same time (the test shows they did). The hour crosses midnight, so
three daily budgets (rollover) open a new period in it.

Meanwhile the hosts make calls whose outcome is unknown (the provider bills, then
resets the connection): stored ones, which reconciliation finds, and unstored ones,
which nothing can find and whose holds go stale. At the end: each stale hold was
flagged once, each found attempt reconciled once (one charge, what the provider
billed), each period opened once (one row, its carry computed once), and runs of each
job did overlap on the two hosts.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.ledger.periods import opening_cap
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..chaos.invariants import check_no_hold_lost
from ..services import REDIS_HOST, REDIS_PORT
from .conftest import BEAT_READY, REDIS_DB
from .host_tasks import BEAT_EVERY_ENV, BEAT_TRACE_ENV, EVERY_MINUTE, SIM_CLOCK_ENV, sim_clock
from .test_host_killed import requests_for

pytestmark = pytest.mark.hosts

RATE = 120.0  # ledger seconds per real second: the hour takes 30 s
HOUR = 3600 / RATE
STALE_AFTER = 900  # ledger seconds: beat's default
#: Ledger minutes into the hour at which each wave of calls is sent
WAVES = (1, 12, 24)
PER_WAVE = 2  # found calls, and as many unstored ones
ALLOWANCE = 1_000_000
#: What each daily budget spends on the first day: part, nothing, all of it
SPENT_ON_DAY_ONE = {"daily-a": 300_000, "daily-b": 0, "daily-c": ALLOWANCE}
JOBS = {
    "budget-tasks-flag-stale-holds": "budget_tasks.flag_stale_holds",
    "budget-tasks-reconcile-unknown": "budget_tasks.reconcile_unknown",
    "budget-tasks-renew-periods": "budget_tasks.renew_periods",
}


def overlapping(runs: list[dict[str, Any]]) -> int:
    """Pairs of runs on different hosts whose time spans overlap."""
    found = 0
    for i, one in enumerate(runs):
        for other in runs[i + 1 :]:
            apart = one["end"] <= other["start"] or other["end"] <= one["start"]
            if one["host"] != other["host"] and not apart:
                found += 1
    return found


def read_trace(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_beats_for_an_hour_flag_reconcile_and_open_each_once(
    hosts: Any,
    client: Celery,
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    tmp_path: Path,
    hosts_counts: Any,
) -> None:
    assert set(JOBS) == set(EVERY_MINUTE)
    today = datetime.now(UTC)
    # the first of this month: the hour and its midnight stay inside this month
    start = datetime(today.year, today.month, 1, 23, 30, tzinfo=UTC)
    midnight = start + timedelta(minutes=30)
    began = tmp_path / "hour-began"
    clock = f"{start.isoformat()},{RATE},{began}"
    trace = tmp_path / "beat-trace.jsonl"
    env = {
        SIM_CLOCK_ENV: clock,
        BEAT_EVERY_ENV: str(60 / RATE),
        BEAT_TRACE_ENV: str(trace),
        "BUDGET_TASKS_STALE_AFTER": str(STALE_AFTER),
    }
    a, b = hosts("host-a"), hosts("host-b")
    # started side by side: the machine is shared, and each takes seconds
    workers = [host.start(wait=False, **env) for host in (a, b)]
    beats = [host.start_beat(wait=False, **env) for host in (a, b)]
    for worker in workers:
        worker.wait_ready()
    for beat in beats:
        beat.wait_ready(mark=BEAT_READY)

    ledger = Ledger(pg_url, clock=sim_clock(clock))  # the test's view, on the same clock
    try:
        # the day's budgets, as they stand at the hour's start (the clock stands still)
        for name, spent in SPENT_ON_DAY_ONE.items():
            ledger.create_budget(name, ALLOWANCE, period="day", renewal="rollover")
            if spent:
                ledger.calls.reserve(name, f"{name}:day-one", spent)
                ledger.calls.mark_sending(f"{name}:day-one")
                ledger.calls.settle(f"{name}:day-one", spent)

        staged = began.with_suffix(".new")
        staged.write_text(repr(time.time()))
        staged.rename(began)  # every host's clock starts now, at once
        real_start = float(began.read_text())

        def at(minute: float) -> None:
            time.sleep(max(0.0, real_start + minute * 60 / RATE - time.time()))

        found_jobs: list[str] = []
        unstored_jobs: list[str] = []
        results = []
        for wave, minute in enumerate(WAVES):
            at(minute)
            for n in range(PER_WAVE):
                for task, jobs in (
                    ("hosts.call_for_an_hour", found_jobs),
                    ("hosts.call_unstored", unstored_jobs),
                ):
                    job = f"{task.rsplit('_', 1)[-1]}-{wave}-{n}"
                    jobs.append(job)
                    results.append(client.send_task(task, args=[job], kwargs={"fault": "reset"}))
        at(60)
        for beat in beats:
            beat.stop()
        ended = ledger.calls.now()
        # what the beats sent before they stopped is run to the end
        queue = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB)
        wait_for(lambda: queue.llen("celery") == 0, 60, "the workers to drain the queue")
        time.sleep(3)  # the last runs end, and write their trace

        for result in results:  # the reset reaches the task: its outcome is unknown
            result.get(timeout=30, propagate=False)
            assert result.failed(), result.result
        runs = read_trace(trace)
        logs = "\n".join(p.log_path.read_text() for h in (a, b) for p in h.processes)

        # Both beats sent every job all hour long, and the two hosts ran copies at once.
        for beat in beats:
            sent = Counter(re.findall(r"Sending due task (\S+)", beat.log_path.read_text()))
            for name in JOBS:
                assert sent[name] >= HOUR * RATE / 60 / 2, (beat.log_path.name, sent)
        by_job = {job: [r for r in runs if r["job"] == job] for job in JOBS.values()}
        overlaps = {job: overlapping(found) for job, found in by_job.items()}
        for job, found in by_job.items():
            assert {r["host"] for r in found} == {"host-a", "host-b"}, job
            assert overlaps[job] > 0, f"no two runs of {job} overlapped: {overlaps}"

        # Each stale hold flagged once, when it came due, and only those.
        attempts = {x.key: x for x in ledger.attempts()}
        unstored = [attempts[f"hosts:{job}#1"] for job in unstored_jobs]
        found = [attempts[f"hosts:{job}#1"] for job in found_jobs]
        flagged_total = sum(int(r["result"]) for r in by_job["budget_tasks.flag_stale_holds"])
        with ledger.engine.connect() as conn:
            flags = dict(
                conn.execute(
                    text("SELECT key, flagged_at FROM attempts WHERE flagged_at IS NOT NULL")
                ).all()
            )
        assert set(flags) == {x.key for x in unstored}, flags
        assert flagged_total == len(unstored), flagged_total
        for x in unstored:
            assert x.state == "unknown"
            age = flags[x.key] - x.created_at
            assert timedelta(seconds=STALE_AFTER) <= age <= timedelta(seconds=STALE_AFTER + 300)
            assert logs.count(f"attempt={x.key} ") == 1, x.key

        # Each found attempt reconciled once: settled at what the provider billed, by
        # one charge, counted and told found once. A run whose claim another outlived
        # (the claim's first back-off is one ledger minute) finds it resolved and
        # writes nothing.
        outcomes: Counter[str] = Counter()
        for r in by_job["budget_tasks.reconcile_unknown"]:
            outcomes.update(r["result"])
        moved = re.findall(r"reconciling (\S+): it moved meanwhile", logs)
        assert outcomes["found"] == len(found), outcomes
        assert outcomes["failed"] == len(moved), (outcomes, moved)
        assert set(moved) <= {x.key for x in found}, moved
        assert outcomes["unknowable"] >= len(unstored), outcomes
        with ledger.engine.connect() as conn:
            charges = {
                key: n
                for key, n in conn.execute(
                    text(
                        "SELECT a.key, count(*) FROM journal j JOIN attempts a "
                        "ON a.id = j.attempt_id WHERE j.kind = 'charge' GROUP BY a.key"
                    )
                )
            }
        for x in found:
            assert (x.state, x.actual) == ("settled", fake.billed_for(x.key, pg_ledger)), x
            assert charges.get(x.key) == 1, (x.key, charges.get(x.key))
            assert logs.count(f"reconciled {x.key}: found at the provider") == 1, x.key
        for job in (*found_jobs, *unstored_jobs):
            assert len(requests_for(fake, pg_ledger, job)) == 1, job

        # Each period opened once: two days, the second opened at midnight by a beat,
        # with the carry computed once.
        with ledger.engine.connect() as conn:
            periods = conn.execute(
                text(
                    "SELECT b.name, p.period_start, p.cap, p.carried_out, p.opened_at, "
                    "p.closed_at FROM budget_periods p JOIN budgets b ON b.id = p.budget_id "
                    "WHERE b.period = 'day' ORDER BY b.name, p.period_start"
                )
            ).all()
        for name, spent in SPENT_ON_DAY_ONE.items():
            days = [p for p in periods if p[0] == name]
            assert [p[1] for p in days] == [midnight - timedelta(days=1), midnight], days
            (_, _, cap1, carried, _, closed), (_, _, cap2, carried2, opened, still) = days
            expected = opening_cap(ALLOWANCE, "rollover", None, (cap1, spent, 0))
            assert (cap2, carried) == (expected, expected - ALLOWANCE), days
            assert midnight <= opened <= midnight + timedelta(minutes=5), days
            assert closed is not None and still is None and carried2 == 0, days
        check_no_hold_lost(ledger)
        assert ledger.audit() == []
        assert ended - start >= timedelta(hours=1)

        hosts_counts(
            5,
            tasks=len(results),
            beat_runs=len(runs),
            overlapping_runs=sum(overlaps.values()),
            sends=len(found_jobs) + len(unstored_jobs),
            flagged=flagged_total,
            reconciled=outcomes["found"],
            reconcile_races_lost=len(moved),
            periods_opened=len(SPENT_ON_DAY_ONE),
        )
    finally:
        ledger.dispose()
