"""A first delivery whose main call reserves nothing (the Quick start's task) takes its
lease with its first call's admission, and settles its last call with its run's end:
two ledger commits per run. What that deferral allows is checked with real processes:
two deliveries of one key may both run the code before the call, and only one sends;
a process killed between the answer and the run's end leaves a hold that
reconciliation settles at what the provider billed, and the next delivery replays."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from budget_tasks import Ledger, OutcomeUnknown
from budget_tasks.beat import reconcile_unknown
from budget_tasks.errors import UnknownOperation
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider

from . import deferred

pytestmark = pytest.mark.postgres

ctx = multiprocessing.get_context("spawn")


def _target(out: Any, *args: Any, **kwargs: Any) -> None:
    out.put(deferred.deliver(*args, **kwargs))


class Run:
    """A delivery in another process."""

    def __init__(self, *args: Any, barrier: bool = True, **kwargs: Any) -> None:
        self.reached, self.released = ctx.Event(), ctx.Event()
        self.out = ctx.Queue()
        pause = (self.reached, self.released) if barrier else (None, None)
        self.proc = ctx.Process(target=_target, args=(self.out, *args, *pause), kwargs=kwargs)
        self.proc.start()

    def outcome(self) -> tuple[str, Any]:
        found: tuple[str, Any] = self.out.get(timeout=60)
        self.proc.join(10)
        return found


@pytest.fixture
def ledger(pg_url: str, pg_ledger: Ledger) -> Iterator[Ledger]:
    """A ledger on the real clock (the deliveries in other processes use it too)."""
    real = Ledger(pg_url)
    real.create_budget("team", 10_000_000)
    yield real
    real.dispose()


def posts(fake: FakeProvider) -> int:
    return len([s for s in fake.served() if s.method == "POST"])


def test_two_deliveries_of_a_key_run_the_code_before_its_call_at_once_and_send_once(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    before = posts(fake)
    one = Run(pg_url, fake.openai_base_url, "twice")
    two = Run(pg_url, fake.openai_base_url, "twice")
    # both are inside the task's code before its call at the same time: no lease yet
    assert one.reached.wait(60) and two.reached.wait(60)
    with pytest.raises(UnknownOperation):  # nothing is written before the first call
        ledger.operation("twice")
    one.released.set()
    two.released.set()
    outcomes = sorted([one.outcome(), two.outcome()], key=lambda o: o[0])
    answers = [answer for kind, answer in outcomes if kind == "ok"]
    assert answers, outcomes
    # the other one found the first one's lease (it comes back later) or its result
    assert {kind for kind, _ in outcomes} <= {"ok", "RetryLater"}, outcomes
    assert len(set(answers)) == 1
    assert posts(fake) - before == 1  # one request reached the provider
    operation = ledger.operation("twice")
    assert operation is not None and operation.status == "succeeded"
    assert ledger.balance("team").spent == fake.state()["billed_total"]
    assert ledger.holds() == [] and ledger.audit() == []


def test_a_lease_taken_before_run_keeps_a_second_delivery_out_of_the_code(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """``defer_writes=False``: the second delivery finds the first one's lease before
    its code runs."""
    one = Run(pg_url, fake.openai_base_url, "leased", defer_writes=False)
    assert one.reached.wait(60)
    two = Run(pg_url, fake.openai_base_url, "leased", defer_writes=False)
    kind, _ = two.outcome()
    assert kind == "RetryLater"
    assert not two.reached.is_set()  # it never entered the code
    one.released.set()
    assert one.outcome()[0] == "ok"


def test_a_process_killed_between_the_answer_and_the_runs_end_is_reconciled_and_replayed(
    ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    before = posts(fake)
    dead = Run(pg_url, fake.openai_base_url, "killed", barrier=False, die=True, lease_seconds=1)
    dead.proc.join(60)
    assert dead.proc.exitcode == 9
    assert posts(fake) - before == 1
    # the call's settlement waited for the run's end, which never came: its hold stays
    # (beside it, the main attempt of 0: nothing is ever sent under it)
    [held] = [a for a in ledger.attempts() if a.state == "sending" and a.amount > 0]
    assert ledger.balance("team").held == held.amount
    assert ledger.balance("team").spent == 0
    time.sleep(1.5)  # the dead run's lease expires
    # the next delivery takes over: the call may have billed, so it is not sent again
    kind, text = deferred.deliver(pg_url, fake.openai_base_url, "killed")
    assert kind == OutcomeUnknown.__name__, text
    assert ledger.attempt(held.key).state == "unknown"
    # beat finds the call at the provider and settles it at what the provider billed
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    assert reconcile_unknown(ledger, lambda kind: client, margin=timedelta(0))["found"] == 1
    assert ledger.attempt(held.key).state == "settled"
    kind, answer = deferred.deliver(pg_url, fake.openai_base_url, "killed")
    assert kind == "ok", answer
    assert answer
    assert posts(fake) - before == 1  # replayed, never resent
    balance = ledger.balance("team")
    assert balance.held == 0 and balance.spent == fake.state()["billed_total"]
    assert ledger.holds() == [] and ledger.audit() == []
