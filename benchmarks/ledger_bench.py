"""Reserve+settle cycles per second through ``Ledger``, beside the same cycle written
by hand with psycopg, on one hot budget, with 8 and 32 worker processes.

    .venv/bin/python benchmarks/ledger_bench.py [--seconds 5] [--procs 8 32]

A cycle is what a BudgetTask does per billable call, in two transactions: admit
(attempt row inserted already granted, hold journal entry, then the conditional
UPDATE of the period row; COMMIT) and settle (lock the attempt, charge journal entry,
resolve, apply the actual to the period row; COMMIT). The hand-written cycle sends the
ledger's own statements (``budget_tasks.ledger.statements``) in the same order in the
same two transactions, on one connection it keeps. Both run in the same
invocation, alternating, so the machine's load affects both alike. Each process also
measures its own CPU time, so the report shows the client CPU per cycle of each.

Autovacuum is off on these machines: a hot row's dead versions pile up within
minutes, so the database is vacuumed before every round. The MultiXacts each cycle
makes are counted too (``next_multixact_id`` across a CHECKPOINT before and after the
round): row locks that many transactions share on the hot row, which PostgreSQL pays
for at every later lock of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from budget_tasks import CallFacts, Ledger
from budget_tasks.demo.processes import race
from budget_tasks.ledger import statements as sql
from budget_tasks.ledger.records import Answered

ADMIN_URL = os.environ.get(
    "BUDGET_TASKS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
TARGET = 0.9


WARMUP_S = 2.0


def start_together(released: float, seconds: float, warmup: float = WARMUP_S) -> float:
    """Wait out the warm-up so every process measures the same window; its deadline.

    ``released`` is when the barrier let this process go, the same instant for all.
    """
    time.sleep(max(0.0, released + warmup - time.time()))
    return released + warmup + seconds


def library_worker(
    url: str, tag: str, seconds: float, warmup: float = WARMUP_S, budget: str = "hot"
) -> tuple[int, float]:
    released = time.time()
    ledger = Ledger(url)
    ledger.calls.reserve(budget, f"{tag}-warm", 1)  # connect, cache the budget chain and period
    done = 0
    deadline = start_together(released, seconds, warmup)
    cpu = time.process_time()
    granted = CallFacts()
    while time.time() < deadline:
        key = f"{tag}-{done}"
        ledger.calls.reserve(budget, key, 1_000, grant=granted)
        ledger.calls.settle(key, 700)
        done += 1
    cpu = time.process_time() - cpu
    ledger.dispose()
    return done, cpu


def _raw(statement: str) -> str:
    """A statement of the ledger's own (``:name`` placeholders) in psycopg's style."""
    sql = statement.replace("{for_update}", " FOR UPDATE OF a")
    return re.sub(r"(?<!:):(\w+)", r"%(\1)s", sql)


def raw_worker(url: str, tag: str, seconds: float, warmup: float = WARMUP_S) -> tuple[int, float]:
    """The ledger's own statements, in the same order and transactions, sent by hand on
    one connection the process keeps: what the library adds is all that differs."""
    released = time.time()
    conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
    budget_id, period_id = conn.execute(
        "SELECT b.id, p.id FROM budgets b JOIN budget_periods p ON p.budget_id = b.id "
        "WHERE b.name = 'hot'"
    ).fetchone()
    conn.commit()
    insert_attempt, journal = _raw(sql.INSERT_ATTEMPT), _raw(sql.INSERT_JOURNAL)
    admit, lock = _raw(sql.ADMIT), _raw(sql.LOCK_ATTEMPT)
    resolve, apply = _raw(sql.RESOLVE_ATTEMPT), _raw(sql.APPLY_SETTLEMENT)
    done = 0
    deadline = start_together(released, seconds, warmup)
    cpu = time.process_time()
    while time.time() < deadline:
        key = f"{tag}-{done}"
        now = datetime.now(UTC)
        # admit: the attempt (granted), its hold entry, then the hot row last
        (attempt_id,) = conn.execute(
            insert_attempt,
            {
                "key": key,
                "budget_id": budget_id,
                "period_id": period_id,
                "fingerprint": None,
                "reason": "first",
                "amount": 1_000,
                "price_version": None,
                "operation_id": None,
                "label": None,
                "step": None,
                "state": "sending",
                "now": now,
                "sending_at": now,
                "lookup": None,
                "model": None,
                "timeout_ms": None,
                "request_digest": None,
                "input_bound": None,
                "output_bound": None,
            },
        ).fetchone()
        hold = {"attempt_id": attempt_id, "period_id": period_id, "kind": "hold"}
        # what the ledger's journal writer passes for the columns this cycle leaves alone
        unused = {"ref": None, "now": now, "actor": None} | dict.fromkeys(
            ("drawn_delta", "granted_delta", "cap_delta"), 0
        )
        conn.execute(
            journal,
            {**hold, "held_delta": 1_000, "spent_delta": 0, "note": "first"} | unused,
        )
        if (
            conn.execute(
                admit, {"amount": 1_000, "period_id": period_id, "false": False}
            ).fetchone()
            is None
        ):
            raise RuntimeError("the hot budget ran out")
        conn.commit()
        # settle: the attempt locked, its charge entry, its resolution, the hot row last
        conn.execute(lock, {"key": key}).fetchall()
        conn.execute(
            journal,
            {**hold, "kind": "charge", "held_delta": -1_000, "spent_delta": 700, "note": None}
            | unused,
        )
        conn.execute(
            resolve,
            {
                "state": "settled",
                "actual": 700,
                "now": now,
                "note": None,
                "estimate_only": False,
                "answer": None,
                "attempt_id": attempt_id,
                "expected": "sending",
                **Answered().params(),  # what an answer said: nothing, here
            },
        )
        conn.execute(apply, {"amount": 1_000, "actual": 700, "period_id": period_id}).fetchone()
        conn.commit()
        done += 1
    cpu = time.process_time() - cpu
    conn.close()
    return done, cpu


#: What a sampled backend of the run was doing (pg_stat_activity, every 20 ms).
WAITS = ("hot row lock", "waiting for its client in a transaction", "running", "idle")


class WaitSampler(threading.Thread):
    """Samples what the run's backends are doing: waiting on a lock (the hot row),
    idle in a transaction waiting for their client (the client holds the locks it took
    while it computes or waits for a core), running, or idle between transactions."""

    def __init__(self, database: str) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.counts = dict.fromkeys(WAITS, 0)
        self._stop_at = threading.Event()

    def run(self) -> None:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            while not self._stop_at.wait(0.02):
                rows = conn.execute(
                    "SELECT state, wait_event_type FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self.database,),
                ).fetchall()
                for state, wait in rows:
                    if wait == "Lock":
                        self.counts["hot row lock"] += 1
                    elif state == "idle in transaction":
                        self.counts["waiting for its client in a transaction"] += 1
                    elif state == "active":
                        self.counts["running"] += 1
                    else:
                        self.counts["idle"] += 1

    def stop(self) -> dict[str, float]:
        self._stop_at.set()
        self.join()
        total = sum(self.counts.values()) or 1
        return {name: count / total for name, count in self.counts.items()}


def measure(
    url: str,
    worker: Callable[..., tuple[int, float]],
    procs: int,
    seconds: float,
    warmup: float = WARMUP_S,
) -> tuple[float, float, dict[str, float]]:
    """Cycles per second over all processes, client CPU milliseconds per cycle, and
    what the backends were doing (shares of the samples)."""
    tag = uuid.uuid4().hex[:8]
    sampler = WaitSampler(url.rsplit("/", 1)[1])
    timer = threading.Timer(warmup + 0.5, sampler.start)  # the measured window only
    timer.start()
    try:
        results = race(worker, [(url, f"{tag}-{i}", seconds, warmup) for i in range(procs)])
    finally:
        timer.cancel()
    waits = sampler.stop() if sampler.is_alive() else dict.fromkeys(WAITS, 0.0)
    cycles = sum(done for done, _ in results)
    cpu = sum(spent for _, spent in results)
    return float(cycles) / seconds, 1000.0 * cpu / max(cycles, 1), waits


@dataclass
class LedgerRow:
    """One process count: the medians of the rounds, and every round."""

    procs: int
    raw: float
    ledger: float
    raw_rounds: list[float]
    ledger_rounds: list[float]
    #: client CPU per cycle (ms), the median of the rounds
    raw_cpu_ms: float = 0.0
    ledger_cpu_ms: float = 0.0
    #: what the backends were doing, shares of the samples of the last round
    raw_waits: dict[str, float] = field(default_factory=dict)
    ledger_waits: dict[str, float] = field(default_factory=dict)
    #: MultiXacts per cycle, the median of the rounds
    raw_multixacts: float = 0.0
    ledger_multixacts: float = 0.0

    @property
    def ratio(self) -> float:
        return self.ledger / self.raw


@dataclass
class LedgerResult:
    rows: list[LedgerRow]
    audit: list[str]


@contextmanager
def scratch_database(admin_url: str = ADMIN_URL) -> Iterator[str]:
    """A database of its own for one benchmark (its SQLAlchemy URL), dropped after."""
    name = f"bt_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _vacuumed(url: str) -> None:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.autocommit = True
        conn.execute("VACUUM")


def _next_multixact(admin_url: str) -> int:
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute("CHECKPOINT")
        row = admin.execute("SELECT next_multixact_id FROM pg_control_checkpoint()").fetchone()
    return int(row[0]) if row is not None else 0


def _round(
    admin_url: str,
    url: str,
    worker: Callable[..., tuple[int, float]],
    n: int,
    seconds: float,
    warmup: float,
) -> tuple[float, float, dict[str, float], float]:
    """One vacuumed round: its rate, client CPU, waits and MultiXacts per cycle."""
    _vacuumed(url)
    before = _next_multixact(admin_url)
    rate, cpu, waits = measure(url, worker, n, seconds, warmup)
    made = _next_multixact(admin_url) - before
    return rate, cpu, waits, made / max(rate * seconds, 1.0)


def run(
    admin_url: str = ADMIN_URL,
    *,
    procs: list[int],
    seconds: float,
    rounds: int,
    warmup: float = WARMUP_S,
    report: Callable[[LedgerRow], None] | None = None,
) -> LedgerResult:
    """Both cycles on a scratch database, alternating, for each process count."""
    with scratch_database(admin_url) as url:
        ledger = Ledger(url)
        ledger.create_schema()
        ledger.create_budget("hot", 10**15)
        ledger.upkeep.open_period("hot")  # the period row the raw cycle uses
        rows = []
        for n in procs:
            raw, lib, raw_cpu, lib_cpu, raw_mx, lib_mx = [], [], [], [], [], []
            raw_waits: dict[str, float] = {}
            lib_waits: dict[str, float] = {}
            for _ in range(rounds):
                rate, cpu, raw_waits, mx = _round(admin_url, url, raw_worker, n, seconds, warmup)
                raw.append(rate)
                raw_cpu.append(cpu)
                raw_mx.append(mx)
                rate, cpu, lib_waits, mx = _round(
                    admin_url, url, library_worker, n, seconds, warmup
                )
                lib.append(rate)
                lib_cpu.append(cpu)
                lib_mx.append(mx)
            row = LedgerRow(
                n,
                statistics.median(raw),
                statistics.median(lib),
                raw,
                lib,
                statistics.median(raw_cpu),
                statistics.median(lib_cpu),
                raw_waits,
                lib_waits,
                statistics.median(raw_mx),
                statistics.median(lib_mx),
            )
            rows.append(row)
            if report is not None:
                report(row)
        audit = [str(finding) for finding in ledger.audit()]
        ledger.dispose()
        return LedgerResult(rows, audit)


def describe_waits(waits: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in waits.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--procs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL at {ADMIN_URL.rsplit('@', 1)[-1]}"
    )
    print(
        f"{'processes':>9}  {'raw psycopg':>12}  {'Ledger':>12}  {'ratio':>6}  "
        "client CPU per cycle (raw, Ledger)"
    )

    def show(row: LedgerRow) -> None:
        print(
            f"{row.procs:>9}  {row.raw:>10.0f}/s  {row.ledger:>10.0f}/s  {row.ratio:>6.2f}  "
            f"{row.raw_cpu_ms:.2f} ms, {row.ledger_cpu_ms:.2f} ms"
        )
        print(
            f"{'':>9}  MultiXacts per cycle: raw {row.raw_multixacts:.2f}, "
            f"Ledger {row.ledger_multixacts:.2f}"
        )
        print(f"{'':>9}  backends, raw: {describe_waits(row.raw_waits)}")
        print(f"{'':>9}  backends, Ledger: {describe_waits(row.ledger_waits)}")

    result = run(procs=args.procs, seconds=args.seconds, rounds=args.rounds, report=show)
    print(f"audit after the run: {'; '.join(result.audit) or 'clean'}")
    met = bool(result.rows) and min(r.ratio for r in result.rows) >= TARGET
    print(f"target: Ledger >= {TARGET} x raw: {'met' if met else 'NOT met'}")
    return 0 if not result.audit else 1


if __name__ == "__main__":
    sys.exit(main())
