"""The ledger's two server-side functions on PostgreSQL: a delivery's admission and a
run's settlement, each one statement, sent alone (autocommit), so that the transaction
is one round trip and its row locks are held for the function's few microseconds, not
across the client's round trips.

The admission serves a direct reservation too (no operation), and the settlement a
direct settlement. Each is the common case only, written to leave exactly the rows the
statement path (:mod:`.operations`, :mod:`.holds`, :mod:`.escrow`) leaves for it. Anything else (a
delivery of a key that exists, a grant to draw, a refusal, an attempt resolved
meanwhile, a lease that moved, an overrun past an escrowed grant, a closed period that
carried) raises :data:`NOT_HERE` before the function returns: its writes roll back, and
the caller runs the statement path, which decides every case. So the rules stay in one
place, the statement path; these are its first step, sent in one message. The parity
test (``tests/integration/test_server_functions.py``) drives both with the same
operations and compares every row.

Each writes in the statement path's order, so its row locks are taken in the order
every writer takes them: the attempt, then its operation, and the hot period rows
last, by budget id, by the conditional UPDATE itself. The references to a period row
are checked at commit (deferred foreign keys), when the transaction holds the row's
lock: no other transaction shares it, so no MultiXact is made.
"""

from __future__ import annotations

import re
from typing import Any

from .statements import AVAILABLE, GRANT_ROOM

#: The SQLSTATE the functions raise for "not the common case: run the statement path".
NOT_HERE = "BT001"
#: PostgreSQL's SQLSTATE undefined_function: a database not yet migrated to 0016.
UNDEFINED_FUNCTION = "42883"

_NOT_HERE = f"RAISE EXCEPTION USING ERRCODE = '{NOT_HERE}', MESSAGE ="

_ESCROW_ADMIT = f"""UPDATE budget_periods SET held = held + a_amount
            WHERE id = hold
              AND {AVAILABLE} >= a_amount
              AND {GRANT_ROOM} >= a_amount
              AND closed_at IS NULL
              AND NOT EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))
              AND NOT EXISTS (
                SELECT 1 FROM budget_periods a WHERE a.id = ANY(a_escrow_sources)
                  AND a.cap - a.spent - a.held - a.granted
                      < a_amount - (budget_periods.drawn - budget_periods.spent
                                    - budget_periods.held));"""

#: A compare-and-set take of ``{amount}`` from a period's available money into its
#: ``{column}`` (statements.ADMIT, statements.GRANT): open, not frozen, enough left.
_TAKE = f"""UPDATE budget_periods SET {{column}} = {{column}} + {{amount}}
            WHERE id = {{period}}
              AND {AVAILABLE} >= {{amount}}
              AND closed_at IS NULL
              AND budget_id IN (SELECT id FROM budgets WHERE NOT frozen);"""

#: A journal row (statements.INSERT_JOURNAL, written by counters._journal in the
#: statement path), in its period's partition; each ``{name}`` is an expression of the
#: function's variables.
_JOURNAL_ROW = """INSERT INTO journal
        (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at,
         actor, drawn_delta, granted_delta, cap_delta, period_start)
    VALUES ({attempt}, {period}, '{kind}', {held}, {spent}, {note}, NULL, p_now, NULL,
            {drawn}, {granted}, 0,
            (SELECT period_start FROM budget_periods WHERE id = {period}));"""


def _journal_row(
    attempt: str,
    period: str,
    kind: str,
    *,
    held: str = "0",
    spent: str = "0",
    note: str = "NULL",
    drawn: str = "0",
    granted: str = "0",
) -> str:
    return _JOURNAL_ROW.format(
        attempt=attempt,
        period=period,
        kind=kind,
        held=held,
        spent=spent,
        note=note,
        drawn=drawn,
        granted=granted,
    )


ADMIT_FUNCTION = f"""
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
            {_NOT_HERE} 'the key was delivered before';
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
        {_NOT_HERE} 'the attempt exists';
    END IF;
    FOREACH hold IN ARRAY a_holds LOOP
        {_journal_row("made", "hold", "hold", held="a_amount", note="a_reason")}
    END LOOP;
    FOREACH hold IN ARRAY a_holds LOOP
        IF hold = a_escrow_period THEN
            -- escrow.admit's first statement (statements.escrow_admit)
            {_ESCROW_ADMIT}
            IF NOT FOUND AND a_draw_share IS NOT NULL THEN
                -- short of grant: escrow._draw, where one grant from each ancestor is
                -- the whole story (a shrunk grant or a take-back is the statements')
                -- statements.LOCK_FOR_DRAW: the escrowed period locked before its
                -- ancestors' (the order of every draw, settlement and return)
                SELECT {AVAILABLE}, {GRANT_ROOM}, closed_at IS NOT NULL
                INTO own_left, room, closed FROM budget_periods WHERE id = hold FOR UPDATE;
                IF closed OR own_left < a_amount OR room >= a_amount
                   OR EXISTS (SELECT 1 FROM budgets WHERE frozen AND id = ANY(a_escrow_chain))
                THEN
                    {_NOT_HERE} 'the escrowed budget cannot draw here';
                END IF;
                SELECT min(GREATEST({AVAILABLE}, 0)) INTO smallest FROM budget_periods
                WHERE id = ANY(a_escrow_sources);
                size := GREATEST(a_amount - room,
                                 LEAST(own_left - room, COALESCE(smallest, 0) / a_draw_share));
                FOREACH source IN ARRAY a_escrow_sources LOOP
                    -- statements.GRANT
                    {_TAKE.format(column="granted", amount="size", period="source")}
                    IF NOT FOUND THEN
                        {_NOT_HERE} 'an ancestor cannot grant the whole draw';
                    END IF;
                END LOOP;
                -- counters.record_grant: statements.DRAW, the grant's journal rows
                UPDATE budget_periods SET drawn = drawn + size, drawn_at = p_now
                WHERE id = hold;
                {_journal_row("NULL", "hold", "grant", drawn="size")}
                FOREACH source IN ARRAY a_escrow_sources LOOP
                    {_journal_row("NULL", "source", "grant", granted="size")}
                END LOOP;
                {_ESCROW_ADMIT}
            END IF;
        ELSE
            -- statements.ADMIT
            {_TAKE.format(column="held", amount="a_amount", period="hold")}
        END IF;
        IF NOT FOUND THEN
            {_NOT_HERE} 'the hold needs more than one admission statement';
        END IF;
    END LOOP;
END
$$"""

SETTLE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION budget_tasks_finish(
    p_operation_id bigint, p_owner text, p_key text, p_actual bigint,
    p_estimate_only boolean, p_note text, p_request_id text, p_response_id text,
    p_result text, p_now timestamptz, OUT amount bigint)
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
        {_NOT_HERE} 'the attempt is not sending, or recorded more';
    END IF;
    IF p_operation_id IS NOT NULL THEN
        SELECT status, lease_owner INTO status_was, owner_was
        FROM operations WHERE id = p_operation_id FOR UPDATE;
        IF status_was IS DISTINCT FROM 'running' OR owner_was IS DISTINCT FROM p_owner THEN
            {_NOT_HERE} 'the run does not hold the lease';
        END IF;
        -- read by the operation's index (its attempts are few; a state index would
        -- walk every entry a state ever had until a vacuum)
        IF (SELECT bool_or(state = 'reserved') FROM attempts
            WHERE operation_id = p_operation_id) THEN
            {_NOT_HERE} 'holds of the operation are still to release';
        END IF;
    END IF;
    -- its holds' periods by budget id (statements.LOCK_ATTEMPT), each period read by
    -- its key: an attempt holds in one to a few
    SELECT array_agg(j.period_id ORDER BY (SELECT p.budget_id FROM budget_periods p
                                           WHERE p.id = j.period_id))
    INTO periods FROM journal j WHERE j.attempt_id = made AND j.kind = 'hold';
    FOREACH hold IN ARRAY periods LOOP
        {_journal_row("made", "hold", "charge", held="-amount", spent="p_actual", note="p_note")}
    END LOOP;
    -- statements.RESOLVE_ATTEMPT
    UPDATE attempts SET state = 'settled', actual = p_actual, resolved_at = p_now,
        note = COALESCE(p_note, note), estimate_only = p_estimate_only,
        request_id = COALESCE(request_id, p_request_id),
        response_id = COALESCE(response_id, p_response_id)
    WHERE id = made;  -- locked above, and read as sending
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
            {GRANT_ROOM} AS room, carried_out AS carried, {AVAILABLE} AS available,
            closed_at AS closed
        INTO after;
        IF (after.escrowed AND after.room < 0)
           OR (after.escrowed AND after.room > 0 AND after.closed IS NOT NULL)
           OR (after.carried > 0 AND after.available < after.carried) THEN
            {_NOT_HERE} 'the charge draws past a grant, returns one or takes back a carry';
        END IF;
    END LOOP;
END
$$"""

#: What migration 0016 and ``create_schema`` make on PostgreSQL.
FUNCTIONS_DDL = (ADMIT_FUNCTION, SETTLE_FUNCTION)
#: What the migration's downgrade drops.
DROP_DDL = (
    "DROP FUNCTION IF EXISTS budget_tasks_admit",
    "DROP FUNCTION IF EXISTS budget_tasks_finish",
)

ADMIT = """
SELECT decision, operation_id, stored, runs FROM budget_tasks_admit(
    :key, :fingerprint, :task, :payload, :owner, :expires, :now, :a_key, :budget_id,
    :period_id, :a_fingerprint, :reason, :amount, :price_version, :operation_id, :label,
    :step, :granted, :lookup, :model, :timeout_ms, :request_digest, :input_bound,
    :output_bound,
    CAST(:holds AS bigint[]), :escrow_period, CAST(:escrow_chain AS bigint[]),
    CAST(:escrow_sources AS bigint[]), :draw_share)"""

FINISH = """
SELECT amount FROM budget_tasks_finish(
    :operation_id, :owner, :key, :actual, :estimate_only, :note, :request_id,
    :response_id, :result, :now)"""

#: Every parameter ADMIT names, in order.
ADMIT_PARAMS = tuple(re.findall(r"(?<!:):(\w+)", ADMIT))


def admit_params(*parts: dict[str, Any]) -> dict[str, Any]:
    """ADMIT's parameters from ``parts`` (the delivery's, the attempt's), each one not
    given NULL; a name ADMIT does not take is a mistake."""
    params: dict[str, Any] = dict.fromkeys(ADMIT_PARAMS)
    for part in parts:
        unknown = part.keys() - params.keys()
        assert not unknown, unknown
        params.update(part)
    return params
