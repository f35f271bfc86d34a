"""Plant faults in the ledger's server-side functions and its rate windows' rules, one at
a time, and run the tests that should catch each: the audit behind
``docs/mutations.md``'s second and later tables.

    .venv/bin/python -m tests.model.plant_faults [NUMBER ...]

Each fault is one string replacement in a function's text (``budget_tasks/ledger/sql/``)
or in the file it names, where two or more features meet. The file is restored after
each run, also on an interrupt. A fault is caught when the tests named beside it fail;
the test that freezes the functions' text (``test_migrations``) is not among them: it
would catch every change without saying which rule broke. Prints one line a fault, and
exits 1 if one survived. Do not run it beside another test run of this checkout: it
edits the source.
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
STATEMENTS = "budget_tasks/ledger/statements.py"
LINES = "tests/integration/test_rate_lines.py"
ADMISSION = "tests/integration/test_rate_admission.py"
MODEL = "tests/integration/test_model_stateful.py"


#: The statement paths (PostgreSQL's statements, SQLite) of the tests that run on every
#: path, and those that run on one database only.
ON_STATEMENTS = "pg-statements or sqlite or not (pg-function or pg-functions or postgres)"


@dataclass(frozen=True)
class Fault:
    number: int
    what: str
    old: str
    new: str
    tests: tuple[str, ...]
    #: how often the text occurs: the escrowed take is written twice, before and after a draw
    times: int = 1
    #: the file it is planted in (from the project's root); none: a function of ``sql/``
    path: str = ""
    #: which tests of ``tests`` run (``-k``): a function's, its path's
    select: str = ON_FUNCTIONS


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
    # -- issue 54: rate windows' lines when the world changes ---------------------------
    Fault(
        25,
        "An answer's headers narrow a window as if no call waited in its line (statement"
        " path): the calls in line go out into the provider's 429",
        'ELSE {_SEEN_CAP} END) - booked)"""',
        'ELSE {_SEEN_CAP} END))"""',
        (LINES, ADMISSION, MODEL),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        26,
        "The same in the settlement function",
        "END) - booked)",
        "END))",
        (LINES, MODEL),
        times=9,
    ),
    Fault(
        27,
        "A booked call's turn counts only its own ask, not the calls ahead of it in line",
        "(o.tag < t.tag OR (o.tag = t.tag AND o.arrival <= t.arrival))",
        "o.key = t.key",
        (LINES, ADMISSION, MODEL),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        28,
        "Every call shares its windows as one tenant (a flooding tenant's line first)",
        "    return (budgets[0] if budgets else 0), DEFAULT_WEIGHT",
        "    return 0, DEFAULT_WEIGHT",
        (LINES, ADMISSION),
        path="budget_tasks/ledger/rate_takes.py",
        select=ON_STATEMENTS,
    ),
    Fault(
        29,
        "A booking sent leaves the line's present where it was (a tenant back from idling"
        " goes ahead of the whole line)",
        "vtime = CASE WHEN CAST(:tag AS BIGINT) > vtime THEN CAST(:tag AS BIGINT) ELSE vtime END",
        "vtime = vtime",
        (LINES, MODEL),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        30,
        "A booking dropped stays counted in its window's line (the calls behind it are"
        " told their turns too early)",
        "    booked = booked - {_BACK}\nWHERE id = :id",
        "    booked = booked\nWHERE id = :id",
        (LINES, ADMISSION, MODEL),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        31,
        "A lowered limit keeps at most an hour of its line (as before issue 54): the rest"
        " of the calls in line are told turns that never come",
        "< -excluded.per_minute * 2880000\n        THEN -excluded.per_minute * 2880000 ELSE",
        "< -excluded.per_minute * 60000\n        THEN -excluded.per_minute * 60000 ELSE",
        (LINES, ADMISSION, MODEL),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        32,
        "An answer stating a limit above the window's raises it (settlement function)",
        "took.own AND stated < per_minute",
        "took.own AND stated IS NOT NULL",
        (LINES,),
        times=12,
    ),
    Fault(
        33,
        "The same on the statement path",
        "CAST(:limit AS BIGINT) < per_minute",
        "CAST(:limit AS BIGINT) IS NOT NULL",
        (LINES, ADMISSION),
        path=STATEMENTS,
        select=ON_STATEMENTS,
    ),
    Fault(
        34,
        "An answer's rate headers are read at this host's clock, not the ledger's",
        "            return self.scoped.scope.ledger.now()\n",
        "            return datetime.now(UTC)\n",
        ("tests/integration/test_rate_headers_clock.py",),
        path="budget_tasks/transport/flow.py",
        select="sqlite or postgres",
    ),
)


def plant(fault: Fault) -> bool:
    """Plant one fault, run its tests on its path; True if they caught it."""
    files = [ROOT / fault.path] if fault.path else sorted(SQL.glob("*.sql"))
    holding = [f for f in files if fault.old in f.read_text()]
    if len(holding) != 1 or holding[0].read_text().count(fault.old) != fault.times:
        raise SystemExit(f"fault {fault.number}: its text is not in one file {fault.times}x")
    (target,) = holding
    original = target.read_text()
    try:
        target.write_text(original.replace(fault.old, fault.new))
        run = subprocess.run(
            [*PYTEST, "-k", fault.select, *fault.tests],
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
