"""Hypothesis fuzz of bad input at every public entry point, on SQLite and PostgreSQL.

The property everywhere: bad input raises a typed error (a BudgetTasksError, or the
TypeError/ValueError the README documents for malformed values; for the CLI, exit code
2 with one clear line) and writes nothing: every ledger table, the budget counters
included, is exactly as before, and audit() stays clean. Good input mixed with bad
keeps the counters equal to a plain model of what the good steps did.

tests/integration/test_bad_input.py pins single examples; this generalises them.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from functools import partial
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from budget_tasks import BudgetTask, BudgetTasksError, Ledger
from budget_tasks import _validate as check
from budget_tasks import cli as cli_module
from budget_tasks.config import LEDGER_URL_ENV
from budget_tasks.ledger.records import CallAsk
from budget_tasks.ledger.states import ATTEMPT_REASONS, HOLDING_STATES
from budget_tasks.pricing import Usage, default_prices
from budget_tasks.pricing.table import parse_prices
from budget_tasks.providers import estimates

pytestmark = pytest.mark.chaos

TYPED = (BudgetTasksError, TypeError, ValueError)
TABLES = ("budgets", "budget_periods", "operations", "attempts", "side_effects", "journal")
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CAP = 1_000_000

# -- bad values, by the kind of slot they go into ---------------------------------------

odd_objects = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=False, places=2),
    st.fractions(max_denominator=7),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.just(object()),
)


def bad_money(*, signed: bool = False, optional: bool = False) -> st.SearchStrategy[Any]:
    """Anything but an int of minor units within range."""
    wrong_type = st.one_of(
        st.booleans(),
        st.floats(min_value=0, max_value=1e6).map(float),  # 30.0 is still a float
        st.integers(0, 10**6).map(Decimal),
        st.integers(0, 10**6).map(str),
        odd_objects,
    )
    out_of_range = st.integers(min_value=check.MAX_MONEY + 1) | st.integers(
        max_value=-check.MAX_MONEY - 1
    )
    choices = [wrong_type, out_of_range]
    if not signed:
        choices.append(st.integers(-check.MAX_MONEY, -1))
    if not optional:
        choices.append(st.none())
    return st.one_of(*choices)


def bad_text(max_length: int, *, optional: bool = False) -> st.SearchStrategy[Any]:
    """Anything but non-empty, bounded text without NUL that encodes as UTF-8 (None is
    fine when optional)."""
    choices = [
        st.just(""),
        st.text(alphabet=" \t\n\r\x0b\x0c", min_size=1, max_size=5),  # blank
        st.builds(  # too long
            lambda char, n: char * n,
            st.characters(exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")),
            st.integers(max_length + 1, max_length + 40),
        ),
        st.tuples(st.text(max_size=5), st.text(max_size=5)).map(lambda t: f"{t[0]}\x00{t[1]}"),
        st.tuples(st.text(max_size=3), st.characters(categories=["Cs"])).map("".join),
        st.integers(),
        odd_objects,
    ]
    if not optional:
        choices.append(st.none())
    return st.one_of(*choices)


def bad_choice(allowed: tuple[str, ...]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.text(max_size=12).filter(lambda s: s not in allowed), st.none(), odd_objects
    )


bad_timedelta = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=4), st.none())
negative_timedelta = st.timedeltas(max_value=timedelta(microseconds=-1))
bad_datetime = st.one_of(
    st.datetimes(),  # naive: the ledger works in aware UTC
    st.integers(),
    st.text(max_size=8),
)
NAME = check.MAX_NAME_LENGTH
KEY = check.MAX_KEY_LENGTH
REASON = 10_000

# -- the seeded ledger ----------------------------------------------------------------


def seed(ledger: Ledger) -> Ledger:
    ledger.create_budget("acme", CAP)
    ledger.create_budget("child", CAP // 2, parent="acme", period="day")
    ledger.calls.reserve("acme", "held", 100, fingerprint="fp")
    ledger.calls.reserve("acme", "sent", 100)
    ledger.calls.mark_sending("sent")
    ledger.calls.reserve("acme", "done", 100)
    ledger.calls.mark_sending("done")
    ledger.calls.settle("done", 80)
    start = ledger.calls.admit(
        "op", fingerprint="fp", owner="me", lease=timedelta(minutes=1), max_runs=5
    )
    ledger.calls.reserve("acme", "op#1", 10, operation_id=start.operation_id)
    ledger.upkeep.open_period("child")  # so that no refused call is the one that opens it
    return ledger


@pytest.fixture
def seeded(ledger: Ledger) -> Ledger:
    return seed(ledger)


def snapshot(ledger: Ledger) -> dict[str, list[Any]]:
    """Every row of every ledger table."""
    with ledger.engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT * FROM {t} ORDER BY id")).all() for t in TABLES}


def refused_and_unchanged(ledger: Ledger, call: Callable[[], Any]) -> BaseException:
    before = snapshot(ledger)
    with pytest.raises(TYPED) as refused:
        call()
    assert snapshot(ledger) == before, f"{refused.value!r} left a write behind"
    return refused.value


# -- the Ledger API -------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One argument of one entry point, and what to put there that must be refused."""

    name: str
    call: Callable[[Ledger, Any], Any]
    bad: st.SearchStrategy[Any]


def _unknown(existing: set[str], max_length: int = 60) -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=max_length).filter(
        lambda s: bool(s.strip()) and "\x00" not in s and s not in existing
    )


BUDGET_NAMES = {"acme", "child"}
ATTEMPT_KEYS = {"held", "sent", "done", "op#1"}
unknown_budget = _unknown(BUDGET_NAMES)
unknown_key = _unknown(ATTEMPT_KEYS)

SLOTS: list[Slot] = [
    # reserve
    Slot(
        "reserve budget",
        lambda lg, v: lg.calls.reserve(v, "new", 10),
        bad_text(NAME) | unknown_budget,
    ),
    Slot("reserve key", lambda lg, v: lg.calls.reserve("acme", v, 10), bad_text(KEY)),
    Slot("reserve amount", lambda lg, v: lg.calls.reserve("acme", "new", v), bad_money()),
    Slot(
        "reserve over the cap",
        lambda lg, v: lg.calls.reserve("child", "new", v),
        st.integers(CAP // 2 + 1, check.MAX_MONEY),
    ),
    Slot(
        "reserve fingerprint",
        lambda lg, v: lg.calls.reserve("acme", "new", 10, fingerprint=v),
        bad_text(KEY, optional=True),
    ),
    Slot(
        "reserve reason",
        lambda lg, v: lg.calls.reserve("acme", "new", 10, reason=v),
        bad_choice(ATTEMPT_REASONS),
    ),
    Slot(
        "reserve price_version",
        lambda lg, v: lg.calls.reserve("acme", "new", 10, price_version=v),
        bad_text(64, optional=True),
    ),
    Slot(
        "reserve label",
        lambda lg, v: lg.calls.reserve("acme", "new", 10, label=v),
        bad_text(100, optional=True),
    ),
    Slot(
        "reserve operation_id",
        lambda lg, v: lg.calls.reserve("acme", "new", 10, operation_id=v),
        st.one_of(st.integers(10**6, 2**62), st.integers(max_value=0), st.booleans(), odd_objects),
    ),
    Slot(
        "reserve key reused for another request",
        lambda lg, v: lg.calls.reserve(v[0], "held", v[1], fingerprint=v[2]),
        st.one_of(
            st.tuples(
                st.just("acme"), st.integers(0, 10**6).filter(lambda n: n != 100), st.just("fp")
            ),
            st.tuples(st.just("child"), st.just(100), st.just("fp")),
            st.tuples(
                st.just("acme"),
                st.just(100),
                st.none()
                | st.text(min_size=1, max_size=9).filter(
                    lambda f: f.strip() and f != "fp" and "\x00" not in f
                ),
            ),
        ),
    ),
    # the attempt state machine
    Slot("mark_sending key", lambda lg, v: lg.calls.mark_sending(v), bad_text(KEY) | unknown_key),
    Slot(
        "mark_sending twice",
        lambda lg, v: lg.calls.mark_sending(v),
        st.sampled_from(["sent", "done"]),
    ),
    Slot(
        "mark_sending provider",
        lambda lg, v: lg.calls.mark_sending("held", provider=v),
        bad_text(64, optional=True),
    ),
    Slot(
        "mark_sending request_id",
        lambda lg, v: lg.calls.mark_sending("held", request_id=v),
        bad_text(KEY, optional=True),
    ),
    Slot(
        "mark_unknown key",
        lambda lg, v: lg.calls.mark_unknown(v, "timeout"),
        bad_text(KEY) | unknown_key,
    ),
    Slot("mark_unknown reason", lambda lg, v: lg.calls.mark_unknown("sent", v), bad_text(REASON)),
    Slot(
        "mark_unknown state",
        lambda lg, v: lg.calls.mark_unknown(v, "x"),
        st.sampled_from(["held", "done"]),
    ),
    Slot(
        "record_request_id key",
        lambda lg, v: lg.calls.record_request_id(v, "req_1"),
        bad_text(KEY) | unknown_key,
    ),
    Slot(
        "record_request_id id", lambda lg, v: lg.calls.record_request_id("sent", v), bad_text(KEY)
    ),
    Slot("settle key", lambda lg, v: lg.calls.settle(v, 10), bad_text(KEY) | unknown_key),
    Slot("settle actual", lambda lg, v: lg.calls.settle("sent", v), bad_money()),
    Slot(
        "settle again, another actual",
        lambda lg, v: lg.calls.settle("done", v),
        st.integers(0, check.MAX_MONEY).filter(lambda n: n != 80),
    ),
    Slot("settle before send", lambda lg, v: lg.calls.settle("held", v), st.integers(0, 1000)),
    Slot(
        "settle note",
        lambda lg, v: lg.calls.settle("sent", 10, note=v),
        bad_text(REASON, optional=True),
    ),
    Slot("release key", lambda lg, v: lg.calls.release(v, "no"), bad_text(KEY) | unknown_key),
    Slot("release reason", lambda lg, v: lg.calls.release("held", v), bad_text(REASON)),
    Slot("adjust key", lambda lg, v: lg.adjust(v, 1, "fix"), bad_text(KEY) | unknown_key),
    Slot(
        "adjust delta",
        lambda lg, v: lg.adjust("done", v, "fix"),
        bad_money(signed=True) | st.just(0) | st.integers(-check.MAX_MONEY, -81),
    ),
    Slot("adjust reason", lambda lg, v: lg.adjust("done", 1, v), bad_text(REASON)),
    Slot(
        "adjust ref", lambda lg, v: lg.adjust("done", 1, "fix", ref=v), bad_text(KEY, optional=True)
    ),
    Slot(
        "adjust unsettled", lambda lg, v: lg.adjust(v, 1, "fix"), st.sampled_from(["held", "sent"])
    ),
    Slot(
        "describe_attempt",
        lambda lg, v: lg.calls.describe_attempt("sent", **v),
        st.one_of(
            bad_text(32, optional=True)
            .filter(lambda x: x is not None)
            .map(lambda x: {"lookup": x}),
            bad_text(100, optional=True)
            .filter(lambda x: x is not None)
            .map(lambda x: {"model": x}),
            bad_text(KEY, optional=True)
            .filter(lambda x: x is not None)
            .map(lambda x: {"response_id": x}),
        ),
    ),
    Slot(
        "describe_attempt key",
        lambda lg, v: lg.calls.describe_attempt(v, model="gpt-4o-mini"),
        bad_text(KEY) | unknown_key,
    ),
    # budgets
    Slot("create_budget name", lambda lg, v: lg.create_budget(v, 10), bad_text(NAME)),
    Slot(
        "create_budget exists",
        lambda lg, v: lg.create_budget(v, 10),
        st.sampled_from(["acme", "child"]),
    ),
    Slot("create_budget cap", lambda lg, v: lg.create_budget("new", v), bad_money()),
    Slot(
        "create_budget period",
        lambda lg, v: lg.create_budget("new", 10, period=v),
        bad_choice(("none", "day", "week", "month")),
    ),
    Slot(
        "create_budget renewal",
        lambda lg, v: lg.create_budget("new", 10, period="day", renewal=v),
        bad_choice(("reset", "rollover")),
    ),
    Slot(
        "create_budget parent",
        lambda lg, v: lg.create_budget("new", 10, parent=v),
        bad_text(NAME, optional=True) | unknown_budget,
    ),
    Slot(
        "create_budget tenant",
        lambda lg, v: lg.create_budget("new", 10, tenant=v),
        bad_text(NAME, optional=True),
    ),
    Slot(
        "create_budget rollover_ceiling",
        lambda lg, v: lg.create_budget(
            "new", 10, period="day", renewal="rollover", rollover_ceiling=v
        ),
        bad_money(optional=True) | st.integers(0, 9),
    ),
    Slot("budget", lambda lg, v: lg.budget(v), bad_text(NAME) | unknown_budget),
    Slot("balance", lambda lg, v: lg.balance(v), bad_text(NAME) | unknown_budget),
    Slot("balance at", lambda lg, v: lg.balance("child", at=v), bad_datetime),
    Slot("open_period", lambda lg, v: lg.upkeep.open_period(v), bad_text(NAME) | unknown_budget),
    Slot("open_period at", lambda lg, v: lg.upkeep.open_period("child", at=v), bad_datetime),
    Slot("freeze", lambda lg, v: lg.freeze(v), bad_text(NAME) | unknown_budget),
    Slot("unfreeze", lambda lg, v: lg.unfreeze(v), bad_text(NAME) | unknown_budget),
    Slot("freeze note", lambda lg, v: lg.freeze("child", note=v), bad_text(10_000, optional=True)),
    Slot(
        "freeze actor",
        lambda lg, v: lg.freeze("child", actor=v),
        bad_text(100, optional=True) | st.sampled_from(["two\nlines", "esc\x1b[2J"]),
    ),
    Slot(
        "set_cap actor",
        lambda lg, v: lg.set_cap("child", 20, actor=v),
        bad_text(100, optional=True) | st.just("tab\there"),
    ),
    Slot(
        "actions",
        lambda lg, v: lg.actions(budget=v),
        bad_text(NAME, optional=True) | st.booleans(),
    ),
    Slot(
        "actions limit",
        lambda lg, v: lg.actions(limit=v),
        st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=3)),
    ),
    Slot("distrust key", lambda lg, v: lg.upkeep.distrust(v, "why"), bad_text(KEY) | unknown_key),
    Slot(
        "distrust reason",
        lambda lg, v: lg.upkeep.distrust("sent", v),
        bad_text(10_000),
    ),
    # reports
    Slot("attempt", lambda lg, v: lg.attempt(v), bad_text(KEY) | unknown_key),
    Slot(
        "holds states",
        lambda lg, v: lg.holds(states=v),
        st.lists(bad_choice(HOLDING_STATES).filter(lambda x: isinstance(x, str)), min_size=1),
    ),
    Slot(
        "holds older_than",
        lambda lg, v: lg.holds(older_than=v),
        bad_timedelta.filter(lambda x: x is not None) | negative_timedelta,
    ),
    Slot("flag_stale", lambda lg, v: lg.upkeep.flag_stale(v), bad_timedelta | negative_timedelta),
    Slot("operation", lambda lg, v: lg.operation(v), bad_text(KEY) | _unknown({"op"})),
    Slot(
        "claim_unknown limit",
        lambda lg, v: lg.upkeep.claim_unknown(limit=v),
        st.one_of(st.integers(max_value=-1), st.booleans(), st.floats(), st.text(max_size=3)),
    ),
    Slot(
        "claim_unknown backoff",
        lambda lg, v: lg.upkeep.claim_unknown(backoff=v),
        bad_timedelta | st.just(timedelta(seconds=-1)),
    ),
    Slot(
        "purge_operations",
        lambda lg, v: lg.upkeep.purge_operations(v),
        bad_timedelta | negative_timedelta,
    ),
    Slot(
        "purge_operations batch",
        lambda lg, v: lg.upkeep.purge_operations(timedelta(0), batch=v),
        st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=3)),
    ),
    # operations (the task's plumbing, public all the same)
    Slot(
        "admit key",
        lambda lg, v: lg.calls.admit(
            v, fingerprint="fp", owner="me", lease=timedelta(minutes=1), max_runs=5
        ),
        bad_text(KEY),
    ),
    Slot(
        "admit fingerprint",
        lambda lg, v: lg.calls.admit(
            "op", fingerprint=v, owner="me", lease=timedelta(minutes=1), max_runs=5
        ),
        bad_text(KEY)
        | st.text(min_size=1, max_size=20).filter(
            lambda s: s.strip() and s != "fp" and "\x00" not in s
        ),
    ),
    Slot(
        "admit lease",
        lambda lg, v: lg.calls.admit("new-op", fingerprint="fp", owner="me", lease=v, max_runs=5),
        bad_timedelta | st.just(timedelta(0)) | st.just(timedelta(seconds=-5)),
    ),
    Slot(
        "admit max_runs",
        lambda lg, v: lg.calls.admit(
            "new-op", fingerprint="fp", owner="me", lease=timedelta(minutes=1), max_runs=v
        ),
        st.one_of(
            st.integers(max_value=0), st.booleans(), st.floats(), st.text(max_size=3), st.none()
        ),
    ),
    Slot(
        "admit owner",
        lambda lg, v: lg.calls.admit(
            "new-op", fingerprint="fp", owner=v, lease=timedelta(minutes=1), max_runs=5
        ),
        bad_text(KEY),
    ),
    Slot(
        "end_run status",
        lambda lg, v: lg.calls.end_run("op", owner="me", status=v),
        bad_choice(("pending", "failed", "retryable")).filter(lambda v: v is not None),
    ),
    Slot("end_run key", lambda lg, v: lg.calls.end_run(v, owner="me"), _unknown({"op"})),
    Slot(
        "end_run operation id",
        lambda lg, v: lg.calls.end_run(v, owner="me"),
        st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.none()),
    ),
    # a labelled call's admission: what it asks, then where
    Slot(
        "admit_call budget",
        lambda lg, v: _admit_call(lg, budget=v),
        bad_text(NAME) | unknown_budget,
    ),
    Slot("admit_call amount", lambda lg, v: _admit_call(lg, amount=v), bad_money()),
    Slot("admit_call step", lambda lg, v: _admit_call(lg, step=v), bad_text(KEY)),
    Slot(
        "admit_call operation id",
        lambda lg, v: _admit_call(lg, operation_id=v),
        st.one_of(st.integers(max_value=0), st.booleans(), st.floats(), st.none()),
    ),
]


def _admit_call(lg: Ledger, *, operation_id: Any = 1, **asked: Any) -> Any:
    """A labelled call's admission with one of its facts replaced (the rest valid)."""
    ask = {"budget": "acme", "amount": 10, "label": "step", "step": "op:step:1", **asked}
    call = CallAsk(**ask)
    return lg.calls.admit_call(operation_id, call, record="spend:step:1", plan=lambda here: None)


@given(data=st.data())
@FUZZ
def test_ledger_entry_points_refuse_bad_input_and_write_nothing(
    seeded: Ledger, data: st.DataObject
) -> None:
    slot = data.draw(st.sampled_from(SLOTS), label="entry point")
    value = data.draw(slot.bad, label=slot.name)
    refused_and_unchanged(seeded, lambda: slot.call(seeded, value))
    assert seeded.audit() == []


# -- good input mixed with bad ----------------------------------------------------------


@dataclass
class Model:
    """What the counters of budget "acme" must read, from the good steps alone."""

    held: int
    spent: int
    attempts: dict[str, tuple[str, int]]  # key -> (state, amount)

    @classmethod
    def of(cls, ledger: Ledger) -> Model:
        bal = ledger.balance("acme")
        return cls(bal.held, bal.spent, {})


GOOD = st.sampled_from(["reserve", "send", "settle", "release", "unknown", "adjust"])


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(GOOD, st.integers(0, 500)),
            st.tuples(st.just("bad"), st.sampled_from(SLOTS)),
        ),
        min_size=1,
        max_size=12,
    ),
    data=st.data(),
)
@FUZZ
def test_good_and_bad_input_mixed_keep_the_counters_and_the_journal_agreed(
    seeded: Ledger, steps: list[tuple[str, Any]], data: st.DataObject
) -> None:
    model = Model.of(seeded)
    run = uuid.uuid4().hex[:8]
    for n, (kind, arg) in enumerate(steps):
        if kind == "bad":
            slot: Slot = arg
            value = data.draw(slot.bad, label=slot.name)
            refused_and_unchanged(seeded, lambda: slot.call(seeded, value))  # noqa: B023
            continue
        apply_good(seeded, model, kind, arg, f"{run}-{n}")
    bal = seeded.balance("acme")
    assert (bal.held, bal.spent) == (model.held, model.spent)
    assert seeded.audit() == []
    for key, (state, _) in model.attempts.items():
        assert seeded.attempt(key).state == state


def apply_good(ledger: Ledger, model: Model, kind: str, amount: int, key: str) -> None:
    """One valid step on budget "acme", mirrored in the model (a step with nothing to
    act on reserves)."""
    mine = dict(model.attempts)
    in_state = {s: [k for k, (state, _) in mine.items() if state == s] for s in HOLDING_STATES}
    if kind == "reserve" or not any(in_state.values()):
        ledger.calls.reserve("acme", key, amount, reason="manual")
        model.attempts[key] = ("reserved", amount)
        model.held += amount
    elif kind == "send" and in_state["reserved"]:
        target = in_state["reserved"][0]
        ledger.calls.mark_sending(target)
        model.attempts[target] = ("sending", mine[target][1])
    elif kind == "settle" and (in_state["sending"] or in_state["unknown"]):
        target = (in_state["sending"] + in_state["unknown"])[0]
        assert ledger.calls.settle(target, amount)
        model.attempts[target] = ("settled", mine[target][1])
        model.held -= mine[target][1]
        model.spent += amount
    elif kind == "unknown" and in_state["sending"]:
        target = in_state["sending"][0]
        assert ledger.calls.mark_unknown(target, "read timeout")
        model.attempts[target] = ("unknown", mine[target][1])
    elif kind == "release" and any(in_state.values()):
        target = next(k for ks in in_state.values() for k in ks)
        assert ledger.calls.release(target, "not billed")
        model.attempts[target] = ("released", mine[target][1])
        model.held -= mine[target][1]
    elif kind == "adjust":
        settled = [k for k, (s, _) in mine.items() if s == "settled"]
        if settled and amount:
            assert ledger.adjust(settled[0], amount, "late correction", ref=key)
            model.spent += amount


# -- BudgetTask's call path (eager mode) ---------------------------------------------


@dataclass
class Knobs:
    """What the task's option functions return for the current example."""

    budget: Any = "acme"
    key: Any = None
    fingerprint: Any = None
    estimate: Any = 10


@pytest.fixture
def eager(seeded: Ledger, backend_url: str) -> Iterator[tuple[Any, Knobs]]:
    from budget_tasks.config import close_ledgers

    knobs = Knobs()
    app = Celery("fuzz-eager", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"fuzz{uuid.uuid4().hex[:8]}.job",
        budget=lambda n: knobs.budget,
        idempotency_key=lambda n: knobs.key,
        fingerprint=lambda n: knobs.fingerprint,
        estimate_cost=lambda n: knobs.estimate,
    )
    def job(self: BudgetTask, n: int) -> int:
        return n  # nothing billable: the inputs are refused before this runs

    yield job, knobs
    close_ledgers()


@given(data=st.data())
@FUZZ
def test_task_options_refuse_bad_values_and_move_no_money(
    eager: tuple[Any, Knobs], seeded: Ledger, data: st.DataObject
) -> None:
    job, knobs = eager
    for name, default in vars(Knobs()).items():  # the good values, then one bad
        setattr(knobs, name, default)
    which = data.draw(st.sampled_from(["budget", "key", "fingerprint", "estimate"]))
    bad = {
        "budget": bad_text(NAME) | unknown_budget,
        "key": bad_text(KEY).filter(lambda v: v is not None),  # None: the task id
        "fingerprint": bad_text(KEY).filter(lambda v: v is not None),  # None: hash of args
        "estimate": bad_money() | st.integers(CAP + 1, check.MAX_MONEY),
    }[which]
    setattr(knobs, which, data.draw(bad, label=which))
    if knobs.key is None:
        knobs.key = f"job:{uuid.uuid4().hex}"
    before = snapshot(seeded)
    with pytest.raises(TYPED):
        job.delay(1)
    after = snapshot(seeded)
    # no money moved; an operation may have been recorded (the estimate is taken after
    # the delivery is), but none is left holding its lease
    for table in ("budgets", "budget_periods", "attempts", "journal", "side_effects"):
        assert after[table] == before[table], table
    new_ops = [row for row in after["operations"] if row not in before["operations"]]
    assert all(row.lease_owner is None and row.status == "pending" for row in new_ops), new_ops
    assert seeded.audit() == []


# -- pricing and estimates --------------------------------------------------------------

MODELS = ["gpt-4o-mini", "gpt-4o", "gpt-4.1-nano", "o4-mini", "claude-haiku-4-5"]


@given(data=st.data())
@FUZZ
def test_pricing_refuses_unknown_models_and_bad_token_counts(data: st.DataObject) -> None:
    prices = default_prices()
    known = st.sampled_from(MODELS)
    unknown_model = st.text(max_size=30).filter(lambda m: not prices.knows(m)) | st.none()
    bad_count = st.one_of(
        st.integers(max_value=-1), st.booleans(), st.floats(), st.text(max_size=3), st.none()
    )
    field = st.sampled_from(
        ["input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens"]
    )
    hello = [{"role": "user", "content": "hello"}]
    case = data.draw(
        st.sampled_from(
            [
                "cost model",
                "usage count",
                "reasoning",
                "estimate model",
                "estimate max",
                "estimate prompt",
                "chat model",
                "chat max",
                "chat part",
            ]
        )
    )
    call: Callable[[], Any]
    if case == "cost model":
        call = partial(prices.cost, data.draw(unknown_model), Usage(input_tokens=10))
    elif case == "usage count":
        call = partial(Usage, **{data.draw(field): data.draw(bad_count)})
    elif case == "reasoning":
        out = data.draw(st.integers(0, 1000))
        more = data.draw(st.integers(out + 1, out + 10**6))
        call = partial(Usage, output_tokens=out, reasoning_tokens=more)
    elif case == "estimate model":
        call = partial(prices.estimate, data.draw(unknown_model), ["hello"], 16)
    elif case == "estimate max":
        limit = data.draw(bad_count.filter(lambda v: v is not None) | st.just(0))
        call = partial(prices.estimate, data.draw(known), ["hello"], limit)
    elif case == "estimate prompt":
        junk = data.draw(st.one_of(st.integers(), st.none(), st.binary(max_size=3), st.floats()))
        call = partial(prices.estimate, data.draw(known), ["hello", junk], 16)
    elif case == "chat model":
        params: dict[str, Any] = {"messages": hello, "max_completion_tokens": 16}
        model = data.draw(unknown_model)
        if model is not None or data.draw(st.booleans()):
            params["model"] = model  # else: no model at all
        call = partial(estimates.openai_chat, params)
    elif case == "chat max":
        limit = data.draw(bad_count | st.just(0))
        params = {"model": data.draw(known), "messages": hello}
        if limit is not None:
            params["max_completion_tokens"] = limit  # None: no limit given
        call = partial(estimates.openai_chat, params)
    else:
        part = data.draw(
            st.sampled_from(
                [{"type": "image_url", "image_url": {"url": "https://x"}}, {"type": "file"}]
            )
        )
        content = [{"type": "text", "text": "look:"}, part]
        params = {
            "model": data.draw(known),
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": 16,
        }
        call = partial(estimates.openai_chat, params)
    with pytest.raises(TYPED):
        call()


price = st.integers(0, 10**6)
price_entry = st.dictionaries(
    st.sampled_from(["input", "output", "cached_input", "cache_write", "provider"]),
    st.one_of(price, price, bad_money()),
)
price_table = st.fixed_dictionaries(
    {"version": st.sampled_from(["2026-01", "v1"]) | st.text(max_size=3) | st.none()},
    optional={
        "models": st.dictionaries(
            st.text(min_size=1, max_size=5), price_entry | odd_objects | st.none(), max_size=2
        )
    },
)


def valid_price_table(table: dict[str, Any]) -> bool:
    def money(value: Any) -> bool:
        return is_int(value) and 0 <= value <= check.MAX_MONEY

    def text(value: Any) -> bool:
        if not (isinstance(value, str) and value.strip()) or "\x00" in value:
            return False  # text, not blank, no NUL (a NUL cannot be stored in PostgreSQL)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate
            return False
        return True

    if not text(table["version"]):
        return False
    for entry in table.get("models", {}).values():
        if not isinstance(entry, dict) or "input" not in entry or "output" not in entry:
            return False
        if not all(money(entry[k]) for k in ("input", "output", "cached_input") if k in entry):
            return False
        if entry.get("cache_write") is not None and not money(entry["cache_write"]):
            return False
        if entry.get("provider") is not None and not text(entry["provider"]):
            return False
    return True


@given(table=price_table)
@FUZZ
def test_a_price_table_is_loaded_only_when_valid(table: dict[str, Any]) -> None:
    if not valid_price_table(table):
        with pytest.raises(TYPED):
            parse_prices(table)
        return
    loaded = parse_prices(table)
    for name, entry in table.get("models", {}).items():
        got = loaded.models[name]
        assert (got.input, got.output) == (entry["input"], entry["output"])
        assert got.cached_input == entry.get("cached_input", entry["input"])


# -- _validate: the checks every entry point shares -----------------------------------

anything = st.one_of(
    st.integers(min_value=-(10**17), max_value=10**17),
    st.booleans(),
    st.none(),
    st.floats(),
    st.decimals(allow_nan=False),
    st.fractions(),
    st.text(max_size=300),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@given(value=anything, signed=st.booleans())
@FUZZ
def test_validate_money_accepts_exactly_ints_of_minor_units(value: Any, signed: bool) -> None:
    valid = is_int(value) and (signed or value >= 0) and abs(value) <= check.MAX_MONEY
    if valid:
        assert check.money(value, signed=signed) is value
    else:
        with pytest.raises(TypeError if not is_int(value) else ValueError):
            check.money(value, signed=signed)


@given(value=anything)
@FUZZ
def test_validate_count_accepts_exactly_non_negative_ints(value: Any) -> None:
    if is_int(value) and value >= 0:
        assert check.count(value, "tokens") is value
    else:
        with pytest.raises(TypeError if not is_int(value) else ValueError):
            check.count(value, "tokens")


@given(
    value=anything
    | st.text(alphabet="ab \x00\t", max_size=8)
    | st.text(st.characters(categories=["Cs", "Ll", "Zs"]), max_size=8),
    limit=st.integers(1, 300),
)
@FUZZ
def test_validate_text_accepts_exactly_bounded_non_blank_text(value: Any, limit: int) -> None:
    valid = (
        isinstance(value, str)
        and bool(value.strip())
        and len(value) <= limit
        and "\x00" not in value
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)  # encodes as UTF-8
    )
    if valid:
        assert check.text(value, "name", max_length=limit) is value
        assert check.optional_text(value, "name", max_length=limit) is value
    else:
        with pytest.raises(TypeError if not isinstance(value, str) else ValueError):
            check.text(value, "name", max_length=limit)
    assert check.optional_text(None, "name") is None


# -- the CLI --------------------------------------------------------------------------


def run_cli(url: str, args: list[str]) -> tuple[int, str]:
    """The ``budget-tasks`` entry point (cli.run, which maps bad input to exit 2), in
    process, with its output captured by click's CliRunner."""
    runner = CliRunner()
    with runner.isolation(env={LEDGER_URL_ENV: url}) as (_, err, _output):
        argv = sys.argv
        sys.argv = ["budget-tasks", *args]
        try:
            cli_module.run()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.argv = argv
        return code, err.getvalue().decode(errors="replace")


not_a_number = st.sampled_from(["", "abc", "ten", "--", "1,5", "0x10", "1.2.3", "½"])
not_an_int = not_a_number | st.sampled_from(["1.5", "1e3", "nan", "inf", "-0.5"])
#: floats the --age option parses but no duration is: NaN, infinities, negative, past
#: what a timedelta holds
not_a_duration = st.one_of(
    not_a_number,
    st.sampled_from(["nan", "inf", "-inf", "1e400", "1e20"]),
    st.integers(max_value=-1).map(str),
)
cli_amount = (
    not_an_int
    | st.integers(max_value=-1).map(str)
    | st.integers(min_value=check.MAX_MONEY + 1).map(str)
)
cli_name = st.one_of(
    st.just(""),
    st.text(alphabet=" \t", min_size=1, max_size=3),
    st.text(alphabet="abc", min_size=NAME + 1, max_size=NAME + 5),
)
cli_unknown = st.text(alphabet="xyz-_0123456789", min_size=1, max_size=20).filter(
    lambda s: s not in BUDGET_NAMES | ATTEMPT_KEYS and not s.startswith("-")
)

CLI_CASES: list[tuple[str, Callable[[Any], list[str]], st.SearchStrategy[Any]]] = [
    ("create --cap", lambda v: ["budget", "create", "new", "--cap", v], cli_amount),
    ("create name", lambda v: ["budget", "create", v, "--cap", "10"], cli_name),
    (
        "create --period",
        lambda v: ["budget", "create", "new", "--cap", "10", "--period", v],
        st.text(alphabet="adeky", max_size=6).filter(lambda s: s not in ("day", "week", "none")),
    ),
    (
        "create --rollover-ceiling",
        lambda v: [
            "budget",
            "create",
            "new",
            "--cap",
            "10",
            "--period",
            "day",
            "--renewal",
            "rollover",
            "--rollover-ceiling",
            v,
        ],
        cli_amount | st.integers(0, 9).map(str),
    ),
    (
        "create --parent",
        lambda v: ["budget", "create", "new", "--cap", "10", "--parent", v],
        cli_unknown,
    ),
    ("show", lambda v: ["budget", "show", v], cli_unknown | cli_name),
    ("freeze", lambda v: ["budget", "freeze", v], cli_unknown | cli_name),
    ("unfreeze", lambda v: ["budget", "unfreeze", v], cli_unknown | cli_name),
    ("resolve attempt", lambda v: ["resolve", v, "--actual", "10", "--note", "x"], cli_unknown),
    ("resolve --actual", lambda v: ["resolve", "sent", "--actual", v, "--note", "x"], cli_amount),
    (
        "resolve unsent",
        lambda v: ["resolve", "held", "--actual", v, "--note", "x"],
        st.integers(1, 10**6).map(str),
    ),
    ("resolve no note", lambda v: ["resolve", "sent", "--actual", v], st.integers(0, 99).map(str)),
    ("holds --age", lambda v: ["holds", "--stale", "--age", v], not_a_duration),
    (
        "unknown command",
        lambda v: [v],
        cli_unknown.filter(
            lambda s: s not in ("db", "budget", "holds", "resolve", "audit", "status", "demo")
        ),
    ),
    ("unknown option", lambda v: ["status", f"--{v}"], cli_unknown),
]


@given(data=st.data())
@settings(FUZZ, max_examples=40)
def test_cli_refuses_bad_input_with_exit_2_and_writes_nothing(
    seeded: Ledger, backend_url: str, data: st.DataObject
) -> None:
    name, argv, bad = data.draw(st.sampled_from(CLI_CASES), label="command")
    value = data.draw(bad, label=name)
    before = snapshot(seeded)
    code, err = run_cli(backend_url, argv(value))
    assert code == 2, (argv(value), code, err)
    assert err.strip(), "exit 2 without saying why"
    assert snapshot(seeded) == before
    assert seeded.audit() == []
