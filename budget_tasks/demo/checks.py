"""The demo's final table and the invariants it checks against the ledger and the
provider's own record of what it served and billed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..ledger import Ledger
from ..testing import FakeProvider

Echo = Callable[[str], None]


@dataclass(frozen=True)
class BudgetRow:
    budget: str
    cap: int
    jobs: int
    summarised: int
    denied: int
    replays: int
    reserved: int
    spent: int
    held: int
    overruns: int


class Checks:
    """Prints ``[ok]``/``[FAILED]`` per claim and remembers whether all held."""

    def __init__(self, echo: Echo):
        self.echo = echo
        self.ok = True

    def expect(self, claim: str, held: bool) -> None:
        self.ok &= bool(held)
        self.echo(f"   [{'ok' if held else 'FAILED'}] {claim}")

    def invariants(
        self,
        ledger: Ledger,
        fake: FakeProvider,
        budgets: dict[str, str],
        rows: Sequence[BudgetRow],
        billed: int,
    ) -> None:
        self.echo("\ninvariants")
        self.expect(
            "no budget admitted past its cap (spent + held - overruns <= cap)",
            all(r.spent + r.held - r.overruns <= r.cap for r in rows),
        )
        attempts = {a.key: a for b in budgets.values() for a in ledger.attempts(budget=b)}
        sent = [s for s in fake.served_as(ledger) if s.method == "POST"]
        keys = Counter(s.idempotency_key for s in sent)
        self.expect(
            f"each of the {len(sent)} provider requests carried its own attempt's key, once",
            None not in keys
            and all(n == 1 for n in keys.values())
            and all(k in attempts for k in keys),
        )
        self.expect(
            "no request reached the provider before its reservation was committed",
            all(_sent_after_commit(attempts[str(s.idempotency_key)], s.at) for s in sent),
        )
        self.expect(
            "no hold lost or left: every attempt settled or released, nothing held",
            all(a.state in ("settled", "released") for a in attempts.values())
            and all(r.held == 0 for r in rows),
        )
        spent = sum(r.spent for r in rows)
        self.expect(f"ledger spent {spent} == provider billed {billed}", spent == billed)
        findings = ledger.audit()
        self.expect("audit: every counter equals the sum of its append-only journal", not findings)


def _sent_after_commit(attempt: Any, arrived: float) -> bool:
    sending_at = attempt.sending_at
    if sending_at is None:
        return False
    if sending_at.tzinfo is None:
        sending_at = sending_at.replace(tzinfo=UTC)
    return bool(sending_at <= datetime.fromtimestamp(arrived, UTC))


def budget_rows(ledger: Ledger, budgets: dict[str, str], jobs: Sequence[Any]) -> list[BudgetRow]:
    rows = []
    for tenant, name in budgets.items():
        balance = ledger.balance(name)
        attempts = ledger.attempts(budget=name)
        mine = [j for j in jobs if j.tenant == tenant]
        firsts = {j.document_id: j for j in reversed(mine)}  # first message per document
        operations = [ledger.operation(f"summarize:{d}") for d in firsts]
        rows.append(
            BudgetRow(
                budget=name,
                cap=balance.cap,
                jobs=len(firsts),
                summarised=sum(o.status == "succeeded" for o in operations),
                denied=sum(j.state == "DENIED" for j in firsts.values()),
                replays=sum(o.replays for o in operations),
                reserved=sum(a.amount for a in attempts),
                spent=balance.spent,
                held=balance.held,
                overruns=sum(a.overrun for a in attempts),
            )
        )
    return rows


HEADERS = (
    "budget",
    "cap",
    "jobs",
    "done",
    "denied",
    "replays",
    "reserved*",
    "spent",
    "held",
    "overrun",
)


def render_table(rows: Sequence[BudgetRow]) -> str:
    cells = [
        (
            r.budget,
            r.cap,
            r.jobs,
            r.summarised,
            r.denied,
            r.replays,
            r.reserved,
            r.spent,
            r.held,
            r.overruns,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in column) for column in zip(HEADERS, *cells, strict=True)]
    lines = [
        "   "
        + "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(HEADERS, widths, strict=True))
        )
    ]
    for row in cells:
        lines.append(
            "   "
            + "  ".join(
                str(v).rjust(w) if i else str(v).ljust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append(
        "   * reserved: every hold taken over the run, added up. Each was settled at its "
        "actual cost or released;\n"
        "     the holds open at any one moment never passed the cap (see the first invariant)."
    )
    return "\n".join(lines)
