"""Bad input at every ledger entry point: a typed error, and nothing written."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text

from budget_tasks import (
    BudgetExists,
    IdempotencyConflict,
    Ledger,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
)
from budget_tasks.errors import InvalidTransition

BAD_MONEY: list[tuple[Any, type[Exception]]] = [
    (1.5, TypeError),
    (30.0, TypeError),
    (Decimal("30"), TypeError),
    (True, TypeError),
    ("30", TypeError),
    (None, TypeError),
    (-1, ValueError),
    (10**16, ValueError),
]
BAD_KEYS: list[tuple[Any, type[Exception]]] = [
    ("", ValueError),
    ("  ", ValueError),
    ("k" * 256, ValueError),
    ("a\x00b", ValueError),
    (None, TypeError),
    (42, TypeError),
]


def snapshot(ledger: Ledger) -> list[Any]:
    with ledger.engine.connect() as conn:
        return [
            conn.execute(text(f"SELECT * FROM {table} ORDER BY id")).all()
            for table in ("budgets", "budget_periods", "attempts", "journal")
        ]


@pytest.fixture
def seeded(ledger: Ledger) -> Ledger:
    ledger.create_budget("acme", 1_000)
    ledger.calls.reserve("acme", "held", 100, fingerprint="fp")
    ledger.calls.reserve("acme", "sent", 100)
    ledger.calls.mark_sending("sent")
    ledger.calls.reserve("acme", "done", 100)
    ledger.calls.mark_sending("done")
    ledger.calls.settle("done", 80)
    return ledger


CASES: dict[str, Callable[[Ledger, Any], Any]] = {
    "reserve amount": lambda lg, v: lg.calls.reserve("acme", "new", v),
    "settle actual": lambda lg, v: lg.calls.settle("sent", v),
    "adjust delta": lambda lg, v: (
        lg.adjust("done", v, "fix") if v != -1 else lg.adjust("done", 1.5, "fix")
    ),
    "create_budget cap": lambda lg, v: lg.create_budget("new", v),
}


@pytest.mark.parametrize("where", list(CASES))
@pytest.mark.parametrize(
    ("value", "error"),
    BAD_MONEY,
    ids=["float", "float-integral", "decimal", "bool", "str", "none", "negative", "too-big"],
)
def test_bad_money_is_refused_and_nothing_is_written(
    seeded: Ledger, where: str, value: Any, error: type[Exception]
) -> None:
    before = snapshot(seeded)
    expected = TypeError if where == "adjust delta" and value == -1 else error
    with pytest.raises(expected):
        CASES[where](seeded, value)
    assert snapshot(seeded) == before


KEY_CASES: dict[str, Callable[[Ledger, Any], Any]] = {
    "reserve key": lambda lg, v: lg.calls.reserve("acme", v, 10),
    "reserve budget": lambda lg, v: lg.calls.reserve(v, "new", 10),
    "reserve fingerprint": lambda lg, v: lg.calls.reserve(
        "acme", "new", 10, fingerprint=7 if v is None else v
    ),
    "mark_sending": lambda lg, v: lg.calls.mark_sending(v),
    "mark_unknown": lambda lg, v: lg.calls.mark_unknown(v, "timeout"),
    "record_request_id": lambda lg, v: lg.calls.record_request_id("sent", v),
    "settle": lambda lg, v: lg.calls.settle(v, 10),
    "release": lambda lg, v: lg.calls.release(v, "no"),
    "release reason": lambda lg, v: lg.calls.release("held", v if v != "k" * 256 else ""),
    "adjust": lambda lg, v: lg.adjust(v, 1, "fix"),
    "create_budget": lambda lg, v: lg.create_budget(v, 10),
    "freeze": lambda lg, v: lg.freeze(v),
    "balance": lambda lg, v: lg.balance(v),
}


@pytest.mark.parametrize("where", list(KEY_CASES))
@pytest.mark.parametrize(
    ("value", "error"), BAD_KEYS, ids=["empty", "blank", "too-long", "nul", "none", "int"]
)
def test_bad_keys_and_names_are_refused_and_nothing_is_written(
    seeded: Ledger, where: str, value: Any, error: type[Exception]
) -> None:
    before = snapshot(seeded)
    with pytest.raises(error):
        KEY_CASES[where](seeded, value)
    assert snapshot(seeded) == before


REFUSALS: list[tuple[str, Callable[[Ledger], Any], type[Exception]]] = [
    ("unknown budget", lambda lg: lg.calls.reserve("nope", "new", 10), UnknownBudget),
    ("unknown parent", lambda lg: lg.create_budget("kid", 10, parent="nope"), UnknownBudget),
    ("budget exists", lambda lg: lg.create_budget("acme", 10), BudgetExists),
    (
        "key reuse, amount",
        lambda lg: lg.calls.reserve("acme", "held", 101, fingerprint="fp"),
        IdempotencyConflict,
    ),
    (
        "key reuse, fingerprint",
        lambda lg: lg.calls.reserve("acme", "held", 100, fingerprint="x"),
        IdempotencyConflict,
    ),
    ("settle unknown attempt", lambda lg: lg.calls.settle("nope", 10), UnknownAttempt),
    ("release unknown attempt", lambda lg: lg.calls.release("nope", "x"), UnknownAttempt),
    ("adjust unknown attempt", lambda lg: lg.adjust("nope", 1, "x"), UnknownAttempt),
    (
        "request id of unknown attempt",
        lambda lg: lg.calls.record_request_id("nope", "r"),
        UnknownAttempt,
    ),
    (
        "describe unknown attempt",
        lambda lg: lg.calls.describe_attempt("nope", model="gpt-4o-mini"),
        UnknownAttempt,
    ),
    ("conflicting settlement", lambda lg: lg.calls.settle("done", 81), SettlementConflict),
    ("release after charge", lambda lg: lg.calls.release("done", "x"), SettlementConflict),
    ("second send", lambda lg: lg.calls.mark_sending("sent"), InvalidTransition),
    ("settle before send", lambda lg: lg.calls.settle("held", 10), InvalidTransition),
    ("unknown before send", lambda lg: lg.calls.mark_unknown("held", "x"), InvalidTransition),
    ("adjust before settle", lambda lg: lg.adjust("sent", 1, "x"), InvalidTransition),
    ("refund below zero", lambda lg: lg.adjust("done", -81, "x"), ValueError),
    ("unknown period", lambda lg: lg.create_budget("p", 10, period="year"), ValueError),  # type: ignore[arg-type]
    ("unknown renewal", lambda lg: lg.create_budget("p", 10, renewal="keep"), ValueError),  # type: ignore[arg-type]
    (
        "ceiling below cap",
        lambda lg: lg.create_budget("p", 10, period="day", renewal="rollover", rollover_ceiling=5),
        ValueError,
    ),
    (
        "rollover without period",
        lambda lg: lg.create_budget("p", 10, renewal="rollover"),
        ValueError,
    ),
    (
        "unknown reason",
        lambda lg: lg.calls.reserve("acme", "new", 10, reason="because"),
        ValueError,
    ),
]


@pytest.mark.parametrize(("name", "call", "error"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_are_typed_and_write_nothing(
    seeded: Ledger, name: str, call: Callable[[Ledger], Any], error: type[Exception]
) -> None:
    before = snapshot(seeded)
    with pytest.raises(error):
        call(seeded)
    assert snapshot(seeded) == before
