"""Reads that must cost what is current, not what is past: on a ledger with 90 days of
closed periods for 1,000 budgets (91,000 periods), PostgreSQL plans each on an index
that holds one row per budget (after ANALYZE, as it would choose in production)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import psycopg as pg

from budget_tasks import IdempotencyConflict, Ledger
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger import statements as sql
from budget_tasks.ledger.periods import PERIODS, period_start, previous_period_start
from budget_tasks.ledger.reports import _report_query

TODAY = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _history(ledger: Ledger, budgets: int = 1_000, days: int = 90) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO budgets (name, cap, period, renewal, frozen, created_at)"
                " SELECT 'b' || n, 1000000, 'day', 'reset', false, :today"
                " FROM generate_series(1, :budgets) AS n"
            ),
            {"today": TODAY, "budgets": budgets},
        )
        conn.execute(
            text(
                "INSERT INTO budget_periods (budget_id, period_start, cap, spent, held,"
                " opened_at, closed_at)"
                " SELECT b.id, d, 1000000, 100, 0, d, CASE WHEN d < date_trunc('day',"
                " CAST(:today AS timestamptz)) THEN d + interval '1 day' END"
                " FROM budgets b, generate_series(date_trunc('day', CAST(:today AS"
                " timestamptz)) - make_interval(days => :days), date_trunc('day',"
                " CAST(:today AS timestamptz)), interval '1 day') AS d"
            ),
            {"today": TODAY, "days": days},
        )
        conn.execute(text("ANALYZE"))


def _plan(ledger: Ledger, statement: str, params: dict[str, object]) -> str:
    with ledger.engine.connect() as conn:
        rows = conn.execute(text("EXPLAIN " + statement), params)
        return "\n".join(r[0] for r in rows)


def test_the_report_and_the_closing_of_periods_read_one_row_per_budget(
    pg_ledger: Ledger,
) -> None:
    _history(pg_ledger)
    starts = {kind: period_start(kind, TODAY) for kind in PERIODS}
    before = {kind: previous_period_start(kind, s) for kind, s in starts.items()}
    compiled = _report_query(starts, before).compile(
        dialect=pg.dialect(), compile_kwargs={"render_postcompile": True}
    )
    with pg_ledger.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        plan = "\n".join(
            r[0] for r in raw.execute("EXPLAIN " + str(compiled), compiled.params).fetchall()
        )
    assert "Seq Scan on budget_periods" not in plan, plan
    assert "ix_budget_periods_period_start" in plan, plan

    # opening tomorrow's period closes the open one before it: by the partial index
    plan = _plan(
        pg_ledger,
        sql.CLOSE_PERIODS_BEFORE,
        {"budget_id": 1, "start": datetime(2026, 6, 2, tzinfo=UTC), "now": TODAY},
    )
    assert "ix_budget_periods_open" in plan, plan


def _holds_in_flight(ledger: Ledger, per_budget: int = 3) -> None:
    """Calls in flight in every budget's open period, as a busy fleet has them."""
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO attempts (key, budget_id, period_id, reason, amount, state,"
                " created_at, sending_at)"
                " SELECT 'live-' || p.id || '-' || n, p.budget_id, p.id, 'first', 1000,"
                " 'sending', :today, :today"
                " FROM budget_periods p, generate_series(1, :per_budget) AS n"
                " WHERE p.closed_at IS NULL"
            ),
            {"today": TODAY, "per_budget": per_budget},
        )
        # and the history's settled calls, two a period
        conn.execute(
            text(
                "INSERT INTO attempts (key, budget_id, period_id, reason, amount, actual,"
                " state, created_at, sending_at, resolved_at)"
                " SELECT 'done-' || p.id || '-' || n, p.budget_id, p.id, 'first', 1000, 900,"
                " 'settled', p.period_start, p.period_start, p.period_start"
                " FROM budget_periods p, generate_series(1, 2) AS n"
                " WHERE p.closed_at IS NOT NULL"
            )
        )
        conn.execute(text("ANALYZE"))


def test_holds_and_the_incremental_audit_never_scan_the_periods_history(
    pg_ledger: Ledger,
) -> None:
    _history(pg_ledger)
    _holds_in_flight(pg_ledger)
    from budget_tasks.ledger.reports import _holds_query
    from budget_tasks.ledger.schema import attempts
    from budget_tasks.ledger.states import HOLDING_STATES

    query = _holds_query().where(attempts.c.state.in_(HOLDING_STATES))
    compiled = query.compile(dialect=pg.dialect(), compile_kwargs={"render_postcompile": True})
    with pg_ledger.engine.connect() as conn:
        conn.execute(text("SET random_page_cost = 1.1"))  # as the ledger's sessions
        raw = conn.connection.driver_connection
        assert raw is not None
        plan = "\n".join(
            r[0] for r in raw.execute("EXPLAIN " + str(compiled), compiled.params).fetchall()
        )
    # each hold's period by its key, whatever the planner makes of the history
    assert "Seq Scan on budget_periods" not in plan, plan
    assert "SubPlan" in plan and "pk_budget_periods" in plan, plan
    assert len(pg_ledger.holds()) == 3_000

    # 91,000 periods, 1,000 of them open: the audit reads the open ones by their index
    pg_ledger.audit(full=True)  # its position: the history above has no journal rows
    plan = _plan(pg_ledger, sql.AUDIT_PERIODS, {"since": 10**9})
    assert "Seq Scan on budget_periods" not in plan, plan
    assert "ix_budget_periods_open" in plan, plan


def test_a_settlement_reads_its_holds_periods_by_key_when_the_journals_statistics_lag(
    pg_ledger: Ledger,
) -> None:
    # The journal's statistics were taken when the only period was an early one; the
    # periods grew since (new budgets, new days): its period ids have passed what the
    # planner knows, as they do every day between two ANALYZEs of a large journal.
    pg_ledger.create_budget("early", 10**9)
    for i in range(200):
        pg_ledger.calls.reserve("early", f"k{i}", 10, grant=CallFacts())
        pg_ledger.calls.settle(f"k{i}", 5)
    with pg_ledger.engine.begin() as conn:
        conn.execute(text("ANALYZE"))
    _history(pg_ledger)  # 91,000 periods, analyzed; the journal has no new rows
    pg_ledger.create_budget("late", 10**9)
    pg_ledger.calls.reserve("late", "new", 10, grant=CallFacts())
    # the settlement's lock, and the read of an attempt by its key (a redelivery's)
    for statement in (
        sql.LOCK_ATTEMPT.replace("{for_update}", " FOR UPDATE OF a"),
        sql.EXISTING_ATTEMPT,
    ):
        plan = _plan(pg_ledger, statement, {"key": "new"})
        # not a merge join along the whole periods index up to the new period's id
        assert "Join" not in plan and "Seq Scan on budget_periods" not in plan, plan
        assert "SubPlan" in plan and "pk_budget_periods" in plan, plan
    with pytest.raises(IdempotencyConflict):  # EXISTING_ATTEMPT's answer, by name
        pg_ledger.calls.reserve("late", "new", 11)
    pg_ledger.calls.settle("new", 7)
    assert pg_ledger.balance("late").spent == 7
    assert pg_ledger.calls.reserve("late", "new", 10).budget == "late"  # a replay
