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
$$
