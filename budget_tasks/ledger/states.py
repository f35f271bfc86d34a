"""The states of operations and attempts, and the one table of allowed transitions.

Every write of a state in the ledger is compare-and-set: it names the state it read
(and, under a lease, its owner), and a write that finds another state changes nothing.
"""

from __future__ import annotations

import enum


class AttemptState(enum.StrEnum):
    RESERVED = "reserved"  # held, never sent: releasing it is always safe
    SENDING = "sending"  # granted: the call may be at the provider
    SETTLED = "settled"  # charged its actual
    RELEASED = "released"  # certainly not billed
    UNKNOWN = "unknown"  # may have billed: the hold stays until resolved


class OperationStatus(enum.StrEnum):
    PENDING = "pending"  # no run holds it and nothing is open: the next delivery runs it
    RUNNING = "running"  # a delivery holds the lease
    SUCCEEDED = "succeeded"  # its result is stored: every delivery replays it
    FAILED = "failed"  # failed for good: every delivery reports the error
    UNKNOWN = "unknown"  # an attempt may have billed: reconciliation decides
    RETRYABLE = "retryable"  # its attempts ended unbilled: the next delivery sends anew


#: Why an attempt exists: a run's first, a redelivery's, a retry after a 429, a resend
#: of an unknown outcome, an operator's.
ATTEMPT_REASONS = ("first", "redelivery", "rate_limited_retry", "unknown_resend", "manual")

#: The states an attempt may move to from each state.
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.RESERVED: frozenset({AttemptState.SENDING, AttemptState.RELEASED}),
    AttemptState.SENDING: frozenset(
        {AttemptState.SETTLED, AttemptState.RELEASED, AttemptState.UNKNOWN}
    ),
    AttemptState.UNKNOWN: frozenset({AttemptState.SETTLED, AttemptState.RELEASED}),
    AttemptState.SETTLED: frozenset(),
    AttemptState.RELEASED: frozenset(),
}

_UNFINISHED = frozenset(
    {
        OperationStatus.PENDING,
        OperationStatus.RUNNING,
        OperationStatus.UNKNOWN,
        OperationStatus.RETRYABLE,
    }
)

#: The statuses an operation may move to from each status. A finished operation
#: (succeeded, failed) never moves again: a replay is all that is left of it.
OPERATION_TRANSITIONS: dict[OperationStatus, frozenset[OperationStatus]] = {
    **{status: frozenset(OperationStatus) for status in _UNFINISHED},
    OperationStatus.SUCCEEDED: frozenset(),
    OperationStatus.FAILED: frozenset(),
}

HOLDING = frozenset({AttemptState.RESERVED, AttemptState.SENDING, AttemptState.UNKNOWN})
#: The same as plain strings, in the order of the states: what SQL and the schema name.
ATTEMPT_STATES = tuple(state.value for state in AttemptState)
HOLDING_STATES = tuple(state.value for state in AttemptState if state in HOLDING)
OPERATION_STATUSES = tuple(status.value for status in OperationStatus)
#: An attempt in these states may have reached the provider and is not resolved.
OPEN = frozenset({AttemptState.SENDING, AttemptState.UNKNOWN})
FINISHED = frozenset({OperationStatus.SUCCEEDED, OperationStatus.FAILED})


def nothing_sent_under(
    operation: object | None, label: str | None, amount: int, recorded_actual: int | None
) -> bool:
    """Whether an attempt is an operation's main attempt of 0, which no call can have
    used: it reserved nothing, and a run is never given its key (its calls are labelled
    attempts). Once its run is gone it is released, never left unknown: no lookup could
    ever find it. (An attempt reserved outside an operation gives its key to whoever
    reserved it: no such rule holds for it.)"""
    return operation is not None and label is None and amount == 0 and not recorded_actual


def attempt_may(current: str, target: str) -> bool:
    """Whether an attempt in ``current`` may move to ``target`` (the table above)."""
    return AttemptState(target) in ATTEMPT_TRANSITIONS[AttemptState(current)]


def operation_may(current: str, target: str) -> bool:
    """Whether an operation in ``current`` may move to ``target`` (the table above)."""
    return OperationStatus(target) in OPERATION_TRANSITIONS[OperationStatus(current)]
