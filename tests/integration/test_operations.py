"""Operations and their leases, through the ledger: what counts towards a poison
message is a run that never recorded its end, not a run that handed the message back."""

from __future__ import annotations

from datetime import timedelta

from budget_tasks import Ledger
from budget_tasks.ledger.operations import Decision
from budget_tasks.testing import ManualClock

LEASE = timedelta(minutes=10)


def begin(ledger: Ledger, owner: str, max_runs: int = 3) -> Decision:
    start = ledger.calls.admit(
        "job:1", fingerprint="fp", owner=owner, lease=LEASE, max_runs=max_runs, task="t"
    )
    return start.decision


def test_runs_that_hand_the_message_back_are_never_poison(ledger: Ledger) -> None:
    # budget-frees retries, 429s, a ledger outage: each run ends cleanly as pending
    for n in range(10):
        owner = f"otherhost:{n}:tok"
        assert begin(ledger, owner) is Decision.RUN
        end = ledger.calls.end_run("job:1", owner=owner, status="pending", error="retry later")
        assert (end.status, end.applied) == ("pending", True)
    assert ledger.operation("job:1").runs == 0
    assert ledger.operation("job:1").deliveries == 10


def test_runs_that_died_are_counted_until_poison(ledger: Ledger, clock: ManualClock) -> None:
    # another host's runs whose lease expired without an end: killed workers
    for n in range(3):
        assert begin(ledger, f"otherhost:{n}:tok") is Decision.RUN
        clock.advance(LEASE + timedelta(seconds=1))
    assert ledger.operation("job:1").runs == 3
    assert begin(ledger, "otherhost:9:tok") is Decision.POISONED
    operation = ledger.operation("job:1")
    assert (operation.status, operation.runs) == ("failed", 3)
    assert "3 runs" in str(operation.error)


def test_a_clean_end_between_deaths_is_not_counted(ledger: Ledger, clock: ManualClock) -> None:
    assert begin(ledger, "otherhost:1:tok") is Decision.RUN  # dies
    clock.advance(LEASE + timedelta(seconds=1))
    assert begin(ledger, "otherhost:2:tok") is Decision.RUN
    ledger.calls.end_run("job:1", owner="otherhost:2:tok", status="pending")
    assert ledger.operation("job:1").runs == 1
    # a give-back from someone who no longer holds the lease takes no run off the count
    ledger.calls.end_run("job:1", owner="otherhost:1:tok", status="pending")
    assert (ledger.operation("job:1").runs, ledger.operation("job:1").status) == (1, "pending")


def test_a_poisoned_operation_releases_the_holds_never_sent(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("team", 1_000)
    for n in range(3):  # runs that reserved and died before their send
        start = ledger.calls.admit(
            "job:1", fingerprint="fp", owner=f"otherhost:{n}:tok", lease=LEASE, max_runs=3
        )
        if n == 0:
            ledger.calls.reserve("team", "job:1#1", 400, operation_id=start.operation_id)
        clock.advance(LEASE + timedelta(seconds=1))
    assert begin(ledger, "otherhost:9:tok") is Decision.POISONED
    assert (ledger.attempt("job:1#1").state, ledger.balance("team").held) == ("released", 0)
    assert ledger.audit() == []


def test_beat_releases_what_a_dead_run_reserved_and_never_sent(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.create_budget("team", 1_000)
    start = ledger.calls.admit(
        "job:2", fingerprint="fp", owner="otherhost:1:tok", lease=LEASE, max_runs=3
    )
    ledger.calls.reserve("team", "job:2#1", 400, operation_id=start.operation_id)
    assert ledger.upkeep.mark_orphans_unknown() == []  # its lease is live: nothing is touched
    assert ledger.attempt("job:2#1").state == "reserved"
    clock.advance(LEASE + timedelta(seconds=1))
    assert ledger.upkeep.mark_orphans_unknown() == []  # nothing was sending: nothing unknown
    assert ledger.attempt("job:2#1").state == "released"
    operation = ledger.operation("job:2")
    assert (operation.status, operation.lease_owner) == ("pending", None)
    assert ledger.holds() == [] and ledger.audit() == []
