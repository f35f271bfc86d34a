"""The ledger's three faces: the operator's API stays narrow, the delivery's protocol
lives apart from it, and every public method of the core is offered by a face."""

from __future__ import annotations

import inspect

import pytest

from budget_tasks import Ledger
from budget_tasks.ledger import CallLedger, Upkeep, Views
from budget_tasks.ledger.core import LedgerCore


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_every_public_method_of_the_core_is_offered_by_a_face() -> None:
    core = {n for n in public(LedgerCore) if callable(getattr(LedgerCore, n))}
    offered = public(Ledger) | public(CallLedger) | public(Upkeep) | public(Views)
    assert core - offered == {"installation_id"}  # the core's own, behind provider_key


@pytest.mark.parametrize(
    "name",
    ["reserve", "mark_sending", "admit", "admit_call", "end_call", "end_run", "open_period"],
)
def test_the_operators_ledger_does_not_offer_the_delivery_protocol(name: str) -> None:
    assert not hasattr(Ledger, name)


def test_the_operators_api_is_about_fifteen_methods() -> None:
    lifecycle = {"create_schema", "dispose", "now", "provider_key", "engine", "url"}
    operator = public(Ledger) - lifecycle - {"calls", "upkeep", "views"}
    assert len(operator) <= 20, sorted(operator)


def test_a_face_offers_the_cores_method_with_its_signature_and_docstring() -> None:
    offer = Ledger.__dict__["create_budget"]
    assert offer.__doc__ == LedgerCore.create_budget.__doc__
    assert inspect.signature(offer.__wrapped__) == inspect.signature(LedgerCore.create_budget)


def test_the_faces_share_one_core(tmp_path: pytest.TempPathFactory) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path}/faces.db")
    ledger.create_schema()
    ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "k", 40)
    assert ledger.balance("acme").held == 40
    assert [h.key for h in ledger.holds()] == ["k"]
    assert ledger.calls.url == ledger.upkeep.url == ledger.url
    ledger.dispose()
