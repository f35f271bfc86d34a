import dataclasses
import inspect
import json
import pickle

import pytest
from celery import Celery

from budget_tasks import (
    BudgetExceeded,
    BudgetFrozen,
    BudgetTasksError,
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


def _every_error() -> list[type[BudgetTasksError]]:
    import budget_tasks.providers.registry
    import budget_tasks.transport.scopes  # noqa: F401  (errors declared outside errors.py)

    found: list[type[BudgetTasksError]] = []
    todo = [BudgetTasksError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("budget_tasks") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: c.__name__)


def _example(cls: type[BudgetTasksError]) -> BudgetTasksError:
    """An instance of ``cls`` with a distinct value for each of its facts."""
    values: dict[str, object] = {}
    for i, field in enumerate(dataclasses.fields(cls)):  # type: ignore[arg-type]
        values[field.name] = i + 7 if "int" in str(field.type) else f"fact-{field.name}"
    return cls(**values)


EVERY_ERROR = _every_error()


def test_every_error_is_found() -> None:
    names = {cls.__name__ for cls in EVERY_ERROR}
    assert {"BudgetExceeded", "SdkRetryRefused", "ManyRuns", "UnknownVendor"} <= names
    assert len(EVERY_ERROR) >= 35


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda c: c.__name__)
def test_every_error_keeps_its_type_facts_and_message_across_processes(
    cls: type[BudgetTasksError],
) -> None:
    error = _example(cls)
    assert error.args == tuple(error.facts.values())
    own = inspect.get_annotations(cls)
    for name, value in error.facts.items():
        assert getattr(error, name) == value
        if name in own and isinstance(value, str):
            assert value in str(error), (name, str(error))  # every fact it adds is said
    backend = Celery("t", set_as_current=False).backend
    stored = json.loads(json.dumps(backend.prepare_exception(error, "json")))
    for copy in (pickle.loads(pickle.dumps(error)), backend.exception_to_python(stored)):
        assert type(copy) is type(error)
        assert (copy.facts, str(copy), copy.args) == (error.facts, str(error), error.args)


def test_an_error_built_by_keyword_has_the_same_args_as_by_position() -> None:
    by_keyword = BudgetExceeded(available=10, budget="acme", requested=30)
    assert by_keyword.args == BudgetExceeded("acme", 30, 10).args == ("acme", 30, 10)
    assert str(by_keyword) == "budget 'acme' cannot admit 30: 10 available"


def test_errors_compare_by_identity_as_exceptions_do() -> None:
    one, two = UnknownAttempt("k"), UnknownAttempt("k")
    assert one != two and len({one, two}) == 2
    assert repr(one) == "UnknownAttempt('k')"
