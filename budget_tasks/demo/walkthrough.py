"""The ledger walk-through (`budget-tasks walkthrough`): the ledger alone, no Celery.

It runs real work on the embedded SQLite default (or any ledger URL): processes race
for one budget, a redelivered key replays, an overrun is recorded, an unknown outcome
keeps its hold, a late correction is journalled, and the audit checks the counters.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import BudgetExceeded, BudgetFrozen
from ..ledger import Ledger
from .processes import race

Echo = Callable[[str], None]


def _racer(url: str, index: int) -> str:
    ledger = Ledger(url)
    try:
        ledger.calls.reserve("support-bot", f"ticket:{index}", 30_000)
        return "admitted"
    except BudgetExceeded:
        return "denied"
    finally:
        ledger.dispose()


def run(url: str | None = None, *, workers: int = 8, echo: Echo = print) -> bool:
    """Run the walk-through; True if every invariant it checks held."""
    with tempfile.TemporaryDirectory(prefix="budget-tasks-demo-") as tmp:
        url = url or f"sqlite:///{Path(tmp) / 'ledger.db'}"
        return _walk(url, workers, echo)


def _walk(url: str, workers: int, echo: Echo) -> bool:
    ok = True

    def expect(claim: str, held: bool) -> None:
        nonlocal ok
        ok &= held
        echo(f"  [{'ok' if held else 'FAILED'}] {claim}")

    ledger = Ledger(url)
    ledger.create_schema()
    echo(f"ledger: {ledger.url}")
    ledger.create_budget("acme", 200_000, tenant="acme")
    ledger.create_budget("support-bot", 100_000, parent="acme", period="day", tenant="acme")
    echo("budgets: acme (cap 200000 micro-USD) > support-bot (cap 100000 per day)")

    echo(f"\n1. {workers} processes each reserve 30000 on support-bot at the same instant")
    outcomes = race(_racer, [(url, i) for i in range(workers)])
    admitted = outcomes.count("admitted")
    echo(f"   admitted {admitted}, denied {outcomes.count('denied')}")
    expect("exactly 3 admitted (3 x 30000 <= 100000 < 4 x 30000)", admitted == min(3, workers))
    bal = ledger.balance("support-bot")
    expect(f"held {bal.held} == admitted x 30000", bal.held == admitted * 30_000)

    echo("\n2. the same key is delivered again (a Celery redelivery)")
    winners = [a.key for a in ledger.attempts(budget="support-bot")]
    again = ledger.calls.reserve("support-bot", winners[0], 30_000)
    expect(
        f"{winners[0]} replays: created={again.created}, no second hold",
        not again.created and ledger.balance("support-bot").held == bal.held,
    )

    echo("\n3. the attempts are sent and settle with the provider's usage")
    ledger.calls.mark_sending(winners[0], provider="openai", request_id="req_demo_1")
    ledger.calls.settle(winners[0], 21_450)
    ledger.calls.mark_sending(winners[1], provider="openai", request_id="req_demo_2")
    ledger.calls.settle(winners[1], 34_100)
    overrun = ledger.attempt(winners[1]).overrun
    echo(f"   {winners[0]}: reserved 30000, charged 21450")
    echo(f"   {winners[1]}: reserved 30000, charged 34100 (overrun {overrun}, recorded)")
    expect("the overrun is recorded, not hidden", overrun == 4_100)
    expect(
        "settling again with the same actual changes nothing",
        ledger.calls.settle(winners[0], 21_450) is False,
    )

    echo("\n4. a timeout: the outcome is unknown, the hold stays")
    ledger.calls.mark_sending(winners[2], provider="openai")
    ledger.calls.mark_unknown(winners[2], "read timeout after 60s")
    holds = ledger.holds()
    expect(
        "the unknown attempt keeps its 30000 hold",
        [(h.key, h.state, h.amount) for h in holds] == [(winners[2], "unknown", 30_000)],
    )

    echo("\n5. the provider later reports a correction to a settled attempt")
    ledger.adjust(winners[0], 550, "provider usage correction", ref="inv-2026-11-0042")
    ledger.adjust(winners[0], 550, "provider usage correction", ref="inv-2026-11-0042")
    expect("the correction is journalled once", ledger.balance("support-bot").spent == 56_100)

    echo("\n6. the tenant is frozen")
    ledger.freeze("acme")
    try:
        ledger.calls.reserve("support-bot", "ticket:late", 1_000)
        expect("a frozen parent admits nothing", False)
    except BudgetFrozen as exc:
        expect(f"a frozen parent admits nothing ({exc})", True)

    echo("\nbalances")
    echo(f"   {'budget':<12} {'cap':>8} {'spent':>8} {'held':>8} {'available':>10}")
    for name in ("acme", "support-bot"):
        b = ledger.balance(name)
        echo(f"   {name:<12} {b.cap:>8} {b.spent:>8} {b.held:>8} {b.available:>10}")
    findings = ledger.audit()
    expect("audit: every counter equals the sum of the append-only journal", findings == [])
    ledger.dispose()
    echo("\nall invariants held" if ok else "\nSOME INVARIANTS FAILED")
    return ok
