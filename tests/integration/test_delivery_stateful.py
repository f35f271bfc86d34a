"""The whole state machine under hypothesis: deliveries (duplicates and killed runs
included), provider outcomes (ok, 429, 5xx, a timeout after billing, a reset after
billing), ledger outages beginning at any write, runs whose lease expires while their
call is out (another delivery or beat takes the operation, then the answer arrives),
a task with a main estimate of 0 whose call goes through the guarded client and is
retried by the run itself after a 429, beat's jobs and operators' resolutions,
interleaved at random, against PostgreSQL, the official openai SDK and the fake
provider.

After every step the ledger is checked against the fake provider's own record:

- no business key is billed twice, except by a distinct ``on_unknown="resend"``
  attempt, and no attempt key is sent twice;
- every attempt the provider billed is charged exactly what it billed, or still held
  as open (unknown, or sending under a run that is gone and that beat will adopt);
- no hold sits anywhere else: after beat has run, nothing is reserved or sending;
- ``audit()`` is clean; a finished operation replays.

A killed run is a delivery whose process is gone: its lease names a process of this
PID namespace that no longer runs, and it writes nothing after the kill point (the
chaos suite kills real worker processes; here the point is the interleaving).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import openai
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from budget_tasks import Ledger, LedgerUnavailable
from budget_tasks.beat import flag_stale_holds, reconcile_unknown
from budget_tasks.delivery import owed
from budget_tasks.delivery.flow import Delivery, OperationManager, RetryLater
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.delivery.scope import running
from budget_tasks.errors import BudgetTasksError
from budget_tasks.ledger.leases import owner_id, this_process
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider
from budget_tasks.transport import guarded_openai_client
from tests.support.sdk_calls import openai_chat

from ..conftest import empty_ledger_tables

TIMEOUT = 0.3  # the SDK's timeout: a "hang" outlives it after the provider billed
PROMPT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "One state machine."}],
}
ESTIMATE = estimates.openai_chat(PROMPT).amount
#: business keys, and whether their task resends an unknown outcome; "agent" makes two
#: labelled calls (spend), and its faults and kills hit the second; "quick" has a main
#: estimate of 0 and makes its one call through the guarded client, retrying it once
#: itself after a 429 (the Quick start's shape)
KEYS = {
    "hold-a": "hold",
    "hold-b": "hold",
    "resend-a": "resend",
    "resend-b": "resend",
    "agent": "hold",
    "quick": "hold",
}
#: the main estimate of each key's task: the agent's and quick's calls reserve their own
ESTIMATES = {key: 0 if key in ("agent", "quick") else ESTIMATE for key in KEYS}
OUTCOMES = {
    "ok": None,
    "429": "status=429",
    "500": "status=500",
    "timeout": f"hang={TIMEOUT * 2}",
    "reset": "reset",
}


class _Killed(BaseException):
    """The process running the delivery is gone: nothing after this point runs."""


class _Dead:
    """A ledger seen from a process that was killed: every call after the kill fails
    without writing (the process is not there to make it)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.killed = False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ledger, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.killed:
                raise _Killed(name)
            return target(*args, **kwargs)

        return call


#: The ledger's writes a delivery makes (an outage is drawn to begin at one of them).
WRITES = frozenset(
    {
        "admit",
        "admit_call",
        "reserve",
        "mark_sending",
        "describe_attempt",
        "record_call",
        "end_call",
        "release",
        "mark_unknown",
        "finish_operation",
        "fail_operation",
        "end_run",
    }
)


class _Down:
    """A ledger seen through an outage that begins at its ``at``-th write and lasts to
    the end of the delivery: every call from then raises LedgerUnavailable and writes
    nothing. The process lives on: what it keeps back, its next delivery writes."""

    def __init__(self, ledger: Ledger, at: int) -> None:
        self._ledger, self._at, self.writes = ledger, at, 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ledger, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in WRITES:
                self.writes += 1
            if self.writes > self._at:
                raise LedgerUnavailable(f"the test's outage, from write {self._at + 1}")
            return target(*args, **kwargs)

        return call


def position(attempt_key: Any) -> str:
    """The call position an attempt key is at: ``op#`` for the main call, the first
    attempt's key for a labelled call."""
    key = str(attempt_key)
    if "#" in key:
        return key[: key.index("#") + 1]
    return key.split("~")[0]


def gone_owner() -> str:
    """A lease owner naming a process of this PID namespace that has exited."""
    me = this_process()
    assert me is not None
    dead = subprocess.Popen(["true"])
    dead.wait()
    return f"{socket.gethostname()}:{dead.pid}:{uuid.uuid4().hex[:8]}@{me.boot}/{me.pidns}/1"


class BeatClock:
    """Beat's clock: hours ahead of the deliveries', and further at every run, so that
    every lookup is due and every "not yet" window has passed."""

    def __init__(self) -> None:
        self.ahead = timedelta(hours=1)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.ahead


class DeliveryMachine(RuleBasedStateMachine):
    url: ClassVar[str]
    fake: ClassVar[FakeProvider]

    def __init__(self) -> None:
        super().__init__()
        empty_ledger_tables(self.url)
        self.fake.reset()
        self.ledger = Ledger(self.url)
        self.ledger.create_budget("team", 10**12)
        self.beat_clock = BeatClock()
        self.beat_ledger = Ledger(self.url, clock=self.beat_clock)
        self.client = openai_client(
            base_url=self.fake.openai_base_url, api_key="x", timeout=TIMEOUT
        )
        self.guarded = guarded_openai_client(
            base_url=self.fake.openai_base_url, api_key="x", timeout=TIMEOUT
        )
        self.results: dict[str, Any] = {}
        #: attempts whose answer reached a run that lived on (none was killed after)
        self.answered: set[str] = set()
        self.beat_ran_last = False
        owed.forget(self.ledger.calls)  # an earlier example's process, and its tables, are gone

    def teardown(self) -> None:
        self.ledger.dispose()
        self.beat_ledger.dispose()

    # -- the deliveries --------------------------------------------------------------

    def _delivery(
        self,
        key: str,
        outcome: str,
        kill: str | None,
        ledger: Any,
        *,
        lease_lost: str | None = None,
    ) -> Any:
        """One delivery of ``key``; ``kill`` names the point its process dies at.
        ``lease_lost`` (``delivery`` or ``beat``): while its call is out, its lease
        expires and another delivery, or beat, takes the operation; the run lives on."""
        fault = OUTCOMES[outcome]
        served_before = len(self.fake.served())

        def send(attempt: Any) -> Any:
            if kill == "before_send":
                ledger.killed = True
                raise _Killed("before the send")
            extra = {"extra_headers": {"x-fake-fault": fault}} if fault else {}
            try:
                sent = openai_chat(self.client, attempt=attempt, **extra, **PROMPT)
            finally:
                if kill == "after_send":
                    ledger.killed = True  # the request reached the provider; then death
            if kill == "after_send":
                raise _Killed("after the send")
            if lease_lost is not None:
                self._take_over(key, lease_lost)
            self.answered.add(attempt.attempt_key)
            return sent.result["content"]

        def quick(scope: Any) -> Any:
            """Through the guarded client, as the Quick start: a 429 is retried once by
            the run itself, at the same position."""
            if kill == "before_send":
                ledger.killed = True
                raise _Killed("before the send")
            if kill == "after_send":
                self.fake.before_answer = lambda served: setattr(ledger, "killed", True)
            headers = {"x-fake-fault": fault} if fault else {}
            try:
                try:
                    answer = self.guarded.chat.completions.create(**PROMPT, extra_headers=headers)
                except openai.RateLimitError:
                    answer = self.guarded.chat.completions.create(**PROMPT)
            finally:
                self.fake.before_answer = None
            return answer.choices[0].message.content

        def run(scope: Any) -> Any:
            if key == "quick":
                with running(scope):  # what BudgetTask.run is called in
                    return quick(scope)
            if key != "agent":
                return send(scope)
            notes = []
            for label in ("one", "two"):
                with scope.manager.step(scope, ESTIMATE, label) as call:
                    if not call.replayed:
                        if label == "one":
                            sent = openai_chat(self.client, attempt=call, **PROMPT)
                            if kill is None:
                                self.answered.add(call.attempt_key)
                            call.result = sent.result["content"]
                        else:
                            call.result = send(call)
                notes.append(call.result)
            return notes

        manager = OperationManager(ledger, DeliveryOptions(task="t", on_unknown=KEYS[key]))
        delivery = Delivery(
            key=key,
            fingerprint=key,
            budget="team",
            estimate=lambda: ESTIMATES[key],
            run=run,
            owner=gone_owner() if kill else owner_id(),
        )
        result = manager.deliver(delivery)
        if key == "quick" and kill is None:
            # it returned: every answer the provider billed it reached this live run
            for served in self.fake.served_as(self.ledger)[served_before:]:
                if served.billed and served.method == "POST":
                    self.answered.add(str(served.idempotency_key))
        return result

    def _take_over(self, key: str, by: str) -> None:
        """The run's lease expires while its call is out (a stalled worker) and another
        delivery of the key, or beat, finds the operation."""
        with self.ledger.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE operations SET lease_expires_at = now() - interval '1 minute'"
                    " WHERE key = :key"
                ),
                {"key": key},
            )
        if by == "beat":
            self.beat()
            return
        try:
            result = self._delivery(key, "ok", None, self.ledger.calls)
        except (RetryLater, BudgetTasksError, openai.APIError) as exc:
            self.results.setdefault(f"errors:{key}", []).append(type(exc).__name__)
            return
        previous = self.results.setdefault(key, result)
        assert result == previous, "a finished operation replays what it stored"

    @rule(key=st.sampled_from(sorted(KEYS)), outcome=st.sampled_from(sorted(OUTCOMES)))
    def deliver(self, key: str, outcome: str) -> None:
        """A delivery of ``key`` (a duplicate, if the key ran before)."""
        self.beat_ran_last = False
        try:
            result = self._delivery(key, outcome, None, self.ledger.calls)
        except (RetryLater, BudgetTasksError, openai.APIError) as exc:
            self.results.setdefault(f"errors:{key}", []).append(type(exc).__name__)
            return
        previous = self.results.setdefault(key, result)
        assert result == previous, "a finished operation replays what it stored"

    @rule(
        key=st.sampled_from(sorted(KEYS)),
        outcome=st.sampled_from(["ok", "timeout"]),
        point=st.sampled_from(["before_send", "after_send"]),
    )
    def killed_delivery(self, key: str, outcome: str, point: str) -> None:
        """A delivery whose worker is killed: before its send, or once the request has
        reached the provider."""
        self.beat_ran_last = False
        dead = _Dead(self.ledger.calls)
        try:
            self._delivery(key, outcome, point, dead)
        except _Killed:
            pass
        except (RetryLater, BudgetTasksError, openai.APIError):
            pass  # it never got as far as its kill point

    @rule(
        key=st.sampled_from(sorted(KEYS)),
        outcome=st.sampled_from(["ok", "429", "timeout"]),
        at=st.integers(0, 8),
    )
    def delivery_through_an_outage(self, key: str, outcome: str, at: int) -> None:
        """A delivery whose ledger goes away at one of its writes (the admission, a
        grant, a call's settlement, the run's end) and stays away until the delivery
        ends; this process keeps back what it could not write. The message comes back
        once the ledger does (what a worker does with RetryLater)."""
        self.beat_ran_last = False
        try:
            self._delivery(key, outcome, None, _Down(self.ledger.calls, at))
        except RetryLater:
            self.deliver(key, "ok")
        except (BudgetTasksError, openai.APIError):
            pass

    @rule(
        key=st.sampled_from(sorted(set(KEYS) - {"quick"})),
        by=st.sampled_from(["delivery", "beat"]),
    )
    def lease_lost_while_the_call_is_out(self, key: str, by: str) -> None:
        """A run stalls with its call out until its lease expires; another delivery, or
        beat, takes the operation; then the answer arrives and the run goes on."""
        self.beat_ran_last = False
        try:
            result = self._delivery(key, "ok", None, self.ledger.calls, lease_lost=by)
        except (RetryLater, BudgetTasksError, openai.APIError) as exc:
            self.results.setdefault(f"errors:{key}", []).append(type(exc).__name__)
            return
        previous = self.results.setdefault(key, result)
        assert result == previous, "a finished operation replays what it stored"
        self.beat_ran_last = False

    @rule(outcome=st.sampled_from(["ok", "429"]), at=st.integers(0, 8))
    def agent_through_an_outage(self, outcome: str, at: int) -> None:
        """The same for the agent, whose labelled calls settle one by one."""
        self.delivery_through_an_outage("agent", outcome, at)

    # -- beat and operators ------------------------------------------------------------

    @rule()
    def beat(self) -> None:
        self.beat_clock.ahead += timedelta(hours=7)  # every lookup due again
        reconcile_unknown(self.beat_ledger, lambda kind: self.client, margin=timedelta(0))
        flag_stale_holds(self.beat_ledger, timedelta(minutes=15))
        self.beat_ran_last = True

    @rule(pick=st.integers(0, 1_000))
    def operator_resolves(self, pick: int) -> None:
        """An operator checks the provider's invoice and resolves an unknown hold (if
        there is one). What is drawn does not depend on the database, so hypothesis can
        replay an example as it was drawn."""
        unknown = self.ledger.attempts(states=["unknown"])
        if not unknown:
            return
        self.beat_ran_last = False
        attempt = unknown[pick % len(unknown)]
        billed = self.fake.billed_for(attempt.key, self.ledger)
        with contextlib.suppress(BudgetTasksError):  # moved since it was read: that stands
            self.ledger.resolve_attempt(
                attempt.key, billed, note="checked the invoice", by="operator", expected="unknown"
            )

    # -- what must always hold ---------------------------------------------------------

    @invariant()
    def each_business_key_is_billed_once_but_for_explicit_resends(self) -> None:
        served = [s for s in self.fake.served_as(self.ledger) if s.method == "POST"]
        sends = Counter(s.idempotency_key for s in served)
        assert max(sends.values(), default=0) <= 1, "an attempt key was sent twice"
        attempts = self.ledger.attempts()
        # each call position: a task's main call (``op#``), each labelled call
        # (``op:label:n``, its later attempts ``~m``)
        billed = Counter(position(s.idempotency_key) for s in served if s.billed)
        resends = Counter(position(a.key) for a in attempts if a.reason == "unknown_resend")
        for where, count in billed.items():
            assert count <= 1 + resends[where], (
                where,
                [(a.key, a.reason, a.state) for a in attempts if position(a.key) == where],
            )

    @invariant()
    def every_billed_attempt_is_charged_its_bill_or_held(self) -> None:
        attempts = {a.key: a for a in self.ledger.attempts()}
        for served in self.fake.served_as(self.ledger):
            if served.method != "POST":
                continue
            attempt = attempts.get(str(served.idempotency_key))
            assert attempt is not None, f"{served.idempotency_key} was sent without an attempt"
            billed = self.fake.billed_for(attempt.key, self.ledger)
            if attempt.state in ("settled", "released"):
                assert attempt.actual == billed, (
                    attempt.key,
                    attempt.state,
                    attempt.actual,
                    billed,
                )
            else:
                assert attempt.state in ("unknown", "sending"), attempt
        for attempt in attempts.values():
            if attempt.state in ("settled", "released"):
                assert attempt.actual == self.fake.billed_for(attempt.key, self.ledger), attempt

    @invariant()
    def no_hold_is_left_without_a_run_or_a_reconciliation(self) -> None:
        holds = self.ledger.holds()
        if self.beat_ran_last and not owed.owes(self.ledger.calls):
            # beat adopts what dead runs left, and a live process has written what an
            # outage kept back: nothing reserved or sending remains
            assert {h.state for h in holds} <= {"unknown"}, holds
        for hold in holds:
            assert hold.state in ("reserved", "sending", "unknown")
        assert self.ledger.audit() == []

    @invariant()
    def an_answer_a_live_run_received_is_settled_at_its_bill(self) -> None:
        """Whatever an outage kept back, a live process writes: once it has, no call
        whose answer it received is left open for reconciliation or an operator."""
        if owed.owes(self.ledger.calls):
            return
        attempts = {a.key: a for a in self.ledger.attempts(keys=sorted(self.answered))}
        for key in self.answered:
            attempt = attempts[key]
            assert (attempt.state, attempt.actual) == (
                "settled",
                self.fake.billed_for(key, self.ledger),
            ), attempt

    @invariant()
    def operations_agree_with_their_attempts(self) -> None:
        for key in KEYS:
            try:
                operation = self.ledger.operation(key)
            except BudgetTasksError:
                continue
            mine = [a for a in self.ledger.attempts() if a.operation_key == key]
            if operation.status == "succeeded":
                assert operation.result is not None
            # the latest attempt decides (an earlier one a resend replaced does not)
            latest = mine[-1] if mine else None
            if (
                latest is not None
                and latest.state == "unknown"
                and operation.status not in ("succeeded", "failed", "running")
            ):
                assert operation.status == "unknown", (key, operation.status, mine)


def test_deliveries_beat_and_operators_interleaved(
    pg_url: str, pg_ledger: Ledger, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owed, "PERSIST_DELAYS", (0.01,))  # an outage lasts the delivery

    class Machine(DeliveryMachine):
        pass

    Machine.url = pg_url
    Machine.fake = fake
    run_state_machine_as_test(
        Machine,
        settings=settings(
            # BUDGET_TASKS_FUZZ_EXAMPLES=500 for a longer hunt than the suite's
            max_examples=int(os.environ.get("BUDGET_TASKS_FUZZ_EXAMPLES", "25")),
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
