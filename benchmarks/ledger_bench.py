"""Reserve+settle cycles per second through ``Ledger``, beside the same cycle written
by hand with psycopg, on one hot budget, with 8 and 32 worker processes.

    .venv/bin/python benchmarks/ledger_bench.py [--seconds 5] [--procs 8 32]

A cycle is what a BudgetTask does per billable call: reserve (conditional UPDATE of
the period row, attempt row, hold journal entry; COMMIT), mark sending (COMMIT),
settle (lock the attempt, apply the actual, charge journal entry, resolve; COMMIT).
The hand-written cycle runs the same statements in the same three transactions. Both
run in the same invocation, alternating, so the machine's load affects both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg

from budget_tasks import Ledger
from budget_tasks.testing.harness import race

ADMIN_URL = os.environ.get(
    "BUDGET_TASKS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
TARGET = 0.8


WARMUP_S = 2.0


def start_together(released: float, seconds: float, warmup: float = WARMUP_S) -> float:
    """Wait out the warm-up so every process measures the same window; its deadline.

    ``released`` is when the barrier let this process go, the same instant for all.
    """
    time.sleep(max(0.0, released + warmup - time.time()))
    return released + warmup + seconds


def library_worker(url: str, tag: str, seconds: float, warmup: float = WARMUP_S) -> int:
    released = time.time()
    ledger = Ledger(url)
    ledger.reserve("hot", f"{tag}-warm", 1)  # connect, cache the budget chain and period
    done = 0
    deadline = start_together(released, seconds, warmup)
    while time.time() < deadline:
        key = f"{tag}-{done}"
        ledger.reserve("hot", key, 1_000)
        ledger.mark_sending(key, provider="bench")
        ledger.settle(key, 700)
        done += 1
    ledger.dispose()
    return done


def raw_worker(url: str, tag: str, seconds: float, warmup: float = WARMUP_S) -> int:
    released = time.time()
    conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
    budget_id, period_id = conn.execute(
        "SELECT b.id, p.id FROM budgets b JOIN budget_periods p ON p.budget_id = b.id "
        "WHERE b.name = 'hot'"
    ).fetchone()
    conn.commit()
    done = 0
    deadline = start_together(released, seconds, warmup)
    while time.time() < deadline:
        key = f"{tag}-{done}"
        now = datetime.now(UTC)
        # reserve
        if (
            conn.execute(
                "UPDATE budget_periods SET held = held + %s WHERE id = %s "
                "AND cap - spent - held >= %s RETURNING id",
                (1_000, period_id, 1_000),
            ).fetchone()
            is None
        ):
            raise RuntimeError("the hot budget ran out")
        (attempt_id,) = conn.execute(
            "INSERT INTO attempts (key, budget_id, period_id, reason, amount, state, created_at) "
            "VALUES (%s, %s, %s, 'first', %s, 'reserved', %s) RETURNING id",
            (key, budget_id, period_id, 1_000, now),
        ).fetchone()
        conn.execute(
            "INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, "
            "created_at) VALUES (%s, %s, 'hold', %s, 0, %s)",
            (attempt_id, period_id, 1_000, now),
        )
        conn.commit()
        # mark sending
        conn.execute(
            "UPDATE attempts SET state = 'sending', sending_at = %s, provider = 'bench' "
            "WHERE key = %s AND state = 'reserved' RETURNING id",
            (now, key),
        ).fetchone()
        conn.commit()
        # settle
        conn.execute(
            "SELECT id, amount, state FROM attempts WHERE key = %s FOR UPDATE", (key,)
        ).fetchone()
        conn.execute(
            "UPDATE budget_periods SET held = held - %s, spent = spent + %s WHERE id = %s",
            (1_000, 700, period_id),
        )
        conn.execute(
            "INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, "
            "created_at) VALUES (%s, %s, 'charge', %s, %s, %s)",
            (attempt_id, period_id, -1_000, 700, now),
        )
        conn.execute(
            "UPDATE attempts SET state = 'settled', actual = %s, resolved_at = %s WHERE id = %s",
            (700, now, attempt_id),
        )
        conn.commit()
        done += 1
    conn.close()
    return done


def measure(
    url: str, worker: Callable[..., int], procs: int, seconds: float, warmup: float = WARMUP_S
) -> float:
    tag = uuid.uuid4().hex[:8]
    counts = race(worker, [(url, f"{tag}-{i}", seconds, warmup) for i in range(procs)])
    return float(sum(counts)) / seconds


@dataclass
class LedgerRow:
    """One process count: the medians of the rounds, and every round."""

    procs: int
    raw: float
    ledger: float
    raw_rounds: list[float]
    ledger_rounds: list[float]

    @property
    def ratio(self) -> float:
        return self.ledger / self.raw


@dataclass
class LedgerResult:
    rows: list[LedgerRow]
    audit: list[str]


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
    name = f"bt_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    url += "/" + name
    try:
        ledger = Ledger(url)
        ledger.create_schema()
        ledger.create_budget("hot", 10**15)
        ledger.open_period("hot")  # the period row the raw cycle uses
        rows = []
        for n in procs:
            raw, lib = [], []
            for _ in range(rounds):
                raw.append(measure(url, raw_worker, n, seconds, warmup))
                lib.append(measure(url, library_worker, n, seconds, warmup))
            row = LedgerRow(n, statistics.median(raw), statistics.median(lib), raw, lib)
            rows.append(row)
            if report is not None:
                report(row)
        audit = [str(finding) for finding in ledger.audit()]
        ledger.dispose()
        return LedgerResult(rows, audit)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
    print(f"{'processes':>9}  {'raw psycopg':>12}  {'Ledger':>12}  {'ratio':>6}")

    def show(row: LedgerRow) -> None:
        print(f"{row.procs:>9}  {row.raw:>10.0f}/s  {row.ledger:>10.0f}/s  {row.ratio:>6.2f}")

    result = run(procs=args.procs, seconds=args.seconds, rounds=args.rounds, report=show)
    print(f"audit after the run: {'; '.join(result.audit) or 'clean'}")
    met = bool(result.rows) and min(r.ratio for r in result.rows) >= TARGET
    print(f"target: Ledger >= {TARGET} x raw: {'met' if met else 'NOT met'}")
    return 0 if not result.audit else 1


if __name__ == "__main__":
    sys.exit(main())
