"""A hypothesis state machine drives the ledger through reserve, send, settle, release,
adjust, freeze, grant returns and period changes, against a plain model of the same
rules: the counters always equal the model and the journal, a repeated settle changes
nothing, and a late settle charges the period of admission.

One budget (``crew``) is escrowed: it admits against grants drawn from ``tenant``;
one (``pool``, a rollover budget) is split into slices, which must not show at all.
The model knows nothing of grants; it counts every hold and charge in each budget of
the chain, as the ledger does without escrow. So the ledger must admit and refuse
exactly as the model does (a grant never makes a refusal or an overspend), and every
budget's figures, its tenants' and slices' rolled in, must be the model's."""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import func, literal, select

from budget_tasks import BudgetExceeded, BudgetFrozen, Ledger, SettlementConflict
from budget_tasks.ledger.periods import period_start
from budget_tasks.ledger.schema import UTCDateTime, budget_periods, budgets
from budget_tasks.testing import ManualClock

# name -> (cap, period, parent, renewal, ceiling), in creation (= budget id) order
BUDGETS: dict[str, tuple[int, str, str | None, str, int | None]] = {
    "tenant": (300, "none", None, "reset", None),
    "team": (120, "day", "tenant", "rollover", 200),
    "solo": (100, "week", None, "reset", None),
    "crew": (90, "day", "tenant", "reset", None),
    "pool": (200, "day", None, "rollover", 400),
}
ESCROWED = {"crew"}
SLICED = {"pool": 3}
ORDER = list(BUDGETS)


def chain(name: str) -> list[str]:
    out = [name]
    while (parent := BUDGETS[out[-1]][2]) is not None:
        out.append(parent)
    return sorted(out, key=ORDER.index)


class LedgerMachine(RuleBasedStateMachine):
    url: str

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.ledger = Ledger(self.url, clock=self.clock)
        self.prefix = uuid.uuid4().hex[:8] + "-"
        for name, (cap, period, parent, renewal, ceiling) in BUDGETS.items():
            self.ledger.create_budget(
                self.prefix + name,
                cap,
                period=period,  # type: ignore[arg-type]
                parent=None if parent is None else self.prefix + parent,
                renewal=renewal,
                rollover_ceiling=ceiling,  # type: ignore[arg-type]
                escrow=name in ESCROWED,
                slices=SLICED.get(name, 1),
            )
        # cap, spent, held, carried_out, closed (0/1), and of spent and held what escrowed
        # budgets below spent and held (the ledger counts those as granted)
        self.periods: dict[tuple[str, datetime], list[int]] = {}
        self.attempts: dict[str, dict[str, Any]] = {}
        self.frozen: set[str] = set()
        self.count = 0

    def teardown(self) -> None:
        self.ledger.dispose()

    # -- model ---------------------------------------------------------------------

    def start(self, name: str) -> datetime:
        return period_start(BUDGETS[name][1], self.clock())  # type: ignore[arg-type]

    def open(self, name: str) -> list[int]:
        """Admission opens the budget's current period, closing the earlier ones; the
        one just before carries what it left unused, by the renewal policy."""
        key = (name, self.start(name))
        if key not in self.periods:
            allowance, period, _, renewal, ceiling = BUDGETS[name]
            cap = allowance
            prev_at = key[1] - timedelta(microseconds=1)
            prev_key = (name, period_start(period, prev_at))  # type: ignore[arg-type]
            prev = self.periods.get(prev_key)
            if renewal == "rollover" and prev is not None and not prev[4]:
                unused = max(0, prev[0] - prev[1] - prev[2])
                cap = max(allowance, min(ceiling or 3 * allowance, allowance + unused))
                prev[3] = cap - allowance
            for (other, _), row in self.periods.items():
                if other == name:
                    row[4] = 1
            self.periods[key] = [cap, 0, 0, 0, 0, 0, 0]
        return self.periods[key]

    def changed(self, period: tuple[str, datetime]) -> None:
        """A closed period that carried, now with less unused than it carried: the
        difference comes off the next period's cap, and on, if that one carried it on."""
        row = self.periods[period]
        available = row[0] - row[1] - row[2]
        if row[3] > 0 and available < row[3]:
            deficit = row[3] - max(available, 0)
            row[3] -= deficit
            later = sorted(k for k in self.periods if k[0] == period[0] and k[1] > period[1])
            self.periods[later[0]][0] -= deficit
            self.changed(later[0])

    def keys_in(self, *states: str) -> list[str]:
        return sorted(k for k, a in self.attempts.items() if a["state"] in states)

    # -- rules ---------------------------------------------------------------------

    @rule(name=st.sampled_from(ORDER), amount=st.integers(0, 150))
    def reserve(self, name: str, amount: int) -> None:
        self.count += 1
        key = f"{self.prefix}k{self.count}"
        rows = {b: self.open(b) for b in chain(name)}
        refusal: type[Exception] | None = None
        # an escrowed budget reads the chain's freezes first, then its own cap, then
        # (drawing) its ancestors'; any other, budget by budget in id order
        order = list(rows)
        if name in ESCROWED:
            frozen = [b for b in order if b in self.frozen]
            order = frozen[:1] if frozen else [name] + [b for b in order if b != name]
        for b in order:
            row = rows[b]
            if b in self.frozen:
                refusal, limit = BudgetFrozen, b
                break
            if row[0] - row[1] - row[2] < amount:
                refusal, limit = BudgetExceeded, b
                break
        if refusal is not None:
            with pytest.raises(refusal) as info:
                self.ledger.calls.reserve(self.prefix + name, key, amount)
            assert info.value.budget == self.prefix + limit
            return
        assert self.ledger.calls.reserve(self.prefix + name, key, amount).created
        for b, row in rows.items():
            row[2] += amount
            if self.granted(name, b):
                row[6] += amount
        self.attempts[key] = {
            "budget": name,
            "amount": amount,
            "state": "reserved",
            "actual": None,
            "periods": [(b, self.start(b)) for b in rows],
        }

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.attempts)))
        a = self.attempts[key]
        for b in chain(a["budget"]):
            self.open(b)  # a reservation call opens the current periods, key known or not
        again = self.ledger.calls.reserve(self.prefix + a["budget"], key, a["amount"])
        assert not again.created
        assert again.state == a["state"]

    @precondition(lambda self: self.keys_in("reserved"))
    @rule(data=st.data())
    def send(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys_in("reserved")))
        self.ledger.calls.mark_sending(key, provider="fake")
        self.attempts[key]["state"] = "sending"

    @precondition(lambda self: self.keys_in("sending"))
    @rule(data=st.data())
    def time_out(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys_in("sending")))
        assert self.ledger.calls.mark_unknown(key, "timeout")
        self.attempts[key]["state"] = "unknown"

    def granted(self, name: str, budget: str) -> bool:
        """Whether the ledger counts ``name``'s calls in ``budget`` as a grant."""
        return name in ESCROWED and budget != name

    def _resolve(self, key: str, actual: int, state: str) -> None:
        a = self.attempts[key]
        for period in a["periods"]:
            self.periods[period][2] -= a["amount"]
            self.periods[period][1] += actual
            if self.granted(a["budget"], period[0]):
                self.periods[period][6] -= a["amount"]
                self.periods[period][5] += actual
            self.changed(period)
        a.update(state=state, actual=actual, charged=actual)

    @precondition(lambda self: self.keys_in("sending", "unknown"))
    @rule(data=st.data(), actual=st.integers(0, 200))
    def settle(self, data: st.DataObject, actual: int) -> None:
        key = data.draw(st.sampled_from(self.keys_in("sending", "unknown")))
        assert self.ledger.calls.settle(key, actual) is True
        self._resolve(key, actual, "settled")

    @precondition(lambda self: self.keys_in("reserved", "sending", "unknown"))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.keys_in("reserved", "sending", "unknown")))
        assert self.ledger.calls.release(key, "not billed") is True
        self._resolve(key, 0, "released")

    @precondition(lambda self: self.keys_in("settled", "released"))
    @rule(data=st.data(), other=st.integers(1, 50))
    def settle_again(self, data: st.DataObject, other: int) -> None:
        key = data.draw(st.sampled_from(self.keys_in("settled", "released")))
        a = self.attempts[key]
        if a["state"] == "settled":
            assert self.ledger.calls.settle(key, a["actual"]) is False
        else:
            assert self.ledger.calls.release(key, "again") is False
        with pytest.raises(SettlementConflict):
            self.ledger.calls.settle(key, a["actual"] + other)

    @precondition(lambda self: self.keys_in("settled", "released"))
    @rule(data=st.data(), delta=st.integers(-50, 50).filter(bool))
    def adjust(self, data: st.DataObject, delta: int) -> None:
        key = data.draw(st.sampled_from(self.keys_in("settled", "released")))
        a = self.attempts[key]
        if a["charged"] + delta < 0:
            with pytest.raises(ValueError, match="below zero"):
                self.ledger.adjust(key, delta, "correction")
            return
        assert self.ledger.adjust(key, delta, "correction")
        a["charged"] += delta  # the settlement itself stays as it was
        for period in a["periods"]:
            self.periods[period][1] += delta
            if self.granted(a["budget"], period[0]):
                self.periods[period][5] += delta
            self.changed(period)

    @rule(idle_minutes=st.sampled_from([0, 5]))
    def return_grants(self, idle_minutes: int) -> None:
        # what a grant leaves unused goes back; the model has nothing to change
        self.ledger.upkeep.return_grants(timedelta(minutes=idle_minutes))

    @rule(name=st.sampled_from(ORDER), frozen=st.booleans())
    def freeze(self, name: str, frozen: bool) -> None:
        # the freeze's journal row goes into the budget's current period: it opens it
        self.open(name)
        if frozen:
            self.ledger.freeze(self.prefix + name)
            self.frozen.add(name)
        else:
            self.ledger.unfreeze(self.prefix + name)
            self.frozen.discard(name)

    @rule(hours=st.integers(1, 200))
    def advance(self, hours: int) -> None:
        self.clock.advance(hours=hours)

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def counters_match_the_model_and_the_journal(self) -> None:
        # by the parent's period: what grants hold unused
        unused: dict[tuple[str, datetime], int] = {}
        for name, start in self.periods:
            if name in ESCROWED:
                bal = self.ledger.balance(self.prefix + name, at=start)
                assert bal.drawn >= bal.spent + bal.held  # never admitted past its grant
                parent = BUDGETS[name][2]
                assert parent is not None
                at = (parent, period_start(BUDGETS[parent][1], start))  # type: ignore[arg-type]
                unused[at] = unused.get(at, 0) + bal.drawn - bal.spent - bal.held
        for (name, start), row in self.periods.items():
            cap, spent, held, *_ = row
            bal = self.ledger.balance(self.prefix + name, at=start)
            # a budget's figures are its whole tree's; what grants below hold unused is
            # shown apart, and is available
            assert (bal.cap, bal.spent, bal.held) == (cap, spent, held), (name, start)
            left = unused.get((name, start), 0) + self.unused_in_slices(name, start)
            assert bal.granted == left, (name, start)
            assert bal.available == cap - spent - held
        assert self.ledger.audit() == []

    def unused_in_slices(self, name: str, start: datetime) -> int:
        """What a sliced budget's slices hold of their grants unused in its period."""
        if name not in SLICED:
            return 0
        owner = self.ledger.budget(self.prefix + name).id
        with self.ledger.engine.connect() as conn:
            found = conn.execute(
                select(
                    func.coalesce(
                        func.sum(
                            budget_periods.c.drawn - budget_periods.c.spent - budget_periods.c.held
                        ),
                        0,
                    )
                )
                .select_from(
                    budget_periods.join(budgets, budgets.c.id == budget_periods.c.budget_id)
                )
                .where(budgets.c.slice_of == owner)
                .where(budget_periods.c.period_start == literal(start, UTCDateTime()))
            ).scalar_one()
        return int(found)

    @invariant()
    def holds_are_exactly_the_open_attempts(self) -> None:
        mine = [h for h in self.ledger.holds() if h.key.startswith(self.prefix)]
        assert sorted((h.key, h.amount) for h in mine) == sorted(
            (k, self.attempts[k]["amount"]) for k in self.keys_in("reserved", "sending", "unknown")
        )


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_ledger_state_machine(backend: str, request: pytest.FixtureRequest) -> None:
    # an empty ledger: the audit reads every budget, and earlier tests leave theirs
    # (one on purpose with a corrupted counter)
    request.getfixturevalue("pg_ledger" if backend == "postgres" else "sqlite_url")
    url = request.getfixturevalue("pg_url" if backend == "postgres" else "sqlite_url")

    class Machine(LedgerMachine):
        pass

    Machine.url = url
    run_state_machine_as_test(
        Machine,
        settings=settings(
            # BUDGET_TASKS_FUZZ_EXAMPLES=500 for a longer hunt than the suite's
            max_examples=int(os.environ.get("BUDGET_TASKS_FUZZ_EXAMPLES", "30")),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
