"""Admit + settle cycles per second through ``Ledger`` on one hot budget, with the
references to the budget and its period checked at COMMIT (the schema since migration
0010) against the same references checked at each INSERT (before it), in the same run.

    .venv/bin/python benchmarks/hot_row_keys.py [--seconds 4] [--procs 8 32] [--rounds 2]

One scratch database; before each round its three hot foreign keys are switched (ALTER
CONSTRAINT) and it is vacuumed. Each round reports cycles per second, the MultiXacts
each cycle made (``next_multixact_id`` across a CHECKPOINT) and the client CPU per
cycle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ledger_bench import (  # noqa: E402
    ADMIN_URL,
    _round,
    library_worker,
    scratch_database,
)
from budget_tasks import Ledger  # noqa: E402

HOT_KEYS = (
    ("attempts", "fk_attempts_budget_id_budgets"),
    ("attempts", "fk_attempts_period_id_budget_periods"),
    ("journal", "fk_journal_period_id_budget_periods"),
)
MODES = {"at INSERT": "NOT DEFERRABLE", "at COMMIT": "DEFERRABLE INITIALLY DEFERRED"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--procs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with scratch_database() as url:
        ledger = Ledger(url)
        ledger.create_schema()
        ledger.create_budget("hot", 10**15)
        ledger.upkeep.open_period("hot")
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as db:
            for procs in args.procs:
                rates: dict[str, list[float]] = {mode: [] for mode in MODES}
                for _ in range(args.rounds):
                    for mode, ddl in MODES.items():
                        for table, key in HOT_KEYS:
                            db.execute(f"ALTER TABLE {table} ALTER CONSTRAINT {key} {ddl}")
                        rate, cpu, _, multixacts = _round(
                            ADMIN_URL, url, library_worker, procs, args.seconds, 1.0
                        )
                        rates[mode].append(rate)
                        print(
                            f"{procs:3d} processes, checked {mode:9s}: {rate:6.0f} cycles/s, "
                            f"{multixacts:.2f} MultiXacts per cycle, {cpu:.2f} ms client CPU",
                            flush=True,
                        )
                ratio = statistics.median(rates["at COMMIT"]) / statistics.median(
                    rates["at INSERT"]
                )
                print(f"{procs:3d} processes: at COMMIT / at INSERT = {ratio:.2f}")
        audit = ledger.audit()
        ledger.dispose()
        print(f"audit after the run: {audit or 'clean'}")
        return 1 if audit else 0


if __name__ == "__main__":
    sys.exit(main())
