"""Hot budgets: tenants under one parent (with escrow and without) and one budget
shared by every process (in slices and not), against the same processes each on a
budget alone, in the same run: admit + settle cycles per second through ``Ledger``.

    .venv/bin/python benchmarks/hot_budgets.py [--seconds 4] [--procs 8 32] [--rounds 2]

Each process is one tenant and runs reserve (granted) + settle as fast as it can.
Shapes, each in its own budgets of one scratch database, vacuumed before each round
(autovacuum is off on these machines):

- alone: each tenant a budget of its own, no parent (the baseline);
- under a parent: each tenant under one parent, every admission and settlement also
  writing the parent's period row;
- escrow: the same, the tenants escrowed (``create_budget(escrow=True)``);
- escrow, grants of the need: escrowed, each grant exactly what the admission needs,
  as near a parent's cap (its last money), where every admission draws;
- one budget: every process on the same budget;
- one budget in 8 slices: the same budget split into 8 slices (``slices=8``).

Prints cycles per second, MultiXacts per cycle and client CPU per cycle for each, and
the ratios to ``alone``; the targets are escrow / alone >= 0.9 and one budget in 8
slices / alone >= 0.9.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ledger_bench import (  # noqa: E402
    ADMIN_URL,
    _next_multixact,
    _vacuumed,
    library_worker,
    scratch_database,
)
from budget_tasks import Ledger  # noqa: E402
from budget_tasks.demo.processes import race  # noqa: E402

TARGET = 0.9
SHAPES = (
    "alone",
    "under a parent",
    "escrow",
    "escrow, grants of the need",
    "one budget",
    "one budget in 8 slices",
)
PREFIX = dict(zip(SHAPES, ("alone", "direct", "esc", "near", "one", "sliced"), strict=True))
#: the shapes whose every process admits on one budget
SHARED = {"one budget", "one budget in 8 slices"}
TARGETS = ("escrow", "one budget in 8 slices")


def tenant_worker(
    url: str, budget: str, tag: str, seconds: float, warmup: float, need_only: bool
) -> tuple[int, float]:
    if need_only:
        # Near a parent's cap a grant is what the admission needs: forced here.
        import budget_tasks.ledger.escrow as escrow

        escrow.GRANT_SHARE = 10**18
    return library_worker(url, tag, seconds, warmup, budget)


def make_budgets(ledger: Ledger, procs: int) -> None:
    money = 10**15
    ledger.create_budget(f"direct-org-{procs}", money)
    ledger.create_budget(f"esc-org-{procs}", money)
    ledger.create_budget(f"near-org-{procs}", money)
    ledger.create_budget(f"one-{procs}", money)
    ledger.create_budget(f"sliced-{procs}", money, slices=8)
    for i in range(procs):
        ledger.create_budget(f"alone-{procs}-{i}", money)
        ledger.create_budget(f"direct-{procs}-{i}", money, parent=f"direct-org-{procs}")
        ledger.create_budget(f"esc-{procs}-{i}", money, parent=f"esc-org-{procs}", escrow=True)
        ledger.create_budget(f"near-{procs}-{i}", money, parent=f"near-org-{procs}", escrow=True)


def one_round(url: str, shape: str, procs: int, seconds: float) -> tuple[float, float, float]:
    """Cycles per second, MultiXacts per cycle, client CPU ms per cycle."""
    _vacuumed(url)
    before = _next_multixact(ADMIN_URL)
    tag = uuid.uuid4().hex[:8]
    calls = [
        (
            url,
            f"{PREFIX[shape]}-{procs}" if shape in SHARED else f"{PREFIX[shape]}-{procs}-{i}",
            f"{tag}-{i}",
            seconds,
            1.0,
            shape.endswith("need"),
        )
        for i in range(procs)
    ]
    results = race(tenant_worker, calls)
    cycles = sum(done for done, _ in results)
    made = _next_multixact(ADMIN_URL) - before
    cpu = 1000.0 * sum(spent for _, spent in results) / max(cycles, 1)
    return cycles / seconds, made / max(cycles, 1), cpu


@dataclass
class HotRow:
    """One process count: each shape's rounds (cycles/s) and medians."""

    procs: int
    rounds: dict[str, list[float]]
    multixacts: dict[str, float]
    cpu_ms: dict[str, float]

    def rate(self, shape: str) -> float:
        return statistics.median(self.rounds[shape])

    def ratio(self, shape: str) -> float:
        return self.rate(shape) / self.rate("alone")


@dataclass
class HotResult:
    rows: list[HotRow]
    audit: list[str]


def run(
    procs: list[int],
    seconds: float,
    rounds: int,
    report: Callable[[int, str, float, float, float], None] | None = None,
) -> HotResult:
    """Every shape at each process count, ``rounds`` times, in one scratch database."""
    rows = []
    with scratch_database() as url:
        ledger = Ledger(url)
        ledger.create_schema()
        for n in procs:
            make_budgets(ledger, n)
        for n in procs:
            row = HotRow(n, {shape: [] for shape in SHAPES}, {}, {})
            for _ in range(rounds):
                for shape in SHAPES:
                    rate, multixacts, cpu = one_round(url, shape, n, seconds)
                    row.rounds[shape].append(rate)
                    # the last round's: autovacuum is off, each round is vacuumed first
                    row.multixacts[shape], row.cpu_ms[shape] = multixacts, cpu
                    if report is not None:
                        report(n, shape, rate, multixacts, cpu)
            rows.append(row)
        audit = [str(finding) for finding in ledger.audit()]
        ledger.dispose()
    return HotResult(rows, audit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--procs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    def show(n: int, shape: str, rate: float, multixacts: float, cpu: float) -> None:
        print(
            f"{n:3d} processes, {shape:27s}: {rate:6.0f} cycles/s, "
            f"{multixacts:.2f} MultiXacts per cycle, {cpu:.2f} ms client CPU",
            flush=True,
        )

    result = run(args.procs, args.seconds, args.rounds, show)
    missed = False
    for row in result.rows:
        for shape in SHAPES[1:]:
            print(f"{row.procs:3d} processes: {shape} / alone = {row.ratio(shape):.2f}")
        for shape in TARGETS:
            if row.ratio(shape) < TARGET:
                missed = True
                print(
                    f"{row.procs:3d} processes: {shape} / alone {row.ratio(shape):.2f} < {TARGET}"
                )
    print(f"audit after the run: {'; '.join(result.audit) or 'clean'}")
    return 1 if result.audit or missed else 0


if __name__ == "__main__":
    sys.exit(main())
