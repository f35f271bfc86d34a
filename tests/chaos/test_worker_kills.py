"""Thirty SIGKILLs of a worker's pool child at chosen and random points of a task.

Real ``celery worker`` processes (prefork, concurrency 1, acks_late +
reject_on_worker_lost) on the test's own Redis, a PostgreSQL scratch ledger, the
official openai SDK against the fake provider. Each round sends one ``chaos.call`` and
kills the child running it once:

- at a kill point the task itself dies at, on its first delivery only (see
  tests/chaos/worker_tasks.py: before the reserve, between reserve and send, marked
  sending, after the response, after the settlement);
- ``mid_request``: the provider delays its answer, and the test kills the child the
  lease names once the request has reached the provider;
- ``random``: the test kills the child after a random delay, wherever it is.

Celery requeues the message, and the redelivery must do what the ledger says: run if
nothing was sent, replay a stored result, or report the outcome unknown and keep the
hold; never a second provider call. The rounds run in three lanes at once (a worker,
a Redis database and a budget each), because the prefork pool notices a dead child
only on its 5-second supervision tick more often than not. Each lane's budget cannot
fit its rounds, so the last ones are denied. At the end every invariant is checked;
then the reconciliation beat job settles each unknown hold at what the provider billed
(or releases it once the provider cannot still be working on it), an operator releases
the holds no lookup can resolve, and the ledger's spend equals the provider's bill.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.cli import main as cli
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..workers import Worker
from .conftest import celery_client, live_children, outcome, sigkill
from .invariants import check_all
from .redis_server import RedisServer
from .worker_tasks import KILL_POINTS, estimate, marker

pytestmark = pytest.mark.chaos

ROUNDS = 30
LANES = 3
EXTERNAL = ("mid_request", "random")
KINDS = KILL_POINTS + EXTERNAL
# A lane's cap, in estimates: its first six rounds always fit; a settled round costs
# about 0.7 of an estimate, so ten rounds cannot all fit and the last are denied.
LANE_FIT = 6
PROVIDER_TIMEOUT = 3  # seconds; the reconciliation waits this long before "not found"

# What a round must end as when the cap admits it: (outcome, attempt state, requests).
EXPECTED = {
    "before_reserve": ("ok", "settled", 1),
    # granted and never sent: unknown until reconciliation finds nothing past the window
    "granted": ("OutcomeUnknown", "unknown", 0),
    "sending": ("OutcomeUnknown", "unknown", 0),
    "after_response": ("OutcomeUnknown", "unknown", 1),
    "after_settle": ("ok", "settled", 1),
    "mid_request": ("OutcomeUnknown", "unknown", 1),
}


def schedule(rng: random.Random) -> list[str]:
    """Every kind twice in the first fourteen rounds (which the caps admit), then the
    rest; round ``i`` goes to lane ``i % LANES``."""
    first = list(KINDS) * 2
    rng.shuffle(first)
    rest = list(KINDS) * 2
    rest += [rng.choice(KINDS) for _ in range(ROUNDS - len(first) - len(rest))]
    rng.shuffle(rest)
    return first + rest


def requests_for(fake: FakeProvider, ledger: Ledger, job: str) -> list[Any]:
    """The provider requests of ``job``'s main attempts (sent under their provider keys)."""
    keys = {ledger.provider_key(f"chaos:{job}#{n}") for n in range(1, 6)}
    return [s for s in fake.served() if s.method == "POST" and s.idempotency_key in keys]


def operation_row(ledger: Ledger, job: str) -> Any:
    with ledger.engine.connect() as conn:
        return conn.execute(
            text("SELECT status, lease_owner, deliveries, replays FROM operations WHERE key = :k"),
            {"k": f"chaos:{job}"},
        ).first()


def lease_pid(ledger: Ledger, job: str) -> int | None:
    row = operation_row(ledger, job)
    if row is None or row.lease_owner is None:
        return None
    return int(row.lease_owner.split(":")[1])


@dataclass
class Lane:
    index: int
    rounds: list[tuple[int, str]]
    rng: random.Random
    budget: str
    url: str
    worker: Worker | None = None
    tally: Counter[tuple[str, str]] = field(default_factory=Counter)


def play_round(
    lane: Lane, client: Celery, i: int, kind: str, *, real: Ledger, fake: FakeProvider, **ctx: Any
) -> None:
    """One round: send, kill once, wait for the end, and check what the ledger says."""
    each, markers, seed = ctx["each"], ctx["markers"], ctx["seed"]
    assert lane.worker is not None
    job = f"r{i:02d}"
    where = f"round {i} ({kind}, lane {lane.index}, seed {seed})"
    available = real.balance(lane.budget).available
    kill = kind if kind in KILL_POINTS else None
    fault = None
    if kind == "mid_request":
        fault = "delay=2"
    elif kind == "random":
        fault = lane.rng.choice([None, "delay=0.3"])
    result = client.send_task("chaos.call", args=[job, kill, fault])
    killed = False
    if kind == "mid_request":
        wait_for(lambda: requests_for(fake, real, job) or result.ready(), 30, f"{where}: the send")
        if not result.ready():  # a denied round never sends
            pid = lease_pid(real, job)
            assert pid is not None, where
            killed = sigkill(pid)
    elif kind == "random":
        time.sleep(lane.rng.uniform(0.0, 0.5))
        killed = any([sigkill(pid) for pid in live_children(lane.worker)])
    ended = outcome(result, timeout=60)
    lane.tally[(kind, ended)] += 1
    sent = requests_for(fake, real, job)
    attempts = real.attempts(keys=[f"chaos:{job}#1", f"chaos:{job}#2"])
    if available < each:
        assert ended == "BudgetExceeded", f"{where}: {ended} with {available} left"
        assert attempts == [] and sent == [], where
        return
    assert ended != "BudgetExceeded", f"{where}: denied with {available} left"
    assert len(attempts) == 1, f"{where}: {attempts}"
    [attempt] = attempts
    assert attempt.key == f"chaos:{job}#1", where
    if kind in EXPECTED:
        want, state, requests = EXPECTED[kind]
        assert (ended, attempt.state, len(sent)) == (want, state, requests), where
        if kind in KILL_POINTS:
            assert marker(job, kind, markers).exists(), f"{where}: the kill point never ran"
        if kind == "before_reserve":
            # killed before its admission: nothing of the first delivery was written
            assert operation_row(real, job).deliveries == 1, where
        elif kind in KILL_POINTS or killed:
            assert operation_row(real, job).deliveries >= 2, f"{where}: no redelivery"
        if kind == "after_settle":
            assert operation_row(real, job).replays >= 1, where
    else:  # a random kill: any of these ends is fine
        assert (ended, attempt.state) in (("ok", "settled"), ("OutcomeUnknown", "unknown")), (
            f"{where}: {ended}, attempt {attempt.state}"
        )
        assert len(sent) <= 1, where
        assert len(sent) == 1 or attempt.state == "unknown", where


def test_thirty_sigkills_of_a_pool_child_never_resend_and_lose_no_hold(
    redis_server: RedisServer,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    markers: Path,
) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))
    print(f"chaos seed: {seed} (set CHAOS_SEED to replay this run)")
    rng = random.Random(seed)
    plan = schedule(rng)
    began = time.monotonic()
    each = estimate("r00")
    base = redis_server.url.rsplit("/", 1)[0]
    lanes = [
        Lane(
            index=n,
            rounds=[(i, kind) for i, kind in enumerate(plan) if i % LANES == n],
            rng=random.Random(f"{seed}:{n}"),
            budget=f"lane{n}",
            url=f"{base}/{n + 1}",
        )
        for n in range(LANES)
    ]
    for lane in lanes:
        pg_ledger.create_budget(lane.budget, LANE_FIT * each)

    def start(lane: Lane) -> Worker:
        return start_worker(
            f"kills{lane.index}",
            CELERY_BROKER_URL=lane.url,
            CELERY_RESULT_BACKEND=lane.url,
            BUDGET_TASKS_BUDGET=lane.budget,
            BUDGET_TASKS_PROVIDER_TIMEOUT=str(PROVIDER_TIMEOUT),
            BUDGET_TASKS_RECONCILE_MARGIN="0",
        )

    with ThreadPoolExecutor(LANES) as pool:
        for lane, worker in zip(lanes, pool.map(start, lanes), strict=True):
            lane.worker = worker
    started = time.monotonic()

    real = Ledger(pg_url)  # the real clock, as the workers'
    context = {"each": each, "markers": markers, "seed": seed, "real": real, "fake": fake}

    def run(lane: Lane) -> None:
        with celery_client(lane.url) as client:
            for i, kind in lane.rounds:
                play_round(lane, client, i, kind, **context)

    try:
        with ThreadPoolExecutor(LANES) as pool:
            for done in [pool.submit(run, lane) for lane in lanes]:
                done.result()  # re-raises a lane's failure here
        tally = sum((lane.tally for lane in lanes), Counter[tuple[str, str]]())
        print(f"rounds: {sorted(tally.items())}; {time.monotonic() - started:.1f}s of rounds")
        assert sum(tally.values()) == ROUNDS
        for lane in lanes:
            denied = sum(n for (_, ended), n in lane.tally.items() if ended == "BudgetExceeded")
            assert 0 < denied <= len(lane.rounds) - LANE_FIT, f"lane {lane.index}: {lane.tally}"

        # A killed request's delayed answer is billed when its delay ends.
        wait_for(
            lambda: all(s.billed > 0 for s in fake.served() if s.method == "POST"),
            10,
            "the provider to bill the delayed requests",
        )
        sent_total = check_all(real, fake)
        unknown = real.attempts(states=["unknown"])
        assert unknown, "no kill left an unknown outcome"
        held = sum(real.balance(lane.budget).held for lane in lanes)
        assert held == sum(a.amount for a in unknown), "a hold went with its worker"

        # Reconciliation: a stored completion settles at its bill; a described call the
        # provider never saw is released once the call's timeout has passed; a call that
        # died before it was even described has no lookup (unknowable).
        newest = max(a.sending_at or a.created_at for a in unknown)
        wait = PROVIDER_TIMEOUT + 0.5 - (datetime.now(UTC) - newest).total_seconds()
        if wait > 0:
            time.sleep(wait)  # the one fixed pause: the lookup's "not yet" window
        with celery_client(lanes[0].url) as client:
            counts = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
        undescribed = [a for a in unknown if a.lookup is None]
        never_sent = [a for a in unknown if a.lookup and fake.billed_for(a.key, real) == 0]
        assert counts == {
            "found": len(unknown) - len(undescribed) - len(never_sent),
            "not_found": len(never_sent),
            "pending": 0,
            "unknowable": len(undescribed),
            "untrusted": 0,
            "failed": 0,
        }, (counts, unknown)
        # The operator checks with the provider and releases what it never saw.
        for a in undescribed:
            assert fake.billed_for(a.key, real) == 0, a
            done = CliRunner().invoke(
                cli,
                ["resolve", "--ledger-url", pg_url, a.key, "--actual", "0", "--note", "never sent"],
            )
            assert done.exit_code == 0, done.output
        for a in real.attempts():
            billed = fake.billed_for(a.key, real)
            assert a.state == ("settled" if billed else "released"), a
            assert a.actual == billed, a
        assert check_all(real, fake) == sent_total
        balances = [real.balance(lane.budget) for lane in lanes]
        assert sum(b.held for b in balances) == 0
        assert sum(b.spent for b in balances) == fake.state()["billed_total"]
        print(
            f"{ROUNDS} rounds in {LANES} lanes, {sent_total} provider requests, "
            f"{len(unknown)} unknown ({len(undescribed)} undescribed, {len(never_sent)} "
            f"never sent), {tally_denied(tally)} denied; total {time.monotonic() - began:.1f}s"
        )
    finally:
        real.dispose()


def tally_denied(tally: Counter[tuple[str, str]]) -> int:
    return sum(n for (_, ended), n in tally.items() if ended == "BudgetExceeded")
