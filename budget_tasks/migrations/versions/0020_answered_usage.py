"""What each attempt's answer said it used, for the drift check against the vendors'
usage and cost reports: its input and output tokens, the model that answered, and the
hint of the API key it was sent with (a few characters at each end, as the vendors'
consoles show; never the key).

- ``attempts`` gains ``input_tokens``, ``output_tokens``, ``credential`` and
  ``answered_by``.
- ``budget_tasks_finish`` takes five arguments more (the vendor, the key's hint, the
  tokens and the model that answered) and writes them with the settlement: it and ``budget_tasks_admit`` are
  dropped and made again from the text below (CREATE OR REPLACE cannot change a
  function's arguments).

The function text below is ``budget_tasks.ledger.functions.FUNCTIONS_DDL``, copied as
literal text (a migration never imports the ledger's code, which goes on changing).
Until this revision lands, copy it again after a change of ``functions.py``:

    .venv/bin/python -m tests.frozen_text budget_tasks/migrations/versions/0020_answered_usage.py

(``tests/integration/test_migrations.py`` fails while the two differ). Once it has
landed, a change of ``functions.py`` is a new migration that installs its text.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

# The functions' text is kept as it is written, long lines too.
# ruff: noqa: E501

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

DROP_DDL = (
    "DROP FUNCTION IF EXISTS budget_tasks_admit",
    "DROP FUNCTION IF EXISTS budget_tasks_finish",
)

# BEGIN frozen text: budget_tasks.ledger.functions.FUNCTIONS_DDL
FUNCTIONS_DDL = (
    r"""
CREATE OR REPLACE FUNCTION budget_tasks_admit(
    p_key text, p_fingerprint text, p_task text, p_payload text, p_owner text,
    p_expires timestamptz, p_now timestamptz,
    a_key text, a_budget_id bigint, a_period_id bigint, a_fingerprint text, a_reason text,
    a_amount bigint, a_price_version text, a_operation_id bigint, a_label text, a_step text,
    a_granted boolean, a_lookup text, a_model text, a_timeout_ms bigint,
    a_request_digest text, a_input_bound bigint, a_output_bound bigint, a_holds bigint[],
    a_escrow_period bigint, a_escrow_chain bigint[], a_escrow_sources bigint[],
    a_draw_share bigint,
    OUT decision text, OUT operation_id bigint, OUT stored text, OUT runs integer)
LANGUAGE plpgsql AS $$
DECLARE
    hold bigint;
    made bigint;
    source bigint;
    own_left bigint;
    room bigint;
    closed boolean;
    smallest bigint;
    size bigint;
BEGIN
    IF p_key IS NOT NULL THEN
        -- a finished key replays (statements.REPLAY)
        UPDATE operations o SET deliveries = o.deliveries + 1, replays = o.replays + 1,
            updated_at = p_now
        WHERE o.key = p_key AND o.fingerprint = p_fingerprint AND o.status = 'succeeded'
        RETURNING o.id, o.result, o.runs INTO operation_id, stored, runs;
        IF FOUND THEN
            decision := 'replay';
            RETURN;
        END IF;
        -- a first delivery (statements.INSERT_RUNNING_OPERATION)
        INSERT INTO operations
            (key, fingerprint, task, payload, status, lease_owner, lease_expires_at, runs,
             deliveries, replays, created_at, updated_at)
        VALUES (p_key, p_fingerprint, p_task, p_payload, 'running', p_owner, p_expires, 1, 1,
                0, p_now, p_now)
        ON CONFLICT (key) DO NOTHING
        RETURNING id INTO operation_id;
        IF operation_id IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the key was delivered before';
        END IF;
        decision := 'run';
        runs := 1;
        IF a_key IS NULL THEN
            RETURN;
        END IF;
    ELSE
        -- a reservation alone (Holds.reserve)
        decision := 'reserved';
        operation_id := a_operation_id;
    END IF;
    -- the attempt, reserved; granted and described where asked (statements.INSERT_ATTEMPT)
    INSERT INTO attempts
        (key, budget_id, period_id, fingerprint, reason, amount, price_version, operation_id,
         label, step, state, created_at, sending_at, lookup, model, timeout_ms,
         request_digest, input_bound, output_bound)
    VALUES (a_key, a_budget_id, a_period_id, a_fingerprint, a_reason, a_amount,
            a_price_version, operation_id, a_label, a_step,
            CASE WHEN a_granted THEN 'sending' ELSE 'reserved' END, p_now,
            CASE WHEN a_granted THEN p_now END, a_lookup, a_model, a_timeout_ms,
            a_request_digest, a_input_bound, a_output_bound)
    ON CONFLICT (key) DO NOTHING
    RETURNING id INTO made;
    IF made IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the attempt exists';
    END IF;
    FOREACH hold IN ARRAY a_holds LOOP
        INSERT INTO journal
        (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at,
         actor, drawn_delta, granted_delta, cap_delta, period_start)
    VALUES (made, hold, 'hold', a_amount, 0, a_reason, NULL, p_now, NULL,
            0, 0, 0,
            (SELECT period_start FROM budget_periods WHERE id = hold));
    END LOOP;
    FOREACH hold IN ARRAY a_holds LOOP
        IF hold = a_escrow_period THEN
            -- escrow.admit's first statement (statements.escrow_admit)
            UPDATE budget_periods SET held = held + a_amount
            WHERE id = hold
              AND (cap - spent - held - granted) >= a_amount
              AND (drawn - spent - held) >= a_amount
              AND closed_at IS NULL
              AND NOT EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))
              AND NOT EXISTS (
                SELECT 1 FROM budget_periods a WHERE a.id = ANY(a_escrow_sources)
                  AND a.cap - a.spent - a.held - a.granted
                      < a_amount - (budget_periods.drawn - budget_periods.spent
                                    - budget_periods.held));
            IF NOT FOUND AND a_draw_share IS NOT NULL THEN
                -- short of grant: escrow._draw, where one grant from each ancestor is
                -- the whole story (a shrunk grant or a take-back is the statements')
                -- statements.LOCK_FOR_DRAW: the escrowed period locked before its
                -- ancestors' (the order of every draw, settlement and return)
                SELECT (cap - spent - held - granted), (drawn - spent - held), closed_at IS NOT NULL
                INTO own_left, room, closed FROM budget_periods WHERE id = hold FOR UPDATE;
                IF closed OR own_left < a_amount OR room >= a_amount
                   OR EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))
                THEN
                    RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the escrowed budget cannot draw here';
                END IF;
                SELECT min(GREATEST((cap - spent - held - granted), 0)) INTO smallest FROM budget_periods
                WHERE id = ANY(a_escrow_sources);
                size := GREATEST(a_amount - room,
                                 LEAST(own_left - room, COALESCE(smallest, 0) / a_draw_share));
                FOREACH source IN ARRAY a_escrow_sources LOOP
                    -- statements.GRANT
                    UPDATE budget_periods SET granted = granted + size
            WHERE id = source
              AND (cap - spent - held - granted) >= size
              AND closed_at IS NULL
              AND budget_id IN (SELECT id FROM budgets WHERE NOT frozen);
                    IF NOT FOUND THEN
                        RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'an ancestor cannot grant the whole draw';
                    END IF;
                END LOOP;
                -- counters.record_grant: statements.DRAW, the grant's journal rows
                UPDATE budget_periods SET drawn = drawn + size, drawn_at = p_now
                WHERE id = hold;
                INSERT INTO journal
        (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at,
         actor, drawn_delta, granted_delta, cap_delta, period_start)
    VALUES (NULL, hold, 'grant', 0, 0, NULL, NULL, p_now, NULL,
            size, 0, 0,
            (SELECT period_start FROM budget_periods WHERE id = hold));
                FOREACH source IN ARRAY a_escrow_sources LOOP
                    INSERT INTO journal
        (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at,
         actor, drawn_delta, granted_delta, cap_delta, period_start)
    VALUES (NULL, source, 'grant', 0, 0, NULL, NULL, p_now, NULL,
            0, size, 0,
            (SELECT period_start FROM budget_periods WHERE id = source));
                END LOOP;
                UPDATE budget_periods SET held = held + a_amount
            WHERE id = hold
              AND (cap - spent - held - granted) >= a_amount
              AND (drawn - spent - held) >= a_amount
              AND closed_at IS NULL
              AND NOT EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))
              AND NOT EXISTS (
                SELECT 1 FROM budget_periods a WHERE a.id = ANY(a_escrow_sources)
                  AND a.cap - a.spent - a.held - a.granted
                      < a_amount - (budget_periods.drawn - budget_periods.spent
                                    - budget_periods.held));
            END IF;
        ELSE
            -- statements.ADMIT
            UPDATE budget_periods SET held = held + a_amount
            WHERE id = hold
              AND (cap - spent - held - granted) >= a_amount
              AND closed_at IS NULL
              AND budget_id IN (SELECT id FROM budgets WHERE NOT frozen);
        END IF;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the hold needs more than one admission statement';
        END IF;
    END LOOP;
END
$$""",
    r"""
CREATE OR REPLACE FUNCTION budget_tasks_finish(
    p_operation_id bigint, p_owner text, p_key text, p_actual bigint,
    p_estimate_only boolean, p_note text, p_request_id text, p_response_id text,
    p_result text, p_now timestamptz, p_record text, p_answer text, p_provider text,
    p_credential text, p_input_tokens bigint, p_output_tokens bigint, p_answered_by text,
    OUT amount bigint)
LANGUAGE plpgsql AS $$
DECLARE
    made bigint;
    was text;
    recorded bigint;
    periods bigint[];
    hold bigint;
    status_was text;
    owner_was text;
    after record;
BEGIN
    -- the attempt first, then its operation: the order every writer locks them in
    SELECT a.id, a.amount, a.state, a.recorded_actual INTO made, amount, was, recorded
    FROM attempts a WHERE a.key = p_key FOR UPDATE;
    IF NOT FOUND OR was <> 'sending' OR p_actual < COALESCE(recorded, 0) THEN
        RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the attempt is not sending, or recorded more';
    END IF;
    IF p_operation_id IS NOT NULL THEN
        SELECT status, lease_owner INTO status_was, owner_was
        FROM operations WHERE id = p_operation_id FOR UPDATE;
        IF status_was IS DISTINCT FROM 'running' OR owner_was IS DISTINCT FROM p_owner THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the run does not hold the lease';
        END IF;
        -- read by the operation's index (its attempts are few; a state index would
        -- walk every entry a state ever had until a vacuum)
        IF (SELECT bool_or(state = 'reserved') FROM attempts
            WHERE operation_id = p_operation_id) THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'holds of the operation are still to release';
        END IF;
    END IF;
    -- its holds' periods by budget id (statements.LOCK_ATTEMPT), each period read by
    -- its key: an attempt holds in one to a few
    SELECT array_agg(j.period_id ORDER BY (SELECT p.budget_id FROM budget_periods p
                                           WHERE p.id = j.period_id))
    INTO periods FROM journal j WHERE j.attempt_id = made AND j.kind = 'hold';
    FOREACH hold IN ARRAY periods LOOP
        INSERT INTO journal
        (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at,
         actor, drawn_delta, granted_delta, cap_delta, period_start)
    VALUES (made, hold, 'charge', -amount, p_actual, p_note, NULL, p_now, NULL,
            0, 0, 0,
            (SELECT period_start FROM budget_periods WHERE id = hold));
    END LOOP;
    -- statements.RESOLVE_ATTEMPT
    UPDATE attempts SET state = 'settled', actual = p_actual, resolved_at = p_now,
        note = COALESCE(p_note, note), estimate_only = p_estimate_only,
        request_id = COALESCE(request_id, p_request_id),
        response_id = COALESCE(response_id, p_response_id),
        provider = COALESCE(provider, p_provider),
        credential = COALESCE(p_credential, credential),
        input_tokens = COALESCE(p_input_tokens, input_tokens),
        output_tokens = COALESCE(p_output_tokens, output_tokens),
        answered_by = COALESCE(p_answered_by, answered_by)
    WHERE id = made;  -- locked above, and read as sending
    -- a labelled call's answer, kept for replay (statements.STORE_SIDE_EFFECT)
    IF p_record IS NOT NULL THEN
        INSERT INTO side_effects (operation_id, name, state, result, created_at, completed_at)
        VALUES (p_operation_id, p_record, 'done', p_answer, p_now, p_now)
        ON CONFLICT (operation_id, name) DO UPDATE
        SET state = 'done', result = excluded.result, completed_at = excluded.completed_at;
    END IF;
    -- statements.SET_OPERATION: succeeded, the run's lease given back, its run ended
    IF p_operation_id IS NOT NULL THEN
        UPDATE operations SET status = 'succeeded', result = COALESCE(p_result, result),
            error = NULL, next_reason = NULL, lease_owner = NULL, lease_expires_at = NULL,
            updated_at = p_now, completed_at = p_now,
            runs = CASE WHEN runs > 0 THEN runs - 1 ELSE runs END
        WHERE id = p_operation_id;
    END IF;
    -- statements.APPLY_SETTLEMENT, and what must follow it is the statement path's
    FOREACH hold IN ARRAY periods LOOP
        UPDATE budget_periods SET held = held - amount, spent = spent + p_actual,
            overrun = overrun + CASE WHEN p_actual > amount THEN p_actual - amount ELSE 0 END
        WHERE id = hold
        RETURNING (SELECT escrow FROM budgets WHERE budgets.id = budget_id) AS escrowed,
            (drawn - spent - held) AS room, carried_out AS carried, (cap - spent - held - granted) AS available,
            closed_at AS closed
        INTO after;
        IF (after.escrowed AND after.room < 0)
           OR (after.escrowed AND after.room > 0 AND after.closed IS NOT NULL)
           OR (after.carried > 0 AND after.available < after.carried) THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the charge draws past a grant, returns one or takes back a carry';
        END IF;
    END LOOP;
END
$$""",
)
# END frozen text


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("input_tokens", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("output_tokens", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("credential", sa.String(64), nullable=True))
        batch.add_column(sa.Column("answered_by", sa.String(100), nullable=True))
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in (*DROP_DDL, *FUNCTIONS_DDL):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in (*DROP_DDL, *_revision_0019().FUNCTIONS_DDL):
            op.execute(statement)
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("answered_by")
        batch.drop_column("credential")
        batch.drop_column("output_tokens")
        batch.drop_column("input_tokens")


def _revision_0019() -> Any:
    """Revision 0019's module, for the function text it froze (loaded from its file:
    migration modules are not a package)."""
    path = Path(__file__).with_name("0019_finish_stores_answer.py")
    spec = importlib.util.spec_from_file_location("budget_tasks_revision_0019", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
