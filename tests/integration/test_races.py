"""Races between a delivery, beat and an operator, forced with real processes: the
delivery runs in its own OS process and waits at a barrier at the point where the
window opens; the test does beat's or the operator's write in between, then lets the
delivery go. Every write is compare-and-set, so the loser re-reads and acts on what
is there: a business key is sent once (or once per explicit resend)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import openai
import pytest

from budget_tasks import Ledger, OutcomeUnknown
from budget_tasks.beat import reconcile_unknown
from budget_tasks.delivery.flow import OperationManager
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider, ManualClock

from . import races

ctx = multiprocessing.get_context("spawn")


def _target(fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    out.put(fn(*args))


class Paused:
    """A delivery in another process, stopped at its barrier until ``go()``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.reached, self.released = ctx.Event(), ctx.Event()
        self.out = ctx.Queue()
        self.proc = ctx.Process(
            target=_target, args=(fn, (*args, self.reached, self.released), self.out)
        )
        self.proc.start()
        assert self.reached.wait(60), "the delivery never reached its barrier"

    def go(self) -> tuple[str, Any]:
        self.released.set()
        outcome: tuple[str, Any] = self.out.get(timeout=60)
        self.proc.join(10)
        return outcome


@pytest.fixture
def ledger(pg_url: str, pg_ledger: Ledger) -> Iterator[Ledger]:
    """A ledger on the real clock (the deliveries in other processes use it too)."""
    real = Ledger(pg_url)
    real.create_budget("team", 10_000_000)
    yield real
    real.dispose()


def deliver(
    ledger: Ledger, fake: FakeProvider, key: str, fault: str | None = None, **opts: Any
) -> Any:
    manager = OperationManager(ledger.calls, DeliveryOptions(task="race", **opts))
    return manager.deliver(
        races.delivery(key, lambda scope: races.call(fake.openai_base_url, scope, fault))
    )


def sent(fake: FakeProvider, key: str, ledger: Ledger) -> list[Any]:
    """The requests sent under the main attempts of operation ``key``."""
    return [s for s in fake.served_as(ledger) if (s.idempotency_key or "").startswith(f"{key}#")]


def test_a_success_found_by_beat_is_never_overwritten_by_a_delivery_that_read_unknown(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """Failure 2: a delivery reads the operation as unknown; beat finds the call and
    settles it; the delivery's write must not put 'unknown' back (the next delivery
    would then send a second attempt)."""
    # The first delivery times out after the provider billed and stored the answer.
    with pytest.raises(openai.APITimeoutError):
        deliver(ledger, fake, "found", "hang=2")
    assert ledger.operation("found").status == "unknown"
    # A redelivery takes the lease, sees the unknown attempt and stops before writing.
    paused = Paused(
        races.deliver_pausing_at, pg_url, fake.openai_base_url, "found", "end_run", "hold"
    )
    assert ledger.operation("found").status == "running"
    # Meanwhile beat finds the call at the provider. The operation is leased by a live
    # run: beat settles the attempt and keeps the answer, but leaves the operation alone.
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    assert reconcile_unknown(ledger, lambda kind: client, margin=timedelta(0))["found"] == 1
    assert ledger.attempt("found#1").state == "settled"
    assert ledger.operation("found").status == "running"
    # The delivery's write finds the found answer and adopts it, instead of 'unknown'.
    outcome, answer = paused.go()
    assert outcome == "ok", answer
    operation = ledger.operation("found")
    assert (operation.status, operation.result, operation.lease_owner) == (
        "succeeded",
        answer,
        None,
    )
    # Every later delivery replays: one send of the business key, charged once.
    assert deliver(ledger, fake, "found") == answer
    assert len(sent(fake, "found", ledger)) == 1
    assert ledger.balance("team").spent == fake.billed_for("found#1", ledger)
    assert ledger.holds() == [] and ledger.audit() == []


def test_beat_never_reopens_a_resend_and_never_clears_its_live_lease(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """Failure 3: attempt 1 unknown, attempt 2 (on_unknown="resend") running; beat gets
    NotFound for attempt 1 past its window. It releases attempt 1's hold and touches
    nothing else: no retryable status, no requeue, the live lease stays."""
    # Something stored at the provider, so that "not found" can mean something.
    deliver(ledger, fake, "other")
    with pytest.raises(openai.InternalServerError):
        deliver(ledger, fake, "resend", "status=500", on_unknown="resend")
    paused = Paused(races.deliver_pausing_in_run, pg_url, fake.openai_base_url, "resend", "resend")
    running = ledger.operation("resend")
    assert running.status == "running" and running.lease_owner
    clock = ManualClock(ledger.now() + timedelta(seconds=10))  # past attempt 1's window
    later = Ledger(pg_url, clock=clock)
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    requeued: list[Any] = []
    counts = reconcile_unknown(
        later, lambda kind: client, margin=timedelta(0), requeue=lambda *a: requeued.append(a)
    )
    later.dispose()
    assert counts["not_found"] == 1
    assert ledger.attempt("resend#1").state == "released"
    assert requeued == []
    still = ledger.operation("resend")
    assert (still.status, still.lease_owner) == ("running", running.lease_owner)
    outcome, answer = paused.go()
    assert outcome == "ok", answer
    assert ledger.operation("resend").status == "succeeded"
    # later deliveries replay: two sends in all (the failed one and the resend)
    assert deliver(ledger, fake, "resend", on_unknown="resend") == answer
    assert [s.status for s in sent(fake, "resend", ledger)] == [500, 200]
    assert ledger.holds() == [] and ledger.audit() == []


def test_an_operator_release_while_a_delivery_decides_is_adopted_not_overwritten(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """The operator confirms with the provider that attempt 1 was never billed and
    releases it while a redelivery, which read it as unknown, is about to give up:
    the delivery re-reads and sends a new attempt, and nothing stays unknown."""
    with pytest.raises(openai.InternalServerError):
        deliver(ledger, fake, "op", "status=500")
    paused = Paused(races.deliver_pausing_at, pg_url, fake.openai_base_url, "op", "end_run", "hold")
    ledger.resolve_attempt("op#1", 0, note="provider: no such request", by="operator")
    outcome, answer = paused.go()
    assert outcome == "ok", answer
    assert [s.status for s in sent(fake, "op", ledger)] == [500, 200]
    assert [(a.key, a.state) for a in ledger.attempts()] == [
        ("op#1", "released"),
        ("op#2", "settled"),
    ]
    assert ledger.operation("op").status == "succeeded"
    assert ledger.holds() == [] and ledger.audit() == []


def test_a_delivery_that_meets_an_unknown_attempt_holds_without_a_race(
    ledger: Ledger, fake: FakeProvider
) -> None:
    """The plain path, for contrast: nothing resolved the attempt, so the redelivery
    keeps the hold and says so."""
    with pytest.raises(openai.InternalServerError):
        deliver(ledger, fake, "plain", "status=500")
    with pytest.raises(OutcomeUnknown):
        deliver(ledger, fake, "plain")
    assert ledger.operation("plain").status == "unknown"
    assert len(sent(fake, "plain", ledger)) == 1


def test_an_answer_found_for_a_resend_is_adopted_while_an_older_attempt_stays_unknown(
    ledger: Ledger, fake: FakeProvider
) -> None:
    """Found by the state machine test: attempt 1 of a resend task can never be looked
    up (its run died before describing the call), attempt 2 times out after billing
    and beat finds it. The operation adopts attempt 2's answer: attempt 1, replaced by
    the resend, does not keep it open, so no third attempt is sent."""
    from budget_tasks.ledger.leases import owner_id

    start = ledger.calls.admit(
        "twice", fingerprint="fp", owner=owner_id(), lease=timedelta(minutes=5), max_runs=5
    )
    ledger.calls.reserve("team", "twice#1", races.ESTIMATE, operation_id=start.operation_id)
    ledger.calls.mark_sending("twice#1")
    ledger.calls.mark_unknown("twice#1", "worker lost before it described the call")
    ledger.calls.end_run("twice", owner=start_owner(ledger, "twice"))
    with pytest.raises(openai.APITimeoutError):
        deliver(ledger, fake, "twice", "hang=2", on_unknown="resend")
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    counts = reconcile_unknown(ledger, lambda kind: client, margin=timedelta(0))
    assert (counts["found"], counts["unknowable"]) == (1, 1)
    operation = ledger.operation("twice")
    assert operation.status == "succeeded"
    assert deliver(ledger, fake, "twice", on_unknown="resend") == operation.result
    assert [s.idempotency_key for s in fake.served_as(ledger) if s.method == "POST"] == ["twice#2"]
    assert ledger.attempt("twice#1").state == "unknown"  # still held, for an operator


def start_owner(ledger: Ledger, key: str) -> str:
    owner = ledger.operation(key).lease_owner
    assert owner is not None
    return owner


def test_a_zero_estimate_run_whose_message_was_lost_is_found_requeued_and_replayed(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """The Quick start's shape (estimate 0, the call through the guarded client): the
    worker is killed once the provider billed, and the message is lost with it. Beat
    finds the call at the provider, and the operation becomes retryable and is
    requeued; its delivery replays the found answer. The run was admitted with its
    call, so its main call, which reserves nothing, has no attempt to leave open (a
    main attempt of 0 used to become unknown, which no lookup can find: the operation
    stayed unknown and was never requeued)."""
    out = ctx.Queue()
    child = ctx.Process(
        target=_target,
        args=(races.deliver_agent, (pg_url, fake.openai_base_url, "agent:1"), out),
    )
    sent_as = ledger.provider_key("agent:1:openai.chat:1")

    def kill(record: Any) -> None:  # this call only: another test's late request is not it
        if record.idempotency_key == sent_as:
            os.kill(child.pid or 0, signal.SIGKILL)

    fake.before_answer = kill
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL  # killed with its call billed, unanswered
    [sent] = [s for s in fake.served_as(ledger) if s.method == "POST"]
    assert sent.billed > 0 and sent.idempotency_key == "agent:1:openai.chat:1"
    requeued: list[tuple[str, str, Any]] = []
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    counts = reconcile_unknown(
        ledger,
        lambda kind: client,
        margin=timedelta(0),
        requeue=lambda task, key, payload: requeued.append((task, key, payload)),
    )
    assert counts["found"] == 1 and counts["unknowable"] == 0
    assert [a.key for a in ledger.attempts() if a.label is None] == []
    call = ledger.attempt("agent:1:openai.chat:1")
    assert (call.state, call.actual) == ("settled", sent.billed)
    assert ledger.operation("agent:1").status == "retryable"
    assert requeued == [("agent", "agent:1", {"args": ["agent:1"], "kwargs": {}})]
    manager = OperationManager(ledger.calls, DeliveryOptions(task="agent"))
    answer = manager.deliver(races.agent_delivery("agent:1", fake.openai_base_url))
    assert isinstance(answer, str) and answer
    assert len([s for s in fake.served() if s.method == "POST"]) == 1  # replayed, not resent
    assert ledger.operation("agent:1").status == "succeeded"
    balance = ledger.balance("team")
    assert (balance.spent, balance.held) == (sent.billed, 0) and ledger.audit() == []
