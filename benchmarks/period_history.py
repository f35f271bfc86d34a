"""``report()`` (what a metrics scrape and ``budget-tasks status`` read) and ``holds()``
on 1,000 daily budgets with 90 days of closed periods behind them (91,000 periods),
against the same budgets with only today's period, in the same run.

    .venv/bin/python benchmarks/period_history.py [--budgets 1000] [--days 90]

Two scratch databases, filled in bulk and vacuumed; each call is timed 15 times after
one warm-up, the median reported. The report reads each budget's current period by its
start through the index on ``period_start`` (migration 0012): the target is a ratio
near 1, where a join on the computed start scanned every period (2x at 91,000).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ledger_bench import scratch_database  # noqa: E402
from budget_tasks import Ledger  # noqa: E402
from budget_tasks.testing import ManualClock  # noqa: E402

TODAY = datetime(2026, 6, 1, 12, tzinfo=UTC)
HISTORY = """
INSERT INTO budget_periods (budget_id, period_start, cap, spent, held, opened_at, closed_at)
SELECT b.id, d, 1000000000, 100, 0, d,
       CASE WHEN d < date_trunc('day', %(today)s::timestamptz) THEN d + interval '1 day' END
FROM budgets b, generate_series(
    date_trunc('day', %(today)s::timestamptz) - make_interval(days => %(days)s),
    date_trunc('day', %(today)s::timestamptz), interval '1 day') AS d"""


def median_ms(fn: Callable[[], object], samples: int = 15) -> float:
    fn()
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def measure(budgets: int, days: int) -> tuple[int, float, float]:
    """Periods, and the median ms of report() and holds(), on a fresh database."""
    with scratch_database() as url:
        ledger = Ledger(url, clock=ManualClock(TODAY))
        ledger.create_schema()
        for n in range(budgets):
            ledger.create_budget(f"b{n}", 10**9, period="day")
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as db:
            db.execute(HISTORY, {"today": TODAY, "days": days})
            db.execute("VACUUM ANALYZE")
            row = db.execute("SELECT count(*) FROM budget_periods").fetchone()
        periods = int(row[0]) if row is not None else 0
        report, holds = median_ms(ledger.report), median_ms(ledger.holds)
        ledger.dispose()
        return periods, report, holds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, default=1000)
    parser.add_argument("--days", type=int, default=90)
    args = parser.parse_args(argv)
    empty = measure(args.budgets, 0)
    full = measure(args.budgets, args.days)
    for label, (periods, report, holds) in (("today only", empty), ("with history", full)):
        print(f"{label:12s} {periods:7d} periods: report {report:6.1f} ms, holds {holds:5.1f} ms")
    print(
        f"history / today only: report {full[1] / empty[1]:.2f}x, holds {full[2] / empty[2]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
