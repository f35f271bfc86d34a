"""A provider that bills and then answers too late, under load, with kills mixed in.

Real ``celery worker`` (concurrency 2) on the test's own Redis, a PostgreSQL scratch
ledger, the official openai SDK (timeout 1.5 s, retries off) against the fake
provider. Six calls bill and then hang past the SDK's timeout (``hang=``), one bills
and resets the connection, and two of the hanging ones also lose their pool child
mid-call. Each of those attempts must end 'unknown' with its hold whole: a timeout is
not a refund. Ten ordinary calls follow against a cap that those holds fill up: some
are denied (they would all fit had the holds been released). Then the beat jobs,
through the worker: ``flag_stale_holds`` flags each unknown hold once, and
``reconcile_unknown`` settles each at what the provider billed, found by its stored
completion. Sending the timed-out keys again replays the reconciled answers.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..workers import Worker
from .conftest import outcome, sigkill
from .invariants import check_all
from .worker_tasks import estimate

pytestmark = pytest.mark.chaos

TIMEOUT = 1.5  # the SDK's timeout in the worker
HANG = "hang=3"  # billed, then the answer comes after the timeout
KILLED = ["t0", "t1"]  # hang, and their pool child is SIGKILLed mid-call
HUNG = ["t2", "t3", "t4", "t5"]  # hang until the SDK gives up
RESET = ["t6"]  # billed, then the connection is cut
NORMAL = [f"n{i}" for i in range(10)]
# The cap: the seven held calls plus room for four estimates. Ten ordinary calls
# (about 0.7 of an estimate each) fit in ten estimates but not in four.
FIT = len(KILLED + HUNG + RESET) + 4
assert len(NORMAL) <= FIT  # without the holds, every ordinary call would fit


def requests_for(fake: FakeProvider, ledger: Ledger, job: str) -> list[Any]:
    """The provider requests of ``job``'s main attempts (sent under their provider keys)."""
    keys = {ledger.provider_key(f"chaos:{job}#{n}") for n in range(1, 6)}
    return [s for s in fake.served() if s.method == "POST" and s.idempotency_key in keys]


def lease_pid(ledger: Ledger, job: str) -> int | None:
    with ledger.engine.connect() as conn:
        owner = conn.execute(
            text("SELECT lease_owner FROM operations WHERE key = :k"), {"k": f"chaos:{job}"}
        ).scalar()
    return None if owner is None else int(owner.split(":")[1])


def test_timeouts_keep_their_holds_under_load_then_beat_settles_them_at_the_bill(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
) -> None:
    began = time.monotonic()
    each = estimate("t0")
    assert all(estimate(job) == each for job in KILLED + HUNG + RESET + NORMAL)
    pg_ledger.create_budget("slow", FIT * each)
    start_worker(
        "timeouts",
        concurrency=2,
        BUDGET_TASKS_BUDGET="slow",
        BUDGET_TASKS_PROVIDER_TIMEOUT=str(TIMEOUT),
        BUDGET_TASKS_STALE_AFTER="0",
        BUDGET_TASKS_RECONCILE_MARGIN="0",
    )
    real = Ledger(pg_url)
    try:
        # The timeouts, the kills first so that both start at once.
        faults = {job: HANG for job in KILLED + HUNG} | {job: "reset" for job in RESET}
        results = {
            job: client.send_task("chaos.call", args=[job, None, f]) for job, f in faults.items()
        }
        kills = 0
        for job in KILLED:
            wait_for(lambda job=job: requests_for(fake, real, job), 30, f"{job}'s request")
            pid = lease_pid(real, job)  # None if the SDK already gave up
            kills += pid is not None and sigkill(pid)
        ended = {job: outcome(r, timeout=60) for job, r in results.items()}
        print(f"timeouts: {ended}; {kills} pool children killed mid-call")
        assert kills >= 1, "no kill landed while the call hung"
        unknown = {a.operation_key: a for a in real.attempts(states=["unknown"])}
        assert set(unknown) == {f"chaos:{job}" for job in faults}, unknown
        for job in faults:
            attempt = unknown[f"chaos:{job}"]
            assert ended[job] not in ("ok", "BudgetExceeded"), (job, ended[job])
            assert attempt.actual is None and attempt.amount == each, attempt
            assert len(requests_for(fake, real, job)) == 1, job
            assert fake.billed_for(attempt.key, real) > 0, "the provider billed the call"
        bal = real.balance("slow")
        assert (bal.held, bal.spent) == (len(faults) * each, 0), "a hold was released"

        # Load against what the holds leave.
        normal = [client.send_task("chaos.call", args=[job]) for job in NORMAL]
        tally = Counter(outcome(r, timeout=60) for r in normal)
        print(f"ordinary calls beside the holds: {dict(tally)}")
        assert set(tally) == {"ok", "BudgetExceeded"}, tally
        bal = real.balance("slow")
        assert bal.held == len(faults) * each and bal.spent + bal.held <= bal.cap

        # The beat jobs, through the worker.
        assert client.send_task("budget_tasks.flag_stale_holds").get(timeout=60) == len(faults)
        assert client.send_task("budget_tasks.flag_stale_holds").get(timeout=60) == 0
        counts = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
        assert counts == {
            "found": len(faults),
            "not_found": 0,
            "pending": 0,
            "unknowable": 0,
            "untrusted": 0,
            "failed": 0,
        }
        for attempt in unknown.values():
            settled = real.attempt(attempt.key)
            assert settled.flagged_at is not None
            assert (settled.state, settled.actual) == (
                "settled",
                fake.billed_for(attempt.key, real),
            )
        bal = real.balance("slow")
        assert bal.held == 0 and bal.spent == fake.state()["billed_total"]

        # Each timed-out key again: the reconciled answer, no second call.
        again = {
            job: client.send_task("chaos.call", args=[job, None, f]) for job, f in faults.items()
        }
        for job, r in again.items():
            assert r.get(timeout=60) == real.operation(f"chaos:{job}").result, job
            assert len(requests_for(fake, real, job)) == 1, job
        requests = check_all(real, fake)
        print(
            f"{len(faults)} unknown outcomes settled at the bill, {tally['ok']} ordinary "
            f"calls, {tally['BudgetExceeded']} denied, {requests} provider requests; "
            f"{time.monotonic() - began:.1f}s"
        )
    finally:
        real.dispose()
