import json
import pickle

import pytest
from celery import Celery

from budget_tasks import (
    BudgetExceeded,
    BudgetFrozen,
    IdempotencyConflict,
    LedgerError,
    LedgerUnavailable,
    SettlementConflict,
    UnknownAttempt,
    UnknownBudget,
)
from budget_tasks.errors import InvalidTransition

ERRORS = [
    BudgetExceeded("acme", 30, 10),
    BudgetFrozen("acme"),
    UnknownBudget("nope"),
    IdempotencyConflict("k", "amount", 30, 40),
    SettlementConflict("k", 10, 12),
    UnknownAttempt("k"),
    InvalidTransition("k", "settled", "mark sending"),
    LedgerUnavailable("connection refused"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_facts(error: LedgerError) -> None:
    # Celery moves exceptions between processes by pickling them.
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.facts == error.facts
    assert isinstance(copy, LedgerError)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_survive_celerys_json_result_backend(error: LedgerError) -> None:
    # The backend stores (type, module, args) as JSON and rebuilds cls(*args).
    backend = Celery("t", set_as_current=False).backend
    stored = json.loads(json.dumps(backend.prepare_exception(error, "json")))
    copy = backend.exception_to_python(stored)
    assert type(copy) is type(error)
    assert copy.facts == error.facts
    assert str(copy) == str(error)


def test_budget_exceeded_says_what_and_how_much() -> None:
    err = BudgetExceeded("acme", 30, 10)
    assert (err.budget, err.requested, err.available) == ("acme", 30, 10)
    assert "acme" in str(err) and "30" in str(err) and "10" in str(err)
