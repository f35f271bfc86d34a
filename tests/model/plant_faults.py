"""Plant faults in the ledger's server-side functions, one at a time, and run the
tests that should catch each: the audit behind ``docs/mutations.md``'s second table.

    .venv/bin/python -m tests.model.plant_faults [NUMBER ...]

Each fault is one string replacement in a function's text (``budget_tasks/ledger/sql/``),
where two or more features meet. The file is restored after each run, also on an interrupt. A
fault is caught when the tests named beside it fail; the test that freezes the
functions' text (``test_migrations``) is not among them: it would catch every change
without saying which rule broke. Prints one line a fault, and exits 1 if one survived.
Do not run it beside another test run of this checkout: it edits the source.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SQL = ROOT / "budget_tasks" / "ledger" / "sql"
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "--timeout=0"]
#: The PostgreSQL function path of the tests that run on every path.
ON_FUNCTIONS = "pg-functions or postgres or not (pg-statements or sqlite)"


@dataclass(frozen=True)
class Fault:
    number: int
    what: str
    old: str
    new: str
    tests: tuple[str, ...]
    #: how often the text occurs: the escrowed take is written twice, before and after a draw
    times: int = 1


FAULTS = (
    Fault(
        17,
        "An escrowed tenant's admission from its grant ignores a frozen ancestor",
        "AND NOT EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))\n"
        "              AND NOT EXISTS (\n",
        "AND NOT EXISTS (\n",
        ("tests/integration/test_escrow.py", "tests/integration/test_model_stateful.py"),
        times=2,
    ),
    Fault(
        18,
        "An escrowed tenant's admission counts its ancestors' room without what they"
        " granted to its siblings",
        "a.cap - a.spent - a.held - a.granted",
        "a.cap - a.spent - a.held",
        ("tests/integration/test_escrow.py", "tests/integration/test_model_stateful.py"),
        times=2,
    ),
    Fault(
        19,
        "A slice draws its grant as if it were the only one (the draw share ignored)",
        "COALESCE(smallest, 0) / a_draw_share",
        "COALESCE(smallest, 0)",
        (
            "tests/integration/test_slices.py",
            "tests/integration/test_escrow.py",
            "tests/integration/test_features_combined.py",
        ),
    ),
    Fault(
        20,
        "A late charge in a period that carried its rest forward keeps the carry"
        " (rollover with a run's settlement)",
        "           OR (after.carried > 0 AND after.available < after.carried) THEN",
        "           THEN",
        (
            "tests/integration/test_rollover.py",
            "tests/integration/test_features_combined.py",
            "tests/integration/test_model_stateful.py",
        ),
    ),
    Fault(
        21,
        "A run's settlement charges its own budget's period and not its parents'",
        "    -- statements.APPLY_SETTLEMENT, and what must follow it is the statement path's\n"
        "    FOREACH hold IN ARRAY periods LOOP",
        "    -- statements.APPLY_SETTLEMENT, and what must follow it is the statement path's\n"
        "    FOREACH hold IN ARRAY periods[1:1] LOOP",
        ("tests/integration/test_features_combined.py", "tests/integration/test_ledger.py"),
    ),
    Fault(
        22,
        "A frozen parent stops no admission in its subtree (freeze with parents)",
        "            -- statements.ADMIT\n"
        "            UPDATE budget_periods SET held = held + a_amount\n"
        "            WHERE id = hold\n"
        "              AND (cap - spent - held - granted) >= a_amount\n"
        "              AND closed_at IS NULL\n"
        "              AND budget_id IN (SELECT id FROM budgets WHERE NOT frozen);",
        "            -- statements.ADMIT\n"
        "            UPDATE budget_periods SET held = held + a_amount\n"
        "            WHERE id = hold\n"
        "              AND (cap - spent - held - granted) >= a_amount\n"
        "              AND closed_at IS NULL;",
        ("tests/integration/test_ledger.py", "tests/integration/test_model_stateful.py"),
    ),
    Fault(
        23,
        "A run's settlement ends its operation without a completion time (retention"
        " then keeps it for ever)",
        "            updated_at = p_now, completed_at = p_now,\n",
        "            updated_at = p_now,\n",
        ("tests/integration/test_retention.py",),
    ),
    Fault(
        24,
        "A run's settlement records no overrun (an overrun and a parent's roll-up)",
        "overrun = overrun + CASE WHEN p_actual > amount THEN p_actual - amount ELSE 0 END",
        "overrun = overrun",
        ("tests/integration/test_features_combined.py", "tests/integration/test_model_stateful.py"),
    ),
)


def plant(fault: Fault) -> bool:
    """Plant one fault, run its tests on the function path; True if they caught it."""
    holding = [f for f in sorted(SQL.glob("*.sql")) if fault.old in f.read_text()]
    if len(holding) != 1 or holding[0].read_text().count(fault.old) != fault.times:
        raise SystemExit(f"fault {fault.number}: its text is not in one function {fault.times}x")
    (target,) = holding
    original = target.read_text()
    try:
        target.write_text(original.replace(fault.old, fault.new))
        run = subprocess.run(
            [*PYTEST, "-k", ON_FUNCTIONS, *fault.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        target.write_text(original)
    failed = [
        line.split(" ", 2)[1] for line in run.stdout.splitlines() if line.startswith("FAILED ")
    ]
    print(f"{fault.number}: {'caught by ' + failed[0] if failed else 'SURVIVED'}", flush=True)
    if not failed and run.returncode not in (0, 5):
        print(run.stdout[-2000:], run.stderr[-2000:])
    return bool(failed)


def main(numbers: list[str]) -> int:
    chosen = [f for f in FAULTS if not numbers or str(f.number) in numbers]
    survived = [f.number for f in chosen if not plant(f)]
    print("survived:", survived or "none")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
