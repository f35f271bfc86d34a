"""The ledger's two server-side functions on PostgreSQL: a delivery's admission and a
run's settlement, each one statement, sent alone (autocommit), so that the transaction
is one round trip and its row locks are held for the function's few microseconds, not
across the client's round trips.

Their PL/pgSQL is kept in ``sql/<name>.sql`` (one file a function, read as it is
written). Where a function repeats an expression of the statement path (what a
period has available, what an escrowed grant has left), it repeats it verbatim, and a
test holds the two together.

The admission serves a direct reservation too (no operation) and a run admitted with
its first labelled call; the settlement a direct settlement, and a run's one labelled
call settled with its end (its answer stored for replay). Each is the common case
only, written to leave exactly the rows the statement path (:mod:`.operations`,
:mod:`.holds`, :mod:`.escrow`) leaves for it. Anything else (a
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
from importlib import resources
from typing import Any

#: The SQLSTATE the functions raise for "not the common case: run the statement path".
NOT_HERE = "BT001"
#: PostgreSQL's SQLSTATE undefined_function: a database not yet migrated to 0016.
UNDEFINED_FUNCTION = "42883"
#: The class of SQLSTATEs a function's own text raises where it does not fit the schema
#: (a column or table renamed under it): syntax error or access rule violation.
BROKEN_TEXT = "42"

#: The functions, by name: each one file of ``sql/``, kept as PostgreSQL reads it.
FUNCTION_NAMES = ("budget_tasks_admit", "budget_tasks_finish")


def _function_text(name: str) -> str:
    text = resources.files("budget_tasks.ledger").joinpath("sql", f"{name}.sql").read_text()
    return "\n" + text.rstrip("\n")


#: What ``create_schema`` makes on PostgreSQL (migrations carry their own copy).
FUNCTIONS_DDL = tuple(_function_text(name) for name in FUNCTION_NAMES)
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
    CAST(:escrow_sources AS bigint[]), :draw_share, :r_provider,
    CAST(:r_scopes AS text[]), CAST(:r_requests AS bigint), CAST(:r_tokens AS bigint),
    CAST(:r_input_tokens AS bigint), CAST(:r_output_tokens AS bigint),
    CAST(:now_ms AS bigint), CAST(:r_own AS text[]))"""

FINISH = """
SELECT amount FROM budget_tasks_finish(
    :operation_id, :owner, :key, :actual, :estimate_only, :note, :request_id,
    :response_id, :result, :now, :record, :answer, :provider, :credential,
    CAST(:input_tokens AS bigint), CAST(:output_tokens AS bigint), :answered_by,
    CAST(:counted_tokens AS bigint), CAST(:counted_input AS bigint),
    CAST(:counted_output AS bigint), CAST(:now_ms AS bigint), CAST(:seen_at_ms AS bigint),
    CAST(:seen_requests AS bigint), CAST(:seen_tokens AS bigint), CAST(:seen_input AS bigint),
    CAST(:seen_output AS bigint), CAST(:seen_wait_ms AS bigint),
    CAST(:seen_requests_limit AS bigint), CAST(:seen_tokens_limit AS bigint),
    CAST(:seen_input_tokens_limit AS bigint), CAST(:seen_output_tokens_limit AS bigint))"""

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
