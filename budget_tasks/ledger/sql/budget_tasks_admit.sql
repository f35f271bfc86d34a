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
$$
