"""The ledger over months: the same operations on a ledger holding 90 days of history
(1,000 daily budgets, 2 million finished calls, 4 million journal rows) and on one
with the same budgets and open holds and no history, in the same run; then a retention
run on the large one, with the table sizes before and after.

    .venv/bin/python benchmarks/ledger_growth.py [--calls 2000000] [--budgets 1000]

Both ledgers are built in bulk by SQL, in the order a ledger grows (each day's
periods together, as beat opens them; each call an operation, a settled attempt and
its hold and charge rows; the counters their sums), audited clean, and vacuumed
(autovacuum is off on these machines). Each operation is timed ``samples`` times after
a warm-up, alternating between the two ledgers, and the median compared: the target
is every ratio (large / empty) at most 1.2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ledger_bench import scratch_database  # noqa: E402
from budget_tasks import BudgetExceeded, Ledger  # noqa: E402
from budget_tasks.beat import GRANT_IDLE, renew_periods  # noqa: E402
from budget_tasks.testing import ManualClock  # noqa: E402

TODAY = datetime(2026, 6, 15, 12, tzinfo=UTC)
DAYS = 90
TARGET = 1.2
#: Rounds per operation, alternating empty and large: sub-millisecond beat jobs are at
#: the mercy of the machine's other work, and more rounds make the median steadier.
ROUNDS = 5
OPEN_HOLDS = 3_000
#: The retention window of the retention run: March and April leave, May and June stay.
KEEP = timedelta(days=30)
LEASE_OWNER = "bench-host:1:live@boot/1/1"
#: Rows per committed batch of the retention run's deletes (the default is 1,000).
RETAIN_BATCH = 10_000

_CALLS = """
INSERT INTO operations (key, fingerprint, task, status, result, runs, deliveries, replays,
                        created_at, updated_at, completed_at)
SELECT 'op-' || g, 'f', 'bench', 'succeeded',
       CASE WHEN d.day >= %(today)s::timestamptz - interval '7 days' THEN '"r"' END,
       1, 1, 0, d.day + interval '1 hour', d.day + interval '1 hour', d.day + interval '1 hour'
FROM generate_series(1, %(calls)s) g,
LATERAL (SELECT date_trunc('day', %(today)s::timestamptz)
                - make_interval(days => 1 + (g / %(budgets)s) %% %(days)s) AS day) d"""

_ATTEMPTS = """
INSERT INTO attempts (key, budget_id, period_id, reason, amount, actual, state, created_at,
                      sending_at, resolved_at, operation_id)
SELECT o.key || '#1', p.budget_id, p.id, 'first', 1000, 900, 'settled', o.created_at,
       o.created_at, o.completed_at, o.id
FROM operations o
JOIN budget_periods p ON p.budget_id = 1 + (CAST(substr(o.key, 4) AS BIGINT) %% %(budgets)s)
 AND p.period_start = date_trunc('day', o.created_at)
WHERE o.task = 'bench'"""

_OPEN = """
INSERT INTO operations (key, fingerprint, task, status, runs, deliveries, replays, created_at,
                        updated_at, lease_owner, lease_expires_at)
SELECT 'live-' || g, 'f', 'bench-live', 'running', 1, 1, 0, %(today)s, %(today)s,
       %(owner)s, %(today)s::timestamptz + interval '1 day'
FROM generate_series(1, %(holds)s) g"""

_OPEN_ATTEMPTS = """
INSERT INTO attempts (key, budget_id, period_id, reason, amount, state, created_at,
                      sending_at, operation_id)
SELECT o.key || '#1', p.budget_id, p.id, 'first', 1000, 'sending', o.created_at,
       o.created_at, o.id
FROM operations o
JOIN budget_periods p ON p.budget_id = 1 + (CAST(substr(o.key, 6) AS BIGINT) %% %(budgets)s)
 AND p.period_start = date_trunc('day', %(today)s::timestamptz)
WHERE o.task = 'bench-live'"""

_JOURNAL = """
INSERT INTO journal (attempt_id, period_id, kind, held_delta, spent_delta, created_at,
                     period_start)
SELECT a.id, a.period_id, k.kind, k.held, k.spent, a.created_at, p.period_start
FROM attempts a JOIN budget_periods p ON p.id = a.period_id,
LATERAL (VALUES ('hold', a.amount, 0), ('charge', -a.amount, a.actual)) AS k (kind, held, spent)
WHERE a.state = 'settled'
UNION ALL
SELECT a.id, a.period_id, 'hold', a.amount, 0, a.created_at, p.period_start
FROM attempts a JOIN budget_periods p ON p.id = a.period_id WHERE a.state = 'sending'"""

_COUNTERS = """
UPDATE budget_periods p SET spent = s.spent, held = s.held
FROM (SELECT period_id, SUM(spent_delta) AS spent, SUM(held_delta) AS held
      FROM journal GROUP BY period_id) s
WHERE s.period_id = p.id"""

_PERIODS = """
INSERT INTO budget_periods (budget_id, period_start, cap, spent, held, opened_at, closed_at)
SELECT b.id, d, 1000000000000, 0, 0, d,
       CASE WHEN d < date_trunc('day', %(today)s::timestamptz) THEN d + interval '1 day' END
FROM budgets b, generate_series(
    date_trunc('day', %(today)s::timestamptz) - make_interval(days => %(days)s),
    date_trunc('day', %(today)s::timestamptz), interval '1 day') AS d
WHERE b.name LIKE 'b%%'
ORDER BY d, b.id
ON CONFLICT (budget_id, period_start) DO NOTHING"""

_SIZES = """
SELECT 'journal', COALESCE(SUM(pg_total_relation_size(i.inhrelid)), 0)
FROM pg_inherits i WHERE i.inhparent = 'journal'::regclass
UNION ALL SELECT 'attempts', pg_total_relation_size('attempts')
UNION ALL SELECT 'operations', pg_total_relation_size('operations')
UNION ALL SELECT 'budget_periods', pg_total_relation_size('budget_periods')"""

_ROWS = """
SELECT (SELECT COUNT(*) FROM journal), (SELECT COUNT(*) FROM attempts),
       (SELECT COUNT(*) FROM operations)"""


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@dataclass
class Ledgers:
    """One ledger under test: its URL, its Ledger at TODAY, and a counter for keys."""

    url: str
    ledger: Ledger
    clock: ManualClock
    made: int = 0

    def key(self) -> str:
        self.made += 1
        return f"k-{self.made}-{uuid.uuid4().hex[:6]}"


def build(url: str, calls: int, budgets: int) -> Ledgers:
    """A ledger at TODAY with ``budgets`` daily budgets and OPEN_HOLDS calls in flight,
    and ``calls`` finished calls spread over the DAYS before (none: no history)."""
    clock = ManualClock(TODAY - timedelta(days=DAYS + 1))
    ledger = Ledger(url, clock=clock)
    ledger.create_schema()
    ledger.upkeep.make_partitions(ahead=6)
    clock.advance(TODAY - clock())
    for n in range(budgets):
        ledger.create_budget(f"b{n}", 10**12, period="day")
    ledger.create_budget("tight", 1_000, period="day")
    # the empty ledger holds two finished calls from yesterday, for the replay to find
    days = DAYS if calls else 1
    params = {
        "today": TODAY,
        "days": days,
        "calls": max(calls, 2),
        "budgets": budgets,
        "holds": OPEN_HOLDS,
        "owner": LEASE_OWNER,
    }
    with psycopg.connect(_plain(url), autocommit=True) as db:
        db.execute(_PERIODS, params)
        db.execute(_CALLS, params)
        db.execute(_ATTEMPTS, params)
        db.execute(_OPEN, params)
        db.execute(_OPEN_ATTEMPTS, params)
        db.execute(_JOURNAL)
        db.execute(_COUNTERS)
        db.execute("VACUUM ANALYZE")
    findings = ledger.audit(full=True)
    if findings:
        raise RuntimeError(f"the built ledger does not audit clean: {findings[:3]}")
    renew_periods(ledger)
    return Ledgers(url, ledger, clock)


@dataclass
class Result:
    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: operation -> (median ms empty, median ms large)
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)
    sizes_before: dict[str, int] = field(default_factory=dict)
    sizes_after: dict[str, int] = field(default_factory=dict)
    rows_after: tuple[int, int, int] = (0, 0, 0)
    archived: tuple[str, ...] = ()
    retain_seconds: float = 0.0
    audit: list[str] = field(default_factory=list)
    build_seconds: float = 0.0

    def ratio(self, name: str) -> float:
        empty, large = self.timings[name]
        return large / empty


def operations(target: Ledgers) -> dict[str, Callable[[], object]]:
    """What is timed, each a callable on ``target``."""
    ledger = target.ledger

    def cycle() -> None:
        key = target.key()
        ledger.calls.reserve(f"b{target.made % 50}", key, 1000)
        ledger.calls.mark_sending(key)
        ledger.calls.settle(key, 900)

    def replay() -> None:
        start = ledger.calls.admit(
            "op-1" if target.made % 2 else "op-2",
            fingerprint="f",
            owner="bench",
            lease=timedelta(minutes=5),
            max_runs=3,
        )
        assert start.decision.value == "replay", start.decision

    def denial() -> None:
        try:
            ledger.calls.reserve("tight", target.key(), 5_000)
        except BudgetExceeded:
            return
        raise AssertionError("the tight budget admitted")

    return {
        "reserve + mark sending + settle": cycle,
        "replay of a finished operation": replay,
        "denial (budget exceeded)": denial,
        "metrics scrape (report)": ledger.report,
        "holds()": ledger.holds,
        "beat: renew_periods": lambda: renew_periods(ledger),
        "beat: flag_stale": lambda: ledger.upkeep.flag_stale(timedelta(minutes=15)),
        "beat: mark_orphans_unknown": ledger.upkeep.mark_orphans_unknown,
        "beat: purge_operations": lambda: ledger.upkeep.purge_operations(timedelta(days=7)),
        "beat: return_grants": lambda: ledger.upkeep.return_grants(GRANT_IDLE),
        "incremental audit": ledger.audit,
        "retention view": lambda: ledger.upkeep.retention(timedelta(days=120)),
    }


def _median_ms(fn: Callable[[], object], samples: int) -> float:
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


@contextmanager
def _two() -> Iterator[tuple[str, str]]:
    with scratch_database() as empty, scratch_database() as large:
        yield empty, large


def run(calls: int, budgets: int, samples: int, show: Callable[[str], None] = print) -> Result:
    result = Result()
    with _two() as (empty_url, large_url):
        started = time.perf_counter()
        empty = build(empty_url, 0, budgets)
        large = build(large_url, calls, budgets)
        result.build_seconds = time.perf_counter() - started
        show(f"  built both ledgers in {result.build_seconds:.0f} s")
        for name, target in (("empty", empty), ("large", large)):
            with psycopg.connect(_plain(target.url)) as db:
                row = db.execute(_ROWS).fetchone()
                assert row is not None
                result.rows[name] = (int(row[0]), int(row[1]), int(row[2]))
        ops = {"empty": operations(empty), "large": operations(large)}
        for name in ops["empty"]:
            for side in ("empty", "large"):
                ops[side][name]()  # warm-up
            # alternate, in rounds, so that noise on the machine falls on both
            per_side: dict[str, list[float]] = {"empty": [], "large": []}
            for _ in range(ROUNDS):
                for side in ("empty", "large"):
                    per_side[side].append(_median_ms(ops[side][name], max(samples // ROUNDS, 1)))
            result.timings[name] = (
                statistics.median(per_side["empty"]),
                statistics.median(per_side["large"]),
            )
            show(
                f"  {name}: empty {result.timings[name][0]:.2f} ms, "
                f"large {result.timings[name][1]:.2f} ms ({result.ratio(name):.2f}x)"
            )
        with psycopg.connect(_plain(large.url)) as db:
            result.sizes_before = {k: int(v) for k, v in db.execute(_SIZES).fetchall()}
        with tempfile.TemporaryDirectory() as archive:
            started = time.perf_counter()
            done = large.ledger.upkeep.retain(KEEP, archive_to=archive, batch=RETAIN_BATCH)
            result.retain_seconds = time.perf_counter() - started
            result.archived = done.archived
        with psycopg.connect(_plain(large.url), autocommit=True) as db:
            db.execute("VACUUM ANALYZE")
            result.sizes_after = {k: int(v) for k, v in db.execute(_SIZES).fetchall()}
            row = db.execute(_ROWS).fetchone()
            assert row is not None
            result.rows_after = (int(row[0]), int(row[1]), int(row[2]))
        result.audit = [str(f) for t in (empty, large) for f in t.ledger.audit(full=True)]
        for t in (empty, large):
            t.ledger.dispose()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2_000_000)
    parser.add_argument("--budgets", type=int, default=1_000)
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args(argv)
    result = run(args.calls, args.budgets, args.samples)
    print(f"rows (journal, attempts, operations): {result.rows}")
    worst = max(result.ratio(n) for n in result.timings)
    print(f"worst ratio large / empty: {worst:.2f} (target <= {TARGET})")
    print(f"retention archived {result.archived} in {result.retain_seconds:.1f} s")
    for table, before in result.sizes_before.items():
        after = result.sizes_after[table]
        print(f"  {table}: {before / 2**20:,.0f} MiB -> {after / 2**20:,.0f} MiB")
    print(f"rows after: {result.rows_after}; audits: {result.audit or 'clean'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
