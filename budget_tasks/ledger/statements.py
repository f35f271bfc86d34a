"""The ledger's named SQL: every statement a delivery, a settlement or an operator's
write runs, in one place, written once with ``:name`` placeholders (the driver layer,
:mod:`.driver`, translates them to the driver's style).

Admission and settlement run thousands of times a second across a fleet; building
SQLAlchemy expressions for each would cost more than the database round trips, so
these are plain parameterised SQL. Reads whose filters vary (listings, reports, the
audit) are built with SQLAlchemy Core and run by the same driver layer.
"""

from __future__ import annotations

#: The one expression for money still available in a period row. Admission, refusal
#: messages and balance reports all use it (invariant 10).
AVAILABLE = "(cap - spent - held - granted)"

#: What an escrowed period may still admit from the grants it drew (what it granted on
#: below was drawn along the whole chain, so it is not in here).
GRANT_ROOM = "(drawn - spent - held)"
#: The same, of a period row named ``p`` in a query: what it holds of grants unused.
_UNUSED_P = "(p.drawn - p.spent - p.held)"

#: A new attempt, reserved; or, admitted and granted in one transaction, already
#: sending and described (what the call is, for reconciliation).
INSERT_ATTEMPT = """
INSERT INTO attempts
    (key, budget_id, period_id, fingerprint, reason, amount, price_version, operation_id,
     label, step, state, created_at, sending_at, lookup, model, timeout_ms, request_digest,
     input_bound, output_bound)
VALUES
    (:key, :budget_id, :period_id, :fingerprint, :reason, :amount, :price_version,
     :operation_id, :label, :step, :state, :now, :sending_at, :lookup, :model,
     CAST(:timeout_ms AS BIGINT), :request_digest, CAST(:input_bound AS BIGINT),
     CAST(:output_bound AS BIGINT))
ON CONFLICT (key) DO NOTHING
RETURNING id"""

# Check and write in one statement: the row lock taken by the UPDATE makes the check
# and the increment one atomic step, and the frozen flag is read in the same statement.
# A closed period admits nothing: what it left unused may have been carried already.
ADMIT = f"""
UPDATE budget_periods SET held = held + :amount
WHERE id = :period_id
  AND {AVAILABLE} >= :amount
  AND closed_at IS NULL
  AND budget_id IN (SELECT id FROM budgets WHERE frozen = :false)
RETURNING id"""

REFUSAL = f"""
SELECT {AVAILABLE}, (SELECT frozen FROM budgets WHERE budgets.id = budget_id), closed_at
FROM budget_periods WHERE id = :period_id"""

#: An attempt by its key: its budget's name (a slice's owner's), what it asked, and its
#: period's start. Each row it names is read by its key, as in LOCK_ATTEMPT.
EXISTING_ATTEMPT = """
SELECT (SELECT COALESCE((SELECT o.name FROM budgets o WHERE o.id = b.slice_of), b.name)
        FROM budgets b WHERE b.id = a.budget_id),
    a.amount, a.fingerprint, a.state, a.reason,
    (SELECT p.period_start FROM budget_periods p WHERE p.id = a.period_id)
FROM attempts a
WHERE a.key = :key"""

#: A journal row, in its period's partition (PostgreSQL) by the period's start.
INSERT_JOURNAL = """
INSERT INTO journal
    (attempt_id, period_id, kind, held_delta, spent_delta, note, ref, created_at, actor,
     drawn_delta, granted_delta, cap_delta, period_start)
VALUES (:attempt_id, :period_id, :kind, :held_delta, :spent_delta, :note, :ref, :now, :actor,
        :drawn_delta, :granted_delta, :cap_delta,
        (SELECT period_start FROM budget_periods WHERE id = :period_id))"""

MARK_SENDING = """
UPDATE attempts
SET state = 'sending', sending_at = :now,
    provider = COALESCE(:provider, provider), request_id = COALESCE(:request_id, request_id)
WHERE key = :key AND state = 'reserved'
RETURNING id"""

ATTEMPT_STATE = "SELECT state FROM attempts WHERE key = :key"

#: Written while a call is out (what it is, its request id): on the hot path, so
#: prebuilt here rather than through SQLAlchemy Core, which pings per transaction.
DESCRIBE_ATTEMPT = """
UPDATE attempts SET lookup = COALESCE(:lookup, lookup), model = COALESCE(:model, model),
    response_id = COALESCE(:response_id, response_id),
    timeout_ms = COALESCE(CAST(:timeout_ms AS BIGINT), timeout_ms),
    request_digest = COALESCE(:request_digest, request_digest),
    input_bound = COALESCE(CAST(:input_bound AS BIGINT), input_bound),
    output_bound = COALESCE(CAST(:output_bound AS BIGINT), output_bound)
WHERE key = :key"""

RECORD_REQUEST_ID = """
UPDATE attempts SET request_id = :request_id
WHERE key = :key AND request_id IS NULL AND state <> 'reserved'
RETURNING id"""

ATTEMPT_REQUEST_ID = "SELECT state, request_id FROM attempts WHERE key = :key"

# The attempt row, locked, with each period row it holds: one row per period, in the
# order reserve locked them (budget id), so settlement takes locks in the same order.
# Each period is read by its key: joined, PostgreSQL may merge-join the whole periods
# index (every budget's every day) to find an attempt's one to three.
LOCK_ATTEMPT = """
SELECT a.id, a.amount, a.actual, a.state, a.recorded_actual, j.period_id
FROM attempts a
JOIN journal j ON j.attempt_id = a.id AND j.kind = 'hold'
WHERE a.key = :key
ORDER BY (SELECT p.budget_id FROM budget_periods p WHERE p.id = j.period_id){for_update}"""

# Each change of a period's counters returns, for what must follow it: whether the
# period is escrowed and its grant room (a charge above its hold draws the rest), what
# it carried on and what it has left (a closed period that carried too much gives back).
_AFTER_CHANGE = f"""(SELECT escrow FROM budgets WHERE budgets.id = budget_id), {GRANT_ROOM},
    carried_out, {AVAILABLE}, closed_at"""

APPLY_SETTLEMENT = f"""
UPDATE budget_periods SET held = held - :amount, spent = spent + :actual,
    overrun = overrun + CASE WHEN :actual > :amount THEN :actual - :amount ELSE 0 END
WHERE id = :period_id
RETURNING {_AFTER_CHANGE}"""

TAKE_BACK_CARRY = """
UPDATE budget_periods SET carried_out = carried_out - :deficit WHERE id = :period_id"""

#: The period right after the given one, of the same budget: where its carry went. It
#: returns what that period carried on and what it has left, for the next step.
LOWER_NEXT_CAP = f"""
UPDATE budget_periods SET cap = cap - :deficit
WHERE id = (
    SELECT n.id FROM budget_periods n JOIN budget_periods o ON o.budget_id = n.budget_id
    WHERE o.id = :period_id AND n.period_start > o.period_start
    ORDER BY n.period_start LIMIT 1
)
RETURNING id, carried_out, {AVAILABLE}"""

ADJUSTMENT_SEEN = """
SELECT 1 FROM journal WHERE attempt_id = :attempt_id AND ref = :ref"""

# What the attempt has been charged so far in its own budget's period.
ATTEMPT_CHARGED = """
SELECT COALESCE(SUM(j.spent_delta), 0) FROM journal j JOIN attempts a ON a.id = j.attempt_id
WHERE j.attempt_id = :attempt_id AND j.period_id = a.period_id"""

APPLY_ADJUSTMENT = f"""
UPDATE budget_periods SET spent = spent + :delta WHERE id = :period_id
RETURNING {_AFTER_CHANGE}"""

#: What a call's answer said (records.Answered), kept with the attempt's settlement or
#: its unknown: ids and the vendor as first written, the key's hint and tokens as said.
_ANSWERED = """request_id = COALESCE(request_id, :request_id),
    response_id = COALESCE(response_id, :response_id),
    provider = COALESCE(provider, :provider),
    credential = COALESCE(:credential, credential),
    input_tokens = COALESCE(CAST(:input_tokens AS BIGINT), input_tokens),
    output_tokens = COALESCE(CAST(:output_tokens AS BIGINT), output_tokens),
    answered_by = COALESCE(:answered_by, answered_by)"""

#: The resolution, with what the call's answer said when the run kept it for it
#: (written with the settlement: one commit).
RESOLVE_ATTEMPT = f"""
UPDATE attempts SET state = :state, actual = :actual, resolved_at = :now,
    note = COALESCE(:note, note), estimate_only = :estimate_only,
    answer = COALESCE(:answer, answer),
    {_ANSWERED}
WHERE id = :attempt_id AND state = :expected"""

#: sending -> unknown, compare-and-set; the usage a run recorded stays as proof of billing.
#: An answer whose usage was past what its request allowed names no lookup any more
#: (``lookup`` 'untrusted'): beat does not charge it again as found.
MARK_UNKNOWN = f"""
UPDATE attempts SET state = 'unknown', note = :note, lookup = COALESCE(:lookup, lookup),
    {_ANSWERED},
    recorded_actual = CASE WHEN CAST(:recorded AS BIGINT) IS NULL THEN recorded_actual
                           ELSE CAST(:recorded AS BIGINT) END
WHERE key = :key AND state = 'sending'
RETURNING id"""

#: What a finished call reported, in one statement: the request and response ids, and
#: its priced usage added to what the attempt recorded (proof of billing, written as
#: soon as it is known so that no crash after it can drop it).
RECORD_CALL = """
UPDATE attempts SET request_id = COALESCE(request_id, :request_id),
    response_id = COALESCE(:response_id, response_id),
    recorded_actual = CASE WHEN CAST(:cost AS BIGINT) IS NULL THEN recorded_actual
                           ELSE COALESCE(recorded_actual, 0) + CAST(:cost AS BIGINT) END
WHERE key = :key AND state IN ('sending', 'unknown')
RETURNING id"""

#: An unknown attempt whose found answer's usage was past what its request allowed.
DISTRUST = """
UPDATE attempts SET lookup = :lookup, note = :note
WHERE key = :key AND state = 'unknown'
RETURNING id"""

BALANCE = f"""
SELECT cap, spent, held, {AVAILABLE} FROM budget_periods WHERE id = :period_id"""

# -- budgets -----------------------------------------------------------------------------

LOCK_BUDGET = """
SELECT id, cap, rollover_ceiling FROM budgets WHERE name = :name{for_update_plain}"""

#: The budget's open period (the latest not closed), locked, with what it has committed.
#: A budget's open period, locked, with what it has committed: its spent and held, and
#: what it granted to the escrowed budgets under it (their slices' too), which is
#: theirs to spend until given back.
LOCK_OPEN_PERIOD = """
SELECT id, cap, spent + held + granted FROM budget_periods
WHERE budget_id = :budget_id AND closed_at IS NULL
ORDER BY period_start DESC LIMIT 1{for_update_plain}"""

SET_BUDGET_CAP = "UPDATE budgets SET cap = :cap WHERE id = :budget_id"

MOVE_PERIOD_CAP = "UPDATE budget_periods SET cap = cap + :delta WHERE id = :period_id"

#: The period of an operation's latest attempt (where a reopen is journaled).
LATEST_PERIOD_OF_OPERATION = """
SELECT period_id FROM attempts WHERE operation_id = :operation_id ORDER BY id DESC LIMIT 1"""

# -- operations --------------------------------------------------------------------------

INSERT_OPERATION = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, runs, deliveries, replays, created_at, updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'pending', 0, 0, 0, :now, :now)
ON CONFLICT (key) DO NOTHING"""

LOCK_OPERATION = """
SELECT id, fingerprint, status, result, error, lease_owner, lease_expires_at, runs,
       next_reason
FROM operations WHERE key = :key{for_update_plain}"""

LOCK_OPERATION_BY_ID = """
SELECT id, fingerprint, status, result, error, lease_owner, lease_expires_at, runs,
       next_reason
FROM operations WHERE id = :operation_id{for_update_plain}"""

#: The operation's main-call attempts, and the latest attempt of each labelled call
#: if it is not resolved, newest first: what a delivery or a conclusion decides from.
#: (An earlier attempt that a later one replaced, a resend, is reconciled on its own.)
OPERATION_ATTEMPTS = """
SELECT a.id, a.key, a.state, a.amount, a.reason, a.label, a.answer, a.recorded_actual
FROM attempts a
WHERE a.operation_id = :operation_id
  AND (a.label IS NULL OR (
        a.state IN ('reserved', 'sending', 'unknown')
        AND NOT EXISTS (SELECT 1 FROM attempts b
                        WHERE b.operation_id = a.operation_id AND b.step = a.step
                          AND b.id > a.id)))
ORDER BY a.id DESC"""

#: The latest attempt of one labelled call, and how many it has had.
STEP_ATTEMPT = """
SELECT key, state, amount, reason, answer, recorded_actual,
       (SELECT COUNT(*) FROM attempts s WHERE s.operation_id = :operation_id AND s.step = :step)
FROM attempts
WHERE operation_id = :operation_id AND step = :step
ORDER BY id DESC LIMIT 1"""

COUNT_DELIVERY = """
UPDATE operations SET deliveries = deliveries + 1, replays = replays + :replay,
    updated_at = :now
WHERE id = :operation_id"""

#: A delivery of a finished key, in one statement: counted, and its stored result read.
REPLAY = """
UPDATE operations SET deliveries = deliveries + 1, replays = replays + 1, updated_at = :now
WHERE key = :key AND fingerprint = :fingerprint AND status = 'succeeded'
RETURNING id, result, runs"""

#: A first delivery: the operation recorded with this delivery's lease, in one statement.
INSERT_RUNNING_OPERATION = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, lease_owner, lease_expires_at, runs,
     deliveries, replays, created_at, updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'running', :owner, :expires, 1, 1, 0, :now, :now)
ON CONFLICT (key) DO NOTHING
RETURNING id"""

#: A delivery whose admission was refused (the budget): its transaction rolled back, so
#: the operation is recorded here (pending, if new) with why; an operation another
#: delivery moved meanwhile (compare-and-set on the statuses a delivery may be refused
#: from) only counts the delivery. Why it runs next stays as it was: a refusal runs
#: nothing, so an operator's reopen (``manual``) or a 429's retry is still what its next
#: run is.
RECORD_REFUSAL = """
INSERT INTO operations
    (key, fingerprint, task, payload, status, error, runs, deliveries, replays, created_at,
     updated_at)
VALUES (:key, :fingerprint, :task, :payload, 'pending', :error, 0, 1, 0, :now, :now)
ON CONFLICT (key) DO UPDATE SET deliveries = operations.deliveries + 1,
    updated_at = excluded.updated_at,
    error = CASE WHEN operations.status IN ('pending', 'retryable') THEN excluded.error
                 ELSE operations.error END,
    status = CASE WHEN operations.status = 'retryable' THEN 'pending'
                  ELSE operations.status END"""

TAKE_LEASE = """
UPDATE operations SET status = 'running', lease_owner = :owner, lease_expires_at = :expires,
    runs = runs + 1, deliveries = deliveries + 1, updated_at = :now
WHERE id = :operation_id"""

#: Move an operation from the status (and lease owner) its writer read to another, and
#: give the lease back. ``runs`` counts runs that took the lease and never recorded
#: their end (what poison detection counts): a run ending itself (``run_ended``) is
#: taken off it. SET expressions read the row as it was.
SET_OPERATION = """
UPDATE operations SET status = :status, result = COALESCE(:result, result),
    error = :error, next_reason = :next_reason, lease_owner = NULL,
    lease_expires_at = NULL, updated_at = :now, completed_at = :completed_at,
    runs = CASE WHEN :run_ended = 1 AND runs > 0 THEN runs - 1 ELSE runs END
WHERE id = :operation_id AND status = :expected
  AND COALESCE(lease_owner, '') = COALESCE(:expected_owner, '')"""

START_SIDE_EFFECT = """
INSERT INTO side_effects (operation_id, name, state, created_at)
VALUES (:operation_id, :name, 'started', :now)
ON CONFLICT (operation_id, name) DO NOTHING
RETURNING id"""

SIDE_EFFECT = """
SELECT state, result FROM side_effects WHERE operation_id = :operation_id AND name = :name"""

FINISH_SIDE_EFFECT = """
UPDATE side_effects SET state = 'done', result = :result, completed_at = :now
WHERE operation_id = :operation_id AND name = :name"""

#: Where an attempt sits in its operation, and whether it is still the latest attempt
#: of its call (the main call, or one labelled call).
ATTEMPT_POSITION = """
SELECT a.operation_id, (SELECT o.key FROM operations o WHERE o.id = a.operation_id),
    a.label, a.state,
    CASE WHEN EXISTS (
        SELECT 1 FROM attempts b
        WHERE b.operation_id = a.operation_id AND b.id > a.id
          AND ((a.label IS NULL AND b.label IS NULL) OR (a.step IS NOT NULL AND b.step = a.step))
    ) THEN 0 ELSE 1 END
FROM attempts a
WHERE a.key = :key"""

#: Attempts held by runs that may be gone: open (sending) or never granted (reserved),
#: under an operation no lease holds by time (not running, or its lease expired):
#: filtered here, so that live leases, however many, never hide them behind the limit,
#: and read through the running operations and the unsettled attempts, not the history.
ORPHAN_CANDIDATES = """
SELECT a.key, a.state, o.key, o.lease_owner, o.lease_expires_at, o.status, a.label,
       a.amount, a.recorded_actual
FROM attempts a JOIN operations o ON o.id = a.operation_id
WHERE a.state IN ('reserved', 'sending')
  AND a.operation_id NOT IN (
      SELECT id FROM operations
      WHERE status = 'running' AND lease_expires_at > :now AND lease_owner IS NOT NULL)
ORDER BY a.id
LIMIT :limit"""

#: The same, under leases still running by time whose owner names this checker's boot
#: and PID namespace: only there can "its process is gone" be proved (see leases.py).
ORPHAN_CANDIDATES_HERE = """
SELECT a.key, a.state, o.key, o.lease_owner, o.lease_expires_at, o.status, a.label,
       a.amount, a.recorded_actual
FROM attempts a JOIN operations o ON o.id = a.operation_id
WHERE a.state IN ('reserved', 'sending')
  AND o.status = 'running' AND o.lease_expires_at > :now AND o.lease_owner LIKE :proof
ORDER BY a.id
LIMIT :limit"""

STORE_SIDE_EFFECT = """
INSERT INTO side_effects (operation_id, name, state, result, created_at, completed_at)
VALUES (:operation_id, :name, 'done', :result, :now, :now)
ON CONFLICT (operation_id, name) DO UPDATE
SET state = 'done', result = excluded.result, completed_at = excluded.completed_at"""

RENEW_LEASE = """
UPDATE operations SET lease_expires_at = :expires, deliveries = deliveries + 1,
    updated_at = :now
WHERE id = :operation_id"""

FORGET_SIDE_EFFECT = """
DELETE FROM side_effects WHERE operation_id = :operation_id AND name = :name
  AND state = 'started'"""

# -- budgets and their periods -------------------------------------------------------

INSERT_BUDGET = """
INSERT INTO budgets (name, tenant, parent_id, cap, period, renewal, rollover_ceiling, frozen,
                     created_at, escrow, slices, slice_of)
VALUES (:name, :tenant, :parent_id, :cap, :period, :renewal, :rollover_ceiling, :false, :now,
        :escrow, :slices, :slice_of)
ON CONFLICT (name) DO NOTHING
RETURNING id"""

BUDGET_ID = "SELECT id FROM budgets WHERE name = :name"

#: A budget's place in its chain: (id, name, period, parent id).
BUDGET_LINK_BY_NAME = """
SELECT id, name, period, parent_id, escrow, slices FROM budgets WHERE name = :name"""
BUDGET_LINK = """
SELECT id, name, period, parent_id, escrow, slices FROM budgets WHERE id = :budget_id"""

#: The slices a budget admits in now: the first ``:slices`` made for it.
SLICE_NAMES = "SELECT name FROM budgets WHERE slice_of = :owner_id ORDER BY id LIMIT :slices"

SLICE_COUNT = "SELECT count(*) FROM budgets WHERE slice_of = :owner_id"

SET_SLICES = "UPDATE budgets SET slices = :slices WHERE id = :owner_id"

#: A sliced budget's slices' counters in one period, summed.
#: The escrowed budgets' periods that still use what they were granted: the open ones
#: (their partial index) and those an attempt still holds money in (through the holding
#: attempts' hold rows). Every other escrowed period is closed, holds nothing and keeps
#: no unused grant (it gave it back as it closed or as it was settled late), so it has
#: spent exactly what it drew, and its ancestors' ``granted`` says so. What the reports
#: read grows with the work in flight, not with the history.
#: (budget id, period start, spent, held, drawn)
ESCROWED_IN_USE = """
SELECT p.budget_id, p.period_start, p.spent, p.held, p.drawn
FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE p.closed_at IS NULL AND b.escrow = :true
UNION
SELECT p.budget_id, p.period_start, p.spent, p.held, p.drawn
FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE b.escrow = :true AND p.id IN (
    SELECT j.period_id FROM attempts a JOIN journal j ON j.attempt_id = a.id
    WHERE a.state IN ('reserved', 'sending', 'unknown') AND j.kind = 'hold')"""

#: The escrowed periods (any, open or closed) since ``since`` that were charged above
#: their reservations: their ancestors' overrun rolls them in.
ESCROWED_OVERRUNS = """
SELECT p.budget_id, p.period_start, p.overrun
FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE b.escrow = :true AND p.overrun > 0 AND p.period_start >= :since"""

#: Each budget's parent: the tree a roll-up walks.
BUDGET_PARENTS = "SELECT id, parent_id FROM budgets WHERE parent_id IS NOT NULL"

SET_FROZEN = "UPDATE budgets SET frozen = :frozen WHERE name = :name"

#: A budget's weight in the rate windows its calls share (NULL: none of its own).
SET_RATE_WEIGHT = """
UPDATE budgets SET rate_weight = CAST(:weight AS INTEGER) WHERE name = :name AND slice_of IS NULL"""

#: What a budget renews by: (period, cap, renewal, rollover ceiling).
BUDGET_RENEWAL = "SELECT period, cap, renewal, rollover_ceiling FROM budgets WHERE id = :budget_id"

#: The budget's latest period starting at ``start`` or later: one is open already when
#: this host's clock is behind the host that opened it.
LATEST_PERIOD_FROM = """
SELECT id, period_start FROM budget_periods
WHERE budget_id = :budget_id AND period_start >= :start
ORDER BY period_start DESC LIMIT 1"""

#: Close every earlier open period (compare-and-set on closed_at) before carrying: once
#: closed, a period admits nothing, so what it leaves unused cannot be spent and carried.
CLOSE_PERIODS_BEFORE = """
UPDATE budget_periods SET closed_at = :now
WHERE budget_id = :budget_id AND period_start < :start AND closed_at IS NULL
RETURNING id"""

#: The period a new one carries from (the one right before it), open or closed: an
#: escrowed budget's period is closed by its parent's next period when that opens
#: first, and carries all the same. (id, cap, spent + granted, held).
CARRY_FROM = """
SELECT id, cap, spent + granted, held FROM budget_periods
WHERE budget_id = :budget_id AND period_start = :start"""

SET_CARRIED_OUT = "UPDATE budget_periods SET carried_out = :carried WHERE id = :period_id"

#: Two openers may race: the unique (budget_id, period_start) keeps the first, and
#: only the opener whose row this is (its id returned) records the carry.
INSERT_PERIOD = """
INSERT INTO budget_periods
    (budget_id, period_start, cap, spent, held, opened_at, carried_out, overrun)
VALUES (:budget_id, :start, :cap, 0, 0, :now, 0, 0)
ON CONFLICT (budget_id, period_start) DO NOTHING
RETURNING id"""

PERIOD_ID = "SELECT id FROM budget_periods WHERE budget_id = :budget_id AND period_start = :start"

# -- maintenance ---------------------------------------------------------------------------

#: Flag, once, every hold in sending/unknown older than the cutoff.
FLAG_STALE = """
UPDATE attempts SET flagged_at = :now
WHERE state IN ('sending', 'unknown') AND created_at <= :cutoff AND flagged_at IS NULL
RETURNING key"""

#: Unknown attempts due for a provider lookup; rows another claimer holds are skipped.
DUE_FOR_LOOKUP = """
SELECT id, lookups, key FROM attempts
WHERE state = 'unknown' AND (next_lookup_at IS NULL OR next_lookup_at <= :now)
ORDER BY id
LIMIT :limit{for_update_skip_locked}"""

PUSH_LOOKUP_BACK = """
UPDATE attempts SET lookups = :lookups, next_lookup_at = :next_lookup_at
WHERE id = :attempt_id"""

# -- the purge: every copy of user content past its retention ---------------------------
# Each statement takes one batch (:batch rows, oldest first) through a partial index
# that holds only what still has content (see schema.PURGEABLE), and commits: the
# hourly purge never locks every row it purges at once, and reads what is left to
# purge, not the history.

#: A finished operation's result, arguments and error text.
PURGE_OPERATIONS = """
UPDATE operations SET result = NULL, payload = NULL, error = NULL
WHERE id IN (
    SELECT id FROM operations
    WHERE completed_at <= :cutoff
      AND (result IS NOT NULL OR payload IS NOT NULL OR error IS NOT NULL)
    ORDER BY completed_at LIMIT :batch)"""

#: An unfinished operation idle past the retention: its arguments (the prompts).
PURGE_UNFINISHED_PAYLOADS = """
UPDATE operations SET payload = NULL
WHERE id IN (
    SELECT id FROM operations
    WHERE completed_at IS NULL AND payload IS NOT NULL AND updated_at <= :cutoff
    ORDER BY updated_at LIMIT :batch)"""

#: Stored answers: dropped for a finished operation; for one that may still run, a
#: marker that refuses their replay.
PURGE_SIDE_EFFECTS = """
UPDATE side_effects SET result = CASE
        WHEN (SELECT o.completed_at FROM operations o WHERE o.id = side_effects.operation_id)
             IS NULL
        THEN :marker ELSE NULL END
WHERE id IN (
    SELECT id FROM side_effects
    WHERE result IS NOT NULL AND completed_at <= :cutoff AND result <> :marker
    ORDER BY completed_at LIMIT :batch)"""

#: A resolved attempt's found answer and its note (error text; the journal keeps why).
PURGE_ATTEMPTS = """
UPDATE attempts SET note = NULL,
    answer = CASE
        WHEN answer IS NULL THEN NULL
        WHEN operation_id IS NOT NULL AND (
            SELECT o.completed_at FROM operations o WHERE o.id = attempts.operation_id
        ) IS NULL THEN :marker
        ELSE NULL END
WHERE id IN (
    SELECT id FROM attempts
    WHERE resolved_at <= :cutoff
      AND (note IS NOT NULL OR answer IS NOT NULL)
      AND (note IS NOT NULL OR answer <> :marker)
    ORDER BY resolved_at LIMIT :batch)"""

#: A period's counters by its budget and start (a balance read opens nothing).
BALANCE_AT = f"""
SELECT cap, spent, held, {AVAILABLE}, granted, drawn FROM budget_periods
WHERE budget_id = :budget_id AND period_start = :start"""

#: This ledger's installation id (one row, made with the tables).
INSTALLATION = """SELECT installation_id FROM installation WHERE id = 1"""

#: The row, for a ledger whose tables were made before there was one.
INSERT_INSTALLATION = """
INSERT INTO installation (id, installation_id, created_at) VALUES (1, :installation_id, :now)
ON CONFLICT (id) DO NOTHING"""

#: An operator reopens a failed operation: its next delivery runs it again, counted
#: from no dead runs; compare-and-set on the status read.
REOPEN_OPERATION = """
UPDATE operations SET status = :status, error = NULL, next_reason = 'manual',
    lease_owner = NULL, lease_expires_at = NULL, runs = 0, completed_at = NULL,
    updated_at = :now
WHERE id = :operation_id AND status = :expected"""

INSERT_OPERATION_EVENT = """
INSERT INTO operation_events (operation_id, kind, from_status, to_status, by, note, created_at)
VALUES (:operation_id, :kind, :from_status, :to_status, :by, :note, :now)"""


# -- escrow --------------------------------------------------------------------------------
# An escrowed budget admits on its own period row against what it drew from its
# ancestors' periods (each counts the grant in ``granted``, against its cap); it draws
# again when its grant is short, and gives back what it does not use.


def _chain_ids(depth: int) -> str:
    return ", ".join(f":b{i}" for i in range(depth))


def escrow_admit(depth: int) -> str:
    """Admit within the period's own cap and its grant room, in one statement; no
    budget of the chain (``:b0`` .. its ``depth``) may be frozen, so that a grant is
    never a way around an ancestor's freeze; and no ancestor's period (``:p1`` ..) may
    be past its cap by more than the grant leaves after this admission (an overrun
    elsewhere under it spent what the grant set aside)."""
    sources = ", ".join(f":p{i}" for i in range(1, depth))
    return f"""
UPDATE budget_periods SET held = held + :amount
WHERE id = :period_id
  AND {AVAILABLE} >= :amount
  AND {GRANT_ROOM} >= :amount
  AND closed_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM budgets WHERE frozen = :true AND id IN ({_chain_ids(depth)}))
  AND NOT EXISTS (
    SELECT 1 FROM budget_periods a WHERE a.id IN ({sources})
      AND a.cap - a.spent - a.held - a.granted
          < :amount - (budget_periods.drawn - budget_periods.spent - budget_periods.held)
  )
RETURNING id"""


def frozen_in_chain(depth: int) -> str:
    """The frozen budgets of a chain, the nearest first by id."""
    return f"""
SELECT name FROM budgets WHERE frozen = :true AND id IN ({_chain_ids(depth)})
ORDER BY id LIMIT 1"""


#: The escrowed period, locked, before it draws: what it has left under its own cap,
#: its grant room and whether it is closed.
LOCK_FOR_DRAW = f"""
SELECT {AVAILABLE}, {GRANT_ROOM}, closed_at FROM budget_periods
WHERE id = :period_id{{for_update_plain}}"""

#: What an ancestor's period has left, read without a lock to size a grant.
PERIOD_AVAILABLE = f"SELECT {AVAILABLE} FROM budget_periods WHERE id = :period_id"

#: The same, locked: what the admission reads of it must hold until it commits.
LOCK_PERIOD_AVAILABLE = f"""
SELECT {AVAILABLE} FROM budget_periods WHERE id = :period_id{{for_update_plain}}"""

#: A grant out of an ancestor's period: compare-and-set like an admission.
GRANT = f"""
UPDATE budget_periods SET granted = granted + :amount
WHERE id = :period_id
  AND {AVAILABLE} >= :amount
  AND closed_at IS NULL
  AND budget_id IN (SELECT id FROM budgets WHERE frozen = :false)
RETURNING id"""

#: A grant owed whatever the period has left (a charge above a hold drew it already),
#: or one given back (a negative amount).
GRANT_OWED = f"""
UPDATE budget_periods SET granted = granted + :amount WHERE id = :period_id
RETURNING carried_out, {AVAILABLE}"""

PERIOD_OWNER = "SELECT budget_id, period_start FROM budget_periods WHERE id = :period_id"

DRAW = """
UPDATE budget_periods SET drawn = drawn + :amount, drawn_at = :now WHERE id = :period_id"""

UNDRAW = "UPDATE budget_periods SET drawn = drawn - :amount WHERE id = :period_id"

#: An escrowed period about to give back what it does not use, locked; where
#: ``{for_update_skip_locked}``, one in the middle of an admission is passed over.
LOCK_FOR_RETURN = f"""
SELECT budget_id, period_start, {GRANT_ROOM} FROM budget_periods
WHERE id = :period_id{{for_update_plain}}"""

LOCK_FOR_RETURN_UNLESS_BUSY = f"""
SELECT budget_id, period_start, {GRANT_ROOM} FROM budget_periods
WHERE id = :period_id{{for_update_skip_locked}}"""

#: Every budget under ``:parent_id``, at any depth (a tenant's slices too).
_DESCENDANTS = """
WITH RECURSIVE below(id) AS (
    SELECT id FROM budgets WHERE parent_id = :parent_id
    UNION ALL SELECT b.id FROM budgets b JOIN below ON b.parent_id = below.id
)"""

#: The open periods of the escrowed budgets under a budget, at any depth (but one),
#: that hold grant money they do not use: each drew it from this budget too (a grant is
#: drawn from every ancestor), so a short budget takes back a tenant's slices' grants
#: as it takes back the tenant's.
UNUSED_GRANTS_UNDER = f"""{_DESCENDANTS}
SELECT p.id FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE b.id IN (SELECT id FROM below) AND b.escrow = :true AND b.id <> :but
  AND p.closed_at IS NULL AND {_UNUSED_P} > 0
ORDER BY p.id"""

#: The open periods, begun before ``:start``, of the escrowed budgets under a budget
#: (at any depth), closed: a budget about to open its next period takes back what they
#: hold unused first, so that what it carries counts it.
CLOSE_ESCROWED_BELOW_BEFORE = f"""{_DESCENDANTS}
UPDATE budget_periods SET closed_at = :now
WHERE closed_at IS NULL AND period_start < :start
  AND budget_id IN (SELECT b.id FROM budgets b WHERE b.escrow = :true
                    AND b.id IN (SELECT id FROM below))
RETURNING id"""

#: Escrowed periods with grant money they do not use that are closed, or that have
#: not drawn since ``:idle_since``: beat gives it back.
#: Escrowed periods holding grants they do not use (through the partial index of
#: periods that hold a grant at all: the history has none).
GRANTS_TO_RETURN = f"""
SELECT p.id FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE p.drawn > 0 AND b.escrow = :true AND {_UNUSED_P} > 0
  AND (p.closed_at IS NOT NULL OR p.drawn_at < :idle_since)
ORDER BY p.id LIMIT :limit"""

#: Every escrowed budget below a budget (itself too), by their parent links.
ESCROWED_BELOW = f"""
WITH RECURSIVE below(id) AS (
    SELECT id FROM budgets WHERE name = :name
    UNION ALL SELECT b.id FROM budgets b JOIN below ON b.parent_id = below.id
)
SELECT p.id FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE b.id IN (SELECT id FROM below) AND b.escrow = :true AND p.closed_at IS NULL
  AND {_UNUSED_P} > 0
ORDER BY p.id"""


# -- the audit -----------------------------------------------------------------------------
# An audit proves each period's counters from the journal. It reads the journal rows
# after the position the last one reached, added to the sums it proved then; a full one
# reads them all. The position is only ever one every journal writer before it has
# passed: a SHARE lock on the journal waits for them (SQLite's writers are serial).

LOCK_JOURNAL = "LOCK TABLE journal IN SHARE MODE"

JOURNAL_END = "SELECT COALESCE(MAX(id), 0) FROM journal"

#: PostgreSQL's estimate of the journal's rows (-1 before its first ANALYZE).
#: PostgreSQL's estimate of the journal's rows: the sum over its partitions, or -1 while
#: one was never analysed.
JOURNAL_ROWS_ESTIMATE = """
SELECT CASE WHEN MIN(c.reltuples) < 0 THEN -1 ELSE CAST(SUM(c.reltuples) AS BIGINT) END
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = CAST('journal' AS regclass)"""

JOURNAL_ROWS = "SELECT COUNT(*) FROM journal"

JOURNAL_ROWS_AFTER = "SELECT COUNT(*) FROM journal WHERE id > :since"

#: The one position row, made if missing, then locked: audits run one at a time.
MAKE_AUDIT_POSITION = """
INSERT INTO audit_position (id, journal_id, audited_at) VALUES (1, 0, :now)
ON CONFLICT (id) DO NOTHING"""

LOCK_AUDIT_POSITION = "SELECT journal_id FROM audit_position WHERE id = 1{for_update_plain}"

AUDIT_SINCE = "SELECT journal_id FROM audit_position WHERE id = 1"

SET_AUDIT_POSITION = "UPDATE audit_position SET journal_id = :upto, audited_at = :now WHERE id = 1"

FORGET_CHECKPOINTS = "DELETE FROM audit_checkpoints"

#: What a full audit starts from: the sums of the journal rows retention archived.
SEED_CHECKPOINTS = """
INSERT INTO audit_checkpoints (period_id, held, spent, overrun, drawn, granted)
SELECT period_id, held, spent, overrun, drawn, granted FROM archived_periods"""

#: A charge above its hold, the overrun it records.
_OVERRUN = """CASE WHEN kind = 'charge' AND spent_delta + held_delta > 0
    THEN spent_delta + held_delta ELSE 0 END"""

_JOURNAL_SUMS = f"""SUM(held_delta), SUM(spent_delta), SUM({_OVERRUN}), SUM(drawn_delta),
    SUM(granted_delta)"""

#: The periods to prove (the open ones, and the closed ones with journal rows after
#: ``:since``), each with its counters and what the journal derives them to: the
#: proven sums plus the rows after ``:since``. One statement, so one snapshot: every
#: counter change commits with its journal row. The open periods come through their
#: partial index and the touched ones by key, so the history is never scanned.
_AUDIT = f"""
WITH recent (period_id, held, spent, overrun, drawn, granted) AS (
    SELECT period_id, {_JOURNAL_SUMS} FROM journal WHERE id > :since GROUP BY period_id
), targets AS (
    {{targets}}
)
SELECT b.name, p.period_start,
    p.held, COALESCE(c.held, 0) + COALESCE(r.held, 0),
    p.spent, COALESCE(c.spent, 0) + COALESCE(r.spent, 0),
    p.overrun, COALESCE(c.overrun, 0) + COALESCE(r.overrun, 0),
    p.drawn, COALESCE(c.drawn, 0) + COALESCE(r.drawn, 0),
    p.granted, COALESCE(c.granted, 0) + COALESCE(r.granted, 0)
FROM targets p
JOIN budgets b ON b.id = p.budget_id
LEFT JOIN audit_checkpoints c ON c.period_id = p.id
LEFT JOIN recent r ON r.period_id = p.id
ORDER BY b.name, p.period_start"""
_PERIOD_COUNTERS = (
    "p.id, p.budget_id, p.period_start, p.held, p.spent, p.overrun, p.drawn, p.granted"
)
AUDIT_PERIODS = _AUDIT.format(
    targets=f"""SELECT {_PERIOD_COUNTERS} FROM budget_periods p WHERE p.closed_at IS NULL
    UNION ALL
    SELECT {_PERIOD_COUNTERS} FROM budget_periods p
    WHERE p.closed_at IS NOT NULL AND p.id IN (SELECT period_id FROM recent)"""
)
#: A full audit's: every period.
AUDIT_ALL_PERIODS = _AUDIT.format(targets=f"SELECT {_PERIOD_COUNTERS} FROM budget_periods p")

#: Sums added to what the checkpoints hold (the tail of an INSERT ... SELECT).
_ADD_TO_CHECKPOINTS = """
ON CONFLICT (period_id) DO UPDATE SET
    held = audit_checkpoints.held + excluded.held,
    spent = audit_checkpoints.spent + excluded.spent,
    overrun = audit_checkpoints.overrun + excluded.overrun,
    drawn = audit_checkpoints.drawn + excluded.drawn,
    granted = audit_checkpoints.granted + excluded.granted"""

#: The proven sums moved on to ``:upto``: journal rows every writer had committed.
ADVANCE_CHECKPOINTS = f"""
INSERT INTO audit_checkpoints (period_id, held, spent, overrun, drawn, granted)
SELECT period_id, {_JOURNAL_SUMS} FROM journal
WHERE id > :since AND id <= :upto GROUP BY period_id{_ADD_TO_CHECKPOINTS}"""

# What the audit proved of each journal partition (PostgreSQL): its lowest and highest
# row, by key (id and period start), and how many. A partition emptied (TRUNCATE with
# its guard off) or detached behind the journal leaves the incremental audit's sums
# standing, since it reads only the rows after its position: these find it by key.

#: Whether the table is there (a database not yet migrated to 0017 has none).
AUDIT_PARTITIONS_MADE = "SELECT to_regclass('audit_partitions') IS NOT NULL"

#: The partitions (by name) of the rows after ``:since`` up to ``:upto``, their lowest
#: and highest row and how many: added to what the audit proved of them, or (the first
#: or a full audit, from 0) in place of it.
_RECORD_PARTITIONS = """
INSERT INTO audit_partitions (partition, low_id, low_start, high_id, high_start, journal_rows)
SELECT (SELECT c.relname FROM pg_class c WHERE c.oid = b.part), b.low_id,
    (SELECT j.period_start FROM journal j WHERE j.id = b.low_id AND j.tableoid = b.part),
    b.high_id,
    (SELECT j.period_start FROM journal j WHERE j.id = b.high_id AND j.tableoid = b.part),
    b.n
FROM (
    SELECT tableoid AS part, MIN(id) AS low_id, MAX(id) AS high_id, COUNT(*) AS n
    FROM journal WHERE id > :since AND id <= :upto GROUP BY tableoid
) b
ON CONFLICT (partition) DO UPDATE SET {update}"""
RECORD_PARTITIONS = _RECORD_PARTITIONS.format(
    update="""high_id = excluded.high_id, high_start = excluded.high_start,
    journal_rows = audit_partitions.journal_rows + excluded.journal_rows"""
)
RECORD_ALL_PARTITIONS = _RECORD_PARTITIONS.format(
    update="""low_id = excluded.low_id, low_start = excluded.low_start,
    high_id = excluded.high_id, high_start = excluded.high_start,
    journal_rows = excluded.journal_rows"""
)

#: The proved partitions whose lowest or highest proved row is gone: two lookups by key
#: each, pruned as they run to the partition the row's period start names. Each is a
#: scalar subquery, which the planner never turns into a join or a hash of the journal.
#: An archived month is gone by design.
LOST_PARTITIONS = """
SELECT a.partition, a.low_id, a.low_start, a.high_id, a.journal_rows
FROM audit_partitions a
WHERE a.partition NOT IN (SELECT r.partition FROM archives r)
  AND ((SELECT j.id FROM journal j WHERE j.id = a.low_id AND j.period_start = a.low_start)
       IS NULL
       OR (SELECT j.id FROM journal j WHERE j.id = a.high_id AND j.period_start = a.high_start)
       IS NULL)
ORDER BY a.partition"""

#: How many of the rows the audit proved in a lost partition it still holds (read only
#: for a partition found lost: PostgreSQL cannot prune by ``tableoid``).
PARTITION_ROWS_LEFT = """
SELECT COUNT(*) FROM journal
WHERE id >= :low_id AND id <= :high_id AND tableoid = to_regclass(:partition)"""

# -- retention (PostgreSQL): a month's journal partition and what goes with it --------
# ``{partition}`` is a month partition's name, made by .partitions (never user input).

ARCHIVES = "SELECT partition, month, journal_rows, kept_as FROM archives ORDER BY month"

#: An attempt's budget and when it was admitted: the periods it holds in.
ATTEMPT_ADMITTED = """
SELECT b.name, a.created_at FROM attempts a JOIN budgets b ON b.id = a.budget_id
WHERE a.id = :attempt_id"""

_IN_MONTH = "period_start >= :start AND period_start < :end"
_P_IN_MONTH = "p.period_start >= :start AND p.period_start < :end"

#: The month's periods, locked: nothing writes their counters while the month leaves.
LOCK_MONTH_PERIODS = f"SELECT id FROM budget_periods WHERE {_IN_MONTH} ORDER BY id FOR UPDATE"

#: What keeps a month in the journal: open periods, attempts holding money, unfinished
#: operations of its attempts, and periods whose counters the journal does not derive.
#: A month's attempts are those admitted in its periods and those with a journal row
#: there: in a chain of mixed periods (a day under a month), an attempt admitted in a
#: later month holds money on its parent's period in this one.
MONTH_BLOCKERS = f"""
WITH RECURSIVE up(budget_id, ancestor_id) AS (
    SELECT id, parent_id FROM budgets WHERE parent_id IS NOT NULL
    UNION
    SELECT up.budget_id, b.parent_id FROM up JOIN budgets b ON b.id = up.ancestor_id
    WHERE b.parent_id IS NOT NULL
),
month_attempts AS (
    SELECT a.id, a.state, a.operation_id FROM attempts a
    WHERE a.period_id IN (SELECT id FROM budget_periods WHERE {_IN_MONTH})
       OR a.id IN (SELECT attempt_id FROM journal WHERE {_IN_MONTH})
       -- An escrowed budget's hold is journalled in its own period only, but its late
       -- overrun draws from the ancestors' periods that contain that period: those
       -- periods' months are the attempt's too. (A containing period starts in the
       -- month only if the attempt's own period starts within a month of its end.)
       OR a.id IN (
        SELECT x.id FROM attempts x
        JOIN budget_periods tp ON tp.id = x.period_id
        JOIN up ON up.budget_id = tp.budget_id
        JOIN budgets anc ON anc.id = up.ancestor_id AND anc.period <> 'none'
        CROSS JOIN LATERAL (SELECT date_trunc(anc.period, tp.period_start AT TIME ZONE 'UTC')
                            AT TIME ZONE 'UTC' AS period_start) contains
        WHERE tp.period_start >= :start AND tp.period_start < :end + interval '31 days'
          AND contains.period_start >= :start AND contains.period_start < :end)
)
SELECT
    (SELECT COUNT(*) FROM budget_periods WHERE {_IN_MONTH} AND closed_at IS NULL),
    (SELECT COUNT(*) FROM month_attempts a WHERE a.state IN ('reserved', 'sending', 'unknown')),
    (SELECT COUNT(DISTINCT o.id) FROM operations o
     JOIN month_attempts a ON a.operation_id = o.id
     WHERE o.status NOT IN ('succeeded', 'failed')),
    (SELECT COUNT(*) FROM budget_periods p
     LEFT JOIN (
        SELECT period_id, SUM(held_delta) AS held, SUM(spent_delta) AS spent,
            SUM({_OVERRUN}) AS overrun, SUM(drawn_delta) AS drawn,
            SUM(granted_delta) AS granted
        FROM journal WHERE {_IN_MONTH} GROUP BY period_id
     ) s ON s.period_id = p.id
     LEFT JOIN archived_periods ap ON ap.period_id = p.id
     WHERE {_P_IN_MONTH} AND (
        p.held <> COALESCE(s.held, 0) + COALESCE(ap.held, 0)
        OR p.spent <> COALESCE(s.spent, 0) + COALESCE(ap.spent, 0)
        OR p.overrun <> COALESCE(s.overrun, 0) + COALESCE(ap.overrun, 0)
        OR p.drawn <> COALESCE(s.drawn, 0) + COALESCE(ap.drawn, 0)
        OR p.granted <> COALESCE(s.granted, 0) + COALESCE(ap.granted, 0)))"""

MONTH_JOURNAL_EXPORT = "SELECT * FROM {partition} ORDER BY id"

MONTH_PERIODS_EXPORT = f"""
SELECT b.name AS budget, p.* FROM budget_periods p JOIN budgets b ON b.id = p.budget_id
WHERE {_P_IN_MONTH} ORDER BY p.id"""

MONTH_ATTEMPTS_EXPORT = f"""
SELECT a.* FROM attempts a JOIN budget_periods p ON p.id = a.period_id
WHERE {_P_IN_MONTH} ORDER BY a.id"""

INSERT_ARCHIVE = """
INSERT INTO archives (partition, month, journal_rows, periods, kept_as, archived_at)
VALUES (:partition, :start, :rows, :periods, :kept_as, :now)"""

#: Each period's sums over the partition's rows, kept for the full audit to start from.
ARCHIVE_PERIODS = f"""
INSERT INTO archived_periods (period_id, partition, held, spent, overrun, drawn, granted)
SELECT period_id, :partition, {_JOURNAL_SUMS} FROM {{partition}} GROUP BY period_id"""

#: The partition's rows the audit has not proved yet, added to its checkpoints as they
#: leave (the next audit reads the rows after its position, and these will be gone).
CHECKPOINT_ARCHIVED = f"""
INSERT INTO audit_checkpoints (period_id, held, spent, overrun, drawn, granted)
SELECT period_id, {_JOURNAL_SUMS} FROM {{partition}} WHERE id > :since GROUP BY period_id
{_ADD_TO_CHECKPOINTS}"""

#: Attempts of archived periods (exported with their month) that no journal row names.
RETAIN_ATTEMPTS = """
DELETE FROM attempts WHERE id IN (
    SELECT a.id FROM archived_periods ap JOIN attempts a ON a.period_id = ap.period_id
    WHERE a.state IN ('settled', 'released')
      AND NOT EXISTS (SELECT 1 FROM journal j WHERE j.attempt_id = a.id)
    LIMIT :batch FOR UPDATE OF a SKIP LOCKED)
RETURNING id"""

#: Finished operations past the window that no attempt names any more.
RETAINABLE_OPERATIONS = """
SELECT o.id FROM operations o
WHERE o.completed_at < :cutoff AND o.status IN ('succeeded', 'failed')
AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.operation_id = o.id)
ORDER BY o.completed_at LIMIT :batch FOR UPDATE SKIP LOCKED"""

RETAIN_OPERATION_EVENTS = "DELETE FROM operation_events WHERE operation_id = ANY(:ids) RETURNING *"

RETAIN_SIDE_EFFECTS = "DELETE FROM side_effects WHERE operation_id = ANY(:ids) RETURNING *"

RETAIN_OPERATIONS = "DELETE FROM operations WHERE id = ANY(:ids) RETURNING *"


# -- rate windows (rates.py): token buckets in thousandths of a unit -------------------
# Every parameter is cast to BIGINT: psycopg binds a small int as int4, and int4
# arithmetic overflows long before a large limit's levels do.

_NOW = "CAST(:now_ms AS BIGINT)"

#: The longest a window's refill is counted for: what fills it from the most it may
#: owe (two days of its limit) and a minute more; at the largest limit a minute
#: (10^10) the product stays inside a BIGINT.
RATE_REFILL_MOST_MS = 2881 * 60_000


def _rate_level(t: str = "") -> str:
    """A window's level refilled to now (``t``: its table's name or alias and a dot):
    per_minute a minute, never past per_minute; refilled for no time backwards, and
    for at most :data:`RATE_REFILL_MOST_MS` (which fills it from the most it may owe)."""
    most = RATE_REFILL_MOST_MS
    elapsed = f"""(CASE WHEN {_NOW} <= {t}refilled_ms THEN 0
    WHEN {_NOW} - {t}refilled_ms >= {most} THEN {most} ELSE {_NOW} - {t}refilled_ms END)"""
    refilled = f"{t}level + {t}per_minute * {elapsed} / 60"
    return f"""(CASE WHEN {refilled} >= {t}per_minute * 1000
    THEN {t}per_minute * 1000 ELSE {refilled} END)"""


_RATE_LEVEL = _rate_level()
_RATE_STAMP = f"refilled_ms = CASE WHEN {_NOW} > refilled_ms THEN {_NOW} ELSE refilled_ms END"
_ASK = "CAST(:ask AS BIGINT)"
_BACK = "CAST(:back AS BIGINT)"
_LIMIT = "CAST(:per_minute AS BIGINT)"
#: The most a window may owe, in thousandths: two days of its limit (its line of calls
#: booked ahead, a day at most, and what a provider's 429 put on top).
_MOST_OWED = "per_minute * 2880000"
#: The most a line of booked calls may owe: a day of the window's limit.
_MOST_BOOKED = "per_minute * 1440000"

#: Take :ask from a window where its refilled level holds it (compare-and-set). The
#: level is net of the calls booked ahead: a newcomer takes only the room none of them
#: waits for.
TAKE_RATE = f"""
UPDATE rate_windows SET level = {_RATE_LEVEL} - {_ASK}, {_RATE_STAMP}
WHERE id = :id AND {_RATE_LEVEL} >= {_ASK}
RETURNING level"""

#: Give :back to a window (what a call did not use), never past its limit.
GIVE_RATE_BACK = f"""
UPDATE rate_windows SET level = CASE WHEN {_RATE_LEVEL} + {_BACK} >= per_minute * 1000
    THEN per_minute * 1000 ELSE {_RATE_LEVEL} + {_BACK} END, {_RATE_STAMP}
WHERE id = :id"""

#: A booking dropped: what it booked goes back to the level (never past the limit) and
#: leaves the line.
UNBOOK_RATE = f"""
UPDATE rate_windows SET level = CASE WHEN {_RATE_LEVEL} + {_BACK} >= per_minute * 1000
    THEN per_minute * 1000 ELSE {_RATE_LEVEL} + {_BACK} END, {_RATE_STAMP},
    booked = booked - {_BACK}
WHERE id = :id"""

#: A window's refilled level and limit, read (a refusal's wait is computed from them).
RATE_LEVEL = f"SELECT {_RATE_LEVEL}, per_minute FROM rate_windows WHERE id = :id"

#: The windows of one scope, in the order every taker takes them (by id).
RATE_WINDOWS_OF = """
SELECT id, kind FROM rate_windows WHERE provider = :provider AND scope = :scope
ORDER BY id"""

#: Set a limit: a new window starts full; a changed one keeps what it held, refilled
#: at its old rate until now, never more than its new limit (nor owing more than two
#: days of it). The calls booked on it keep their places: their turns follow the new
#: rate.
SET_RATE_LIMIT = f"""
INSERT INTO rate_windows (provider, scope, kind, per_minute, level, refilled_ms, booked,
    vtime, arrivals)
VALUES (:provider, :scope, :kind, {_LIMIT}, {_LIMIT} * 1000, {_NOW}, 0, 0, 0)
ON CONFLICT (provider, scope, kind) DO UPDATE SET per_minute = excluded.per_minute,
    level = CASE WHEN {_rate_level("rate_windows.")} > excluded.per_minute * 1000
        THEN excluded.per_minute * 1000
        WHEN {_rate_level("rate_windows.")} < -excluded.per_minute * 2880000
        THEN -excluded.per_minute * 2880000 ELSE {_rate_level("rate_windows.")} END,
    refilled_ms = CASE WHEN {_NOW} > rate_windows.refilled_ms THEN {_NOW}
        ELSE rate_windows.refilled_ms END"""

#: One window gone (a scope's are deleted one at a time, in id order), with its
#: tenants' places in its line.
CLEAR_RATE_WINDOW = "DELETE FROM rate_windows WHERE id = :id"
CLEAR_RATE_SHARES = "DELETE FROM rate_shares WHERE window_id = :id"

#: Every window, refilled to now, for the operator.
RATE_WINDOWS = f"""
SELECT provider, scope, kind, per_minute, {_RATE_LEVEL} AS level,
    (SELECT count(*) FROM rate_takes t WHERE t.window_id = rate_windows.id
     AND t.back_ms IS NOT NULL) AS booked
FROM rate_windows ORDER BY provider, scope, kind"""

#: The windows of a provider, for a claim's scopes to pick from (by id: the order every
#: taker takes them).
RATE_WINDOWS_OF_PROVIDER = """
SELECT id, scope, kind, per_minute FROM rate_windows WHERE provider = :provider
ORDER BY id"""

#: What a key took or booked, window by window (``back_ms`` not NULL: booked).
RATE_TAKEN = "SELECT window_id, taken, back_ms FROM rate_takes WHERE key = :key ORDER BY window_id"

#: Record what a key took from a window.
RECORD_RATE_TAKE = """
INSERT INTO rate_takes (key, window_id, taken, back_ms, own, tag, arrival)
VALUES (:key, :window_id, CAST(:taken AS BIGINT), NULL, :own, NULL, NULL)"""

#: Book :ask ahead on a window although it is short: its level goes below 0 by it (net
#: of every call booked, at most a day of its limit) and its line holds it; the window
#: after, with its virtual time and the arrival number this booking takes.
BOOK_RATE = f"""
UPDATE rate_windows SET level = {_RATE_LEVEL} - {_ASK}, {_RATE_STAMP},
    booked = booked + {_ASK}, arrivals = arrivals + 1
WHERE id = :id AND {_RATE_LEVEL} - {_ASK} >= -{_MOST_BOOKED}
RETURNING vtime, arrivals"""

#: A tenant's place in a window's line: the virtual time its last booking there ends.
RATE_SHARE = "SELECT finish FROM rate_shares WHERE window_id = :id AND share = :share"
SET_RATE_SHARE = """
INSERT INTO rate_shares (window_id, share, finish)
VALUES (:id, :share, CAST(:finish AS BIGINT))
ON CONFLICT (window_id, share) DO UPDATE SET finish = excluded.finish"""

#: Record a booking: in its window's line at virtual time :tag, arrival :arrival.
RECORD_RATE_BOOKING = """
INSERT INTO rate_takes (key, window_id, taken, back_ms, own, tag, arrival)
VALUES (:key, :window_id, CAST(:taken AS BIGINT), CAST(:now_ms AS BIGINT), :own,
    CAST(:tag AS BIGINT), CAST(:arrival AS BIGINT))"""

#: A budget's weight in the rate windows its calls share (NULL: none of its own).
RATE_WEIGHT = "SELECT rate_weight FROM budgets WHERE id = :id"

#: Where a key's booking stands, window by window: the window's limit, what it holds
#: for its line (refilled level plus everything booked), and how much of the line
#: stands up to and including this booking (in units): the booking's turn has come
#: where the first holds the second.
RATE_TURN = f"""
SELECT w.id, w.scope, w.kind, w.per_minute, {_rate_level("w.")} + w.booked,
    (SELECT sum(o.taken) FROM rate_takes o WHERE o.window_id = t.window_id
     AND o.back_ms IS NOT NULL
     AND (o.tag < t.tag OR (o.tag = t.tag AND o.arrival <= t.arrival)))
FROM rate_takes t JOIN rate_windows w ON w.id = t.window_id
WHERE t.key = :key AND t.back_ms IS NOT NULL
ORDER BY w.id"""

#: A window locked before its line is read and written (the order every writer locks
#: windows in: by id).
LOCK_RATE_WINDOW = "UPDATE rate_windows SET booked = booked WHERE id = :id"

#: When a booking was told to come back.
SET_RATE_BACK = "UPDATE rate_takes SET back_ms = CAST(:back_ms AS BIGINT) WHERE key = :key"

#: A booking whose turn has come is sent: what it booked leaves the line (the level
#: already owes it) and the window's virtual time reaches its place.
RATE_BOOKING_SENT_FROM = """
UPDATE rate_windows SET booked = booked - CAST(:back AS BIGINT),
    vtime = CASE WHEN CAST(:tag AS BIGINT) > vtime THEN CAST(:tag AS BIGINT) ELSE vtime END
WHERE id = :id"""
RATE_BOOKING = """
SELECT window_id, taken, tag FROM rate_takes WHERE key = :key AND back_ms IS NOT NULL
ORDER BY window_id"""
RATE_BOOKING_SENT = """
UPDATE rate_takes SET back_ms = NULL, tag = NULL, arrival = NULL WHERE key = :key"""

#: What a sent call took, window by window, with each window's kind (a window cleared
#: since is not listed: nothing goes back to it).
RATE_TAKEN_KINDS = """
SELECT t.window_id, t.taken, w.kind, t.own FROM rate_takes t
JOIN rate_windows w ON w.id = t.window_id
WHERE t.key = :key ORDER BY t.window_id"""

#: What a key took, dropped (its settlement, release or unknown outcome).
DROP_RATE_TAKES = "DELETE FROM rate_takes WHERE key = :key"

_SEEN_FOR = f"""(CASE WHEN {_NOW} <= CAST(:at_ms AS BIGINT) THEN 0
    WHEN {_NOW} - CAST(:at_ms AS BIGINT) >= 3660000 THEN 3660000
    ELSE {_NOW} - CAST(:at_ms AS BIGINT) END)"""
_SEEN_CAP = f"""(CAST(:remaining AS BIGINT) * 1000 - per_minute * CAST(:wait_ms AS BIGINT) / 60
    + per_minute * {_SEEN_FOR} / 60)"""
#: What a provider said remains (``:remaining`` at ``:at_ms``, owing ``:wait_ms`` of a
#: refusal's wait), refilled since, in thousandths: at most 60 minutes owed. It is what
#: the provider has room for: the window's level, net of the calls booked on it (which
#: the provider has not seen), is capped at it less what they booked.
RATE_SEEN_CAP = f"""((CASE WHEN {_SEEN_CAP} < -per_minute * 60000 THEN -per_minute * 60000
    ELSE {_SEEN_CAP} END) - booked)"""

#: The limit a window is lowered to: the provider's stated limit where it is lower and
#: the window is the call's own model's (``:own``), else its own.
RATE_SEEN_LIMIT = """(CASE WHEN :own AND CAST(:limit AS BIGINT) < per_minute
    THEN CAST(:limit AS BIGINT) ELSE per_minute END)"""


def _least(*values: str) -> str:
    first, *rest = values
    if not rest:
        return first
    other = _least(*rest)
    return f"(CASE WHEN {first} <= {other} THEN {first} ELSE {other} END)"


def _at_least(value: str, floor: str) -> str:
    return f"(CASE WHEN {value} >= {floor} THEN {value} ELSE {floor} END)"


#: Narrow a window to what the provider said remains, and lower its limit to the one it
#: stated (never widened: where the window holds no more, nothing changes). The calls
#: booked on it keep their places, and their turns move with it.
NARROW_RATE = f"""
UPDATE rate_windows SET per_minute = {RATE_SEEN_LIMIT},
    level = {
    _at_least(
        _least(_RATE_LEVEL, RATE_SEEN_CAP, RATE_SEEN_LIMIT + " * 1000"),
        "-" + RATE_SEEN_LIMIT + " * 2880000",
    )
}, {_RATE_STAMP}
WHERE id = :id AND ({_RATE_LEVEL} > {RATE_SEEN_CAP} OR {RATE_SEEN_LIMIT} < per_minute)"""

#: Bookings no call came back for, long after they were told to come back (``upkeep``).
ABANDONED_RATE_BOOKINGS = """
SELECT DISTINCT key FROM rate_takes
WHERE back_ms IS NOT NULL AND back_ms < CAST(:before_ms AS BIGINT)
ORDER BY key"""

#: A tenant's place in a line it no longer stands in: where the line has passed its
#: last booking, it is as if it had none.
PURGE_RATE_SHARES = """
DELETE FROM rate_shares WHERE finish <= (SELECT vtime FROM rate_windows w
    WHERE w.id = rate_shares.window_id)
OR NOT EXISTS (SELECT 1 FROM rate_windows w WHERE w.id = rate_shares.window_id)"""
