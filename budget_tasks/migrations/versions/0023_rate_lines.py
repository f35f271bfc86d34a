"""Each rate window's line of calls waiting their turn, and tenants sharing it.

- ``rate_windows`` gains ``booked`` (what the calls in its line booked, in thousandths:
  its level already owes it), ``vtime`` (the line's virtual time) and ``arrivals``; it
  may owe two days of its limit (``owed_within_an_hour`` becomes
  ``owed_within_two_days``).
- ``rate_takes``' ``due_ms`` becomes ``back_ms`` (when a waiting call was told to come
  back: its turn is read from the window each time it asks, never written), and a
  booking's place in its line: ``tag`` (virtual time) and ``arrival``.
- ``rate_shares``: where each tenant stands in each window's line.
- ``budgets.rate_weight``: a budget's weight in the windows its calls share.
- ``budget_tasks_admit`` and ``budget_tasks_finish`` are made again from the text
  below: a window's refill counts up to two days, and an answer's rate headers narrow
  a window net of what its line booked.

Calls booked when this runs keep their order (by when they were due), each at the
line's start.

The function text below is ``budget_tasks.ledger.functions.FUNCTIONS_DDL``, copied as
literal text (a migration never imports the ledger's code, which goes on changing).
Until this revision lands, copy it again after a change of ``functions.py``:

    .venv/bin/python -m tests.frozen_text budget_tasks/migrations/versions/0023_rate_lines.py

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""

# The functions' text is kept as it is written, long lines too.
# ruff: noqa: E501

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

#: The ledger's id type as it renders (schema.Id).
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

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
    a_draw_share bigint, r_provider text, r_scopes text[], r_requests bigint,
    r_tokens bigint, r_input_tokens bigint, r_output_tokens bigint, r_now_ms bigint,
    r_own text[],
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
    w record;
    want bigint;
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
    IF r_provider IS NOT NULL THEN
        -- rate_takes.take_in, before the budget rows (a booking, or a window short,
        -- is the statements')
        IF EXISTS (SELECT 1 FROM rate_takes WHERE key = a_key) THEN
            RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'the call was booked ahead';
        END IF;
        FOR w IN SELECT id, scope, kind FROM rate_windows
                 WHERE provider = r_provider AND scope = ANY(r_scopes) ORDER BY id LOOP
            want := CASE w.kind WHEN 'requests' THEN r_requests WHEN 'tokens' THEN r_tokens
                    WHEN 'input_tokens' THEN r_input_tokens ELSE r_output_tokens END;
            CONTINUE WHEN want = 0;
            -- statements.TAKE_RATE, statements.RECORD_RATE_TAKE
            UPDATE rate_windows SET level = (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
    THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) - want * 1000, refilled_ms = CASE WHEN r_now_ms > refilled_ms THEN r_now_ms ELSE refilled_ms END
            WHERE id = w.id AND (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
    THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) >= want * 1000;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'BT001', MESSAGE = 'a rate window is short';
            END IF;
            INSERT INTO rate_takes (key, window_id, taken, back_ms, own)
            VALUES (a_key, w.id, want, NULL, w.scope = ANY(r_own));
        END LOOP;
    END IF;
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
    r_tokens bigint, r_input_tokens bigint, r_output_tokens bigint, r_now_ms bigint,
    s_at_ms bigint, s_requests bigint, s_tokens bigint, s_input_tokens bigint,
    s_output_tokens bigint, s_wait_ms bigint, s_requests_limit bigint, s_tokens_limit bigint,
    s_input_tokens_limit bigint, s_output_tokens_limit bigint,
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
    took record;
    back bigint;
    remaining bigint;
    waited bigint;
    stated bigint;
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
    -- rate_takes.give_back_in: the tokens the vendor did not count go back to the
    -- call's rate windows (a request sent stays counted), and each is narrowed to
    -- what the answer said remains (rate_takes.narrowing), before the budget rows
    FOR took IN SELECT t.window_id, t.taken, w.kind, t.own FROM rate_takes t
                JOIN rate_windows w ON w.id = t.window_id
                WHERE t.key = p_key ORDER BY t.window_id LOOP
        back := CASE took.kind WHEN 'tokens' THEN took.taken - r_tokens
                WHEN 'input_tokens' THEN took.taken - r_input_tokens
                WHEN 'output_tokens' THEN took.taken - r_output_tokens ELSE 0 END;
        IF back > 0 THEN
            -- statements.GIVE_RATE_BACK
            UPDATE rate_windows SET level = CASE WHEN (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
    THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) + back * 1000 >= per_minute * 1000
                THEN per_minute * 1000 ELSE (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
    THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
    WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) + back * 1000 END, refilled_ms = CASE WHEN r_now_ms > refilled_ms THEN r_now_ms ELSE refilled_ms END
            WHERE id = took.window_id;
        END IF;
        -- rate_takes.narrowing
        remaining := CASE took.kind WHEN 'requests' THEN s_requests WHEN 'tokens' THEN s_tokens
                     WHEN 'input_tokens' THEN s_input_tokens ELSE s_output_tokens END;
        stated := CASE took.kind WHEN 'requests' THEN s_requests_limit
                  WHEN 'tokens' THEN s_tokens_limit WHEN 'input_tokens' THEN s_input_tokens_limit
                  ELSE s_output_tokens_limit END;
        IF NOT took.own THEN
            remaining := NULL;
            stated := NULL;
        END IF;
        IF remaining IS NULL AND stated IS NULL AND s_wait_ms > 0 AND s_requests IS NULL
           AND s_tokens IS NULL AND s_input_tokens IS NULL AND s_output_tokens IS NULL THEN
            remaining := 0;
        END IF;
        IF s_at_ms IS NOT NULL AND (remaining IS NOT NULL OR stated IS NOT NULL) THEN
            waited := CASE WHEN remaining = 0 THEN LEAST(s_wait_ms, 3600000) ELSE 0 END;
            remaining := LEAST(COALESCE(remaining, 1000000000000), 1000000000000);
            -- (LEAST would take a limit not stated for 10^12: it ignores NULL)
            IF stated IS NOT NULL THEN
                stated := LEAST(stated, 1000000000000);
            END IF;
            -- statements.NARROW_RATE
            UPDATE rate_windows SET per_minute = (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END),
            level = (CASE WHEN (CASE WHEN (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
            THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) <= (CASE WHEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) <= (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 THEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) ELSE (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 END) THEN (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
            THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) ELSE (CASE WHEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) <= (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 THEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) ELSE (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 END) END) >= -(CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 2880000 THEN (CASE WHEN (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
            THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) <= (CASE WHEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) <= (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 THEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) ELSE (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 END) THEN (CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
            THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) ELSE (CASE WHEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) <= (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 THEN ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) ELSE (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 1000 END) END) ELSE -(CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) * 2880000 END), refilled_ms = CASE WHEN r_now_ms > refilled_ms THEN r_now_ms ELSE refilled_ms END
            WHERE id = took.window_id AND ((CASE WHEN level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 >= per_minute * 1000
            THEN per_minute * 1000 ELSE level + per_minute * (CASE WHEN r_now_ms <= refilled_ms THEN 0
            WHEN r_now_ms - refilled_ms >= 172860000 THEN 172860000 ELSE r_now_ms - refilled_ms END) / 60 END) > ((CASE WHEN (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) < -per_minute * 60000 THEN -per_minute * 60000
            ELSE (remaining * 1000 - per_minute * waited / 60
            + per_minute * (CASE WHEN r_now_ms <= s_at_ms THEN 0
            WHEN r_now_ms - s_at_ms >= 3660000 THEN 3660000
            ELSE r_now_ms - s_at_ms END) / 60) END) - booked) OR (CASE WHEN took.own AND stated < per_minute
            THEN stated ELSE per_minute END) < per_minute);
        END IF;
    END LOOP;
    DELETE FROM rate_takes WHERE key = p_key;
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

#: What each window's line holds, and each booking's arrival in it (in the order the
#: bookings fell due), for the calls booked when this runs.
_LINES = (
    """UPDATE rate_takes SET tag = 0, arrival = (
        SELECT count(*) FROM rate_takes o WHERE o.window_id = rate_takes.window_id
        AND o.back_ms IS NOT NULL AND (o.back_ms < rate_takes.back_ms
            OR (o.back_ms = rate_takes.back_ms AND o.key <= rate_takes.key)))
    WHERE back_ms IS NOT NULL""",
    """UPDATE rate_windows SET
        booked = COALESCE((SELECT sum(t.taken) * 1000 FROM rate_takes t
            WHERE t.window_id = rate_windows.id AND t.back_ms IS NOT NULL), 0),
        arrivals = (SELECT count(*) FROM rate_takes t
            WHERE t.window_id = rate_windows.id AND t.back_ms IS NOT NULL)""",
)


def upgrade() -> None:
    with op.batch_alter_table("rate_windows") as batch:
        batch.add_column(sa.Column("booked", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("vtime", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("arrivals", sa.BigInteger, nullable=False, server_default="0"))
        batch.drop_constraint("owed_within_an_hour", type_="check")
        batch.create_check_constraint("owed_within_two_days", "level >= -per_minute * 2880000")
        batch.create_check_constraint("booked_not_negative", "booked >= 0")
    op.drop_index("ix_rate_takes_window_id", table_name="rate_takes")
    with op.batch_alter_table("rate_takes") as batch:
        batch.alter_column("due_ms", new_column_name="back_ms")
        batch.add_column(sa.Column("tag", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("arrival", sa.BigInteger, nullable=True))
    op.create_index("ix_rate_takes_line", "rate_takes", ["window_id", "tag", "arrival"])
    op.create_table(
        "rate_shares",
        sa.Column("window_id", Id, primary_key=True),
        sa.Column("share", Id, primary_key=True),
        sa.Column("finish", sa.BigInteger, nullable=False),
    )
    with op.batch_alter_table("budgets") as batch:
        batch.add_column(sa.Column("rate_weight", sa.Integer, nullable=True))
        batch.create_check_constraint(
            "rate_weight_known",
            "rate_weight IS NULL OR (rate_weight >= 1 AND rate_weight <= 1000)",
        )
    for statement in _LINES:
        op.execute(statement)
    if op.get_bind().dialect.name != "postgresql":
        return
    for statement in (*DROP_DDL, *FUNCTIONS_DDL):
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in (*DROP_DDL, *_revision_0022().FUNCTIONS_DDL):
            op.execute(statement)
    with op.batch_alter_table("budgets") as batch:
        batch.drop_constraint("rate_weight_known", type_="check")
        batch.drop_column("rate_weight")
    op.drop_table("rate_shares")
    op.drop_index("ix_rate_takes_line", table_name="rate_takes")
    with op.batch_alter_table("rate_takes") as batch:
        batch.drop_column("arrival")
        batch.drop_column("tag")
        batch.alter_column("back_ms", new_column_name="due_ms")
    op.create_index("ix_rate_takes_window_id", "rate_takes", ["window_id"])
    op.execute(
        "UPDATE rate_windows SET level = -per_minute * 60000 WHERE level < -per_minute * 60000"
    )
    with op.batch_alter_table("rate_windows") as batch:
        batch.drop_constraint("booked_not_negative", type_="check")
        batch.drop_constraint("owed_within_two_days", type_="check")
        batch.create_check_constraint("owed_within_an_hour", "level >= -per_minute * 60000")
        batch.drop_column("arrivals")
        batch.drop_column("vtime")
        batch.drop_column("booked")


def _revision_0022() -> Any:
    """Revision 0022's module, for the function text it froze (loaded from its file:
    migration modules are not a package)."""
    path = Path(__file__).with_name("0022_rate_admission.py")
    spec = importlib.util.spec_from_file_location("budget_tasks_revision_0022", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
