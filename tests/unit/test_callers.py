"""The ledger by caller: four plain classes over one store, each owning its methods'
code (no mixins, no forwarding descriptors), the operator's API narrow and the
delivery's protocol apart from it."""

from __future__ import annotations

import inspect

import pytest

from budget_tasks import Ledger
from budget_tasks.ledger import CallLedger, Upkeep, Views
from budget_tasks.ledger.store import Store

CALLERS = (Ledger, CallLedger, Upkeep, Views)


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("cls", CALLERS, ids=lambda c: c.__name__)
def test_each_callers_class_defines_its_own_methods(cls: type) -> None:
    assert cls.__mro__ == (cls, object)  # nothing inherited
    for name in public(cls):
        member = cls.__dict__[name]
        if isinstance(member, property):
            continue
        assert inspect.isfunction(member), (cls.__name__, name)
        assert member.__qualname__ == f"{cls.__name__}.{name}"
        assert member.__doc__, (cls.__name__, name)


@pytest.mark.parametrize(
    "name",
    ["reserve", "mark_sending", "admit", "admit_call", "end_call", "end_run", "open_period"],
)
def test_the_operators_ledger_does_not_offer_the_delivery_protocol(name: str) -> None:
    assert not hasattr(Ledger, name)


def test_the_operators_api_is_about_fifteen_methods() -> None:
    lifecycle = {"create_schema", "dispose", "now", "provider_key", "engine", "url"}
    operator = public(Ledger) - lifecycle - {"calls", "upkeep", "views", "rates"}
    assert len(operator) <= 20, sorted(operator)


def test_the_callers_share_one_store(tmp_path: pytest.TempPathFactory) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path}/callers.db")
    ledger.create_schema()
    callers = (ledger, ledger.calls, ledger.upkeep, ledger.views, ledger.rates)
    stores = {id(c._store) for c in callers}
    assert len(stores) == 1 and isinstance(ledger._store, Store)
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 40)
    assert ledger.balance("acme").held == 40
    assert [h.key for h in ledger.holds()] == ["k"]
    assert ledger.views.report()[0].held == 40
    assert ledger.calls.url == ledger.upkeep.url == ledger.views.url == ledger.url
    ledger.dispose()
