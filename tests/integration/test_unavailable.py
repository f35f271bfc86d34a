"""Fail closed: with the database out of reach the ledger refuses, never bypasses,
and it recovers on its own when the database is back."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetExceeded, BudgetTask, Ledger, LedgerUnavailable, OutcomeUnknown
from budget_tasks.config import close_ledgers
from budget_tasks.delivery import owed
from budget_tasks.delivery.owed import catch_up
from budget_tasks.ledger import CallLedger
from budget_tasks.providers.base import Sent
from budget_tasks.testing import FakeProvider
from budget_tasks.transport import guarded_anthropic_client
from tests.support import FaultProxy

from ..services import PG_ADMIN_URL


def test_unreachable_database_refuses_every_call() -> None:
    ledger = Ledger("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    calls = [
        lambda: ledger.calls.reserve("acme", "k", 10),
        lambda: ledger.calls.mark_sending("k"),
        lambda: ledger.calls.settle("k", 10),
        lambda: ledger.calls.release("k", "x"),
        lambda: ledger.balance("acme"),
        lambda: ledger.create_budget("acme", 10),
        lambda: ledger.audit(),
        lambda: ledger.holds(),
    ]
    for call in calls:
        # a report's outage says nothing of sending: it sends nothing either way
        with pytest.raises(LedgerUnavailable, match=r"^ledger unavailable: ") as raised:
            call()
        assert "sent" not in str(raised.value)


def test_unopenable_sqlite_file_refuses(tmp_path: object) -> None:
    ledger = Ledger("sqlite:////nonexistent-dir/ledger.db")
    with pytest.raises(LedgerUnavailable):
        ledger.calls.reserve("acme", "k", 10)


@pytest.fixture
def proxied(pg_url: str, pg_ledger: Ledger) -> Iterator[tuple[FaultProxy, Ledger]]:
    host_port = PG_ADMIN_URL.split("@", 1)[1].split("/", 1)[0]
    host, port = host_port.split(":")
    proxy = FaultProxy(host, int(port))
    database = pg_url.rsplit("/", 1)[1]
    ledger = Ledger(f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{database}")
    yield proxy, ledger
    ledger.dispose()
    proxy.close()


def test_outage_mid_life_refuses_then_recovers(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger
) -> None:
    proxy, ledger = proxied
    pg_ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "before", 10)  # pooled connections now exist
    ledger.calls.mark_sending("before")

    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        ledger.calls.reserve("acme", "during", 10)
    with pytest.raises(LedgerUnavailable):
        ledger.calls.settle("before", 10)
    # Read through a direct connection: nothing was written during the outage.
    assert [a.key for a in pg_ledger.attempts()] == ["before"]
    assert pg_ledger.balance("acme").held == 10

    proxy.restore()
    # The stale pooled connections are replaced without an error reaching the caller.
    assert ledger.calls.reserve("acme", "after", 10).created
    assert ledger.calls.settle("before", 10)
    assert ledger.balance("acme").held == 10
    assert pg_ledger.audit() == []


def test_stale_pool_after_a_restart_is_replaced_transparently(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger
) -> None:
    proxy, ledger = proxied
    pg_ledger.create_budget("acme", 100)
    ledger.calls.reserve("acme", "a", 10)
    ledger.budgets()
    proxy.cut()  # every pooled connection dies, as in a database restart
    proxy.restore()
    assert ledger.calls.reserve("acme", "b", 10).created
    assert [b.name for b in ledger.budgets()] == ["acme"]
    assert ledger.balance("acme").held == 20


def _eager_app_through(proxy: FaultProxy, pg_url: str) -> Celery:
    """An eager app whose ledger is the test database reached through ``proxy``."""
    database = pg_url.rsplit("/", 1)[1]
    app = Celery("outage", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        budget_ledger_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{database}",
    )
    return app


def test_ledger_lost_inside_run_keeps_the_hold_and_gives_the_lease_back_later(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger, pg_url: str
) -> None:
    """run() meets the outage after its send was granted (writing the response id of a
    call answered without usage, which is written at once): what the error meant cannot
    be written, so the attempt stays 'sending' (held), the task fails with
    LedgerUnavailable (a worker retries the message), and once the ledger answers the
    next delivery gives the lease back and keeps the hold as unknown: no resend."""
    proxy, _ = proxied
    pg_ledger.create_budget("acme", 1_000)
    app = _eager_app_through(proxy, pg_url)
    sent: list[str] = []

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="acme",
        name=f"outage{uuid.uuid4().hex[:8]}",
        idempotency_key=lambda n: f"job:{n}",
        estimate_cost=lambda n: 100,
    )
    def job(self: BudgetTask, n: int) -> int:
        sent.append(self.attempt.key)  # stands for the provider call
        proxy.cut()  # the ledger goes away while the call is out
        # answered without its usage (a background response): its ids are written at once
        self.attempt.record(Sent("openai", "gpt-4o-mini", "req_1", "resp_1", None, None, {}))
        return n

    try:
        with pytest.raises(LedgerUnavailable):
            job.delay(1).get()
        attempt = pg_ledger.attempt("job:1#1")
        assert attempt.state == "sending" and pg_ledger.balance("acme").held == 100
        proxy.restore()
        with pytest.raises(OutcomeUnknown):  # the next delivery: no resend, hold kept
            job.delay(1).get()
        assert sent == ["job:1#1"]
        assert pg_ledger.attempt("job:1#1").state == "unknown"
        operation = pg_ledger.operation("job:1")
        assert operation.status == "unknown" and operation.lease_owner is None
        assert operation.runs == 0  # both runs recorded their end: not poison
        assert pg_ledger.balance("acme").held == 100 and pg_ledger.audit() == []
    finally:
        close_ledgers()
        app.close()


def test_ledger_lost_after_run_returned_settles_at_the_usage_kept_and_replays(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger, pg_url: str
) -> None:
    """What a call reported is kept by the run and written with the settlement. The
    ledger goes away after run() returned: the settlement cannot land, the process keeps
    it (the lease is its own) and writes it at its next delivery, which then replays the
    result: the charge is the usage the call reported, not the estimate; no resend."""
    proxy, _ = proxied
    pg_ledger.create_budget("acme", 1_000)
    app = _eager_app_through(proxy, pg_url)
    sent: list[str] = []

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="acme",
        name=f"outage{uuid.uuid4().hex[:8]}",
        idempotency_key=lambda n: f"job:{n}",
        estimate_cost=lambda n: 100,
    )
    def job(self: BudgetTask, n: int) -> int:
        sent.append(self.attempt.key)  # stands for the provider call
        self.attempt.record(Sent("openai", "gpt-4o-mini", "req_7", "resp_7", None, 37, {}))
        proxy.cut()  # the ledger goes away before the settlement
        return n

    try:
        with pytest.raises(LedgerUnavailable):
            job.delay(7).get()
        assert pg_ledger.attempt("job:7#1").state == "sending"
        proxy.restore()
        assert job.delay(7).get() == 7  # the owed settlement lands, then the replay
        assert sent == ["job:7#1"]
        attempt = pg_ledger.attempt("job:7#1")
        assert (attempt.state, attempt.actual, attempt.request_id) == ("settled", 37, "req_7")
        assert attempt.response_id == "resp_7"
        assert pg_ledger.operation("job:7").status == "succeeded"
        balance = pg_ledger.balance("acme")
        assert (balance.spent, balance.held) == (37, 0) and pg_ledger.audit() == []
    finally:
        close_ledgers()
        app.close()


# -- what a run owes through an outage --------------------------------------------------


def _ask_claude(app: Celery, fake: FakeProvider) -> Any:
    """A task whose one call goes through the guarded Anthropic client (estimate 0:
    the call reserves for itself, as a labelled call of the run)."""
    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="acme",
        name=f"outage{uuid.uuid4().hex[:8]}",
        idempotency_key=lambda n: f"ask:{n}",
        estimate_cost=lambda n: 0,
    )
    def ask(self: BudgetTask, n: int) -> str:
        message = claude.messages.create(
            model="claude-haiku-4-5",
            max_tokens=64,
            messages=[{"role": "user", "content": f"Hello {n}"}],
        )
        return str(message.content[0].text)

    return ask


def _outage_after_billing(
    fake: FakeProvider, proxy: FaultProxy, sent_as: str, seconds: float | None
) -> list[str]:
    """The ledger goes away once the provider has billed the call sent as ``sent_as``,
    before its answer reaches the transport (for ``seconds``; None: until restored).
    Returns the list the cut is written to when it happens."""
    cuts: list[str] = []

    def cut(record: Any) -> None:
        if record.idempotency_key != sent_as:
            return  # another test's late request
        fake.before_answer = None
        cuts.append(record.idempotency_key)
        proxy.cut()
        if seconds is not None:
            threading.Timer(seconds, proxy.restore).start()

    fake.before_answer = cut
    return cuts


def test_a_labelled_calls_settlement_waits_out_a_short_outage(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger, pg_url: str, fake: FakeProvider
) -> None:
    """A call through the guarded transport is answered and billed; the ledger is down
    for 1 s before its settlement: it waits the outage out, as the main call's does,
    and settles at the bill (it used to be written once: the next delivery raised
    OutcomeUnknown and the hold, 3x the bill, waited for an operator)."""
    proxy, _ = proxied
    pg_ledger.create_budget("acme", 1_000_000)
    app = _eager_app_through(proxy, pg_url)
    ask = _ask_claude(app, fake)
    cuts = _outage_after_billing(
        fake, proxy, pg_ledger.provider_key("ask:1:anthropic.messages:1"), 1.0
    )
    try:
        text = ask.delay(1).get()
        assert len(cuts) == 1  # the outage came between the bill and the settlement
        [sent] = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
        attempt = pg_ledger.attempt(str(sent.idempotency_key))
        assert (attempt.state, attempt.actual) == ("settled", sent.billed)
        assert 0 < sent.billed < attempt.amount
        assert pg_ledger.operation("ask:1").status == "succeeded"
        assert ask.delay(1).get() == text  # replayed
        assert len([s for s in fake.served() if s.method == "POST"]) == 1
        balance = pg_ledger.balance("acme")
        assert (balance.spent, balance.held) == (sent.billed, 0) and pg_ledger.audit() == []
    finally:
        close_ledgers()
        app.close()


def test_a_labelled_calls_settlement_past_a_long_outage_is_owed_then_replayed(
    proxied: tuple[FaultProxy, Ledger],
    pg_ledger: Ledger,
    pg_url: str,
    fake: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The outage outlasts the wait: the call's settlement and its answer are kept by
    this process (its lease is its own) and written at its next delivery, which
    replays the call instead of meeting an unknown outcome."""
    monkeypatch.setattr(owed, "PERSIST_DELAYS", (0.05, 0.05))
    proxy, _ = proxied
    pg_ledger.create_budget("acme", 1_000_000)
    app = _eager_app_through(proxy, pg_url)
    ask = _ask_claude(app, fake)
    _outage_after_billing(fake, proxy, pg_ledger.provider_key("ask:2:anthropic.messages:1"), None)
    try:
        with pytest.raises(LedgerUnavailable):
            ask.delay(2).get()
        [sent] = [s for s in fake.served_as(pg_ledger) if s.method == "POST"]
        assert pg_ledger.attempt(str(sent.idempotency_key)).state == "sending"
        proxy.restore()
        text = ask.delay(2).get()  # the owed writes land, then the replay
        assert text and len([s for s in fake.served() if s.method == "POST"]) == 1
        attempt = pg_ledger.attempt(str(sent.idempotency_key))
        assert (attempt.state, attempt.actual) == ("settled", sent.billed)
        assert pg_ledger.operation("ask:2").status == "succeeded"
        balance = pg_ledger.balance("acme")
        assert (balance.spent, balance.held) == (sent.billed, 0) and pg_ledger.audit() == []
    finally:
        close_ledgers()
        app.close()


@pytest.mark.parametrize("b_outlives_its_lease", [False, True])
def test_a_write_owed_through_an_outage_never_drops_the_hold_of_a_run_that_took_over(
    proxied: tuple[FaultProxy, Ledger],
    pg_ledger: Ledger,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    b_outlives_its_lease: bool,
) -> None:
    """Run A meets the outage as it is granted its send (nothing sent) and keeps back
    what undoes the grant. Its lease expires; run B, another process's, takes the
    operation and sends under the very attempt A was to send. A's owed write, applied
    while B's call is out (B's lease live, or B past its own lease), must not touch
    B's hold: it used to release it, and then 900 more were admitted on a cap of 1,000
    with 600 out."""
    proxy, through_proxy = proxied
    pg_ledger.create_budget("acme", 1_000)
    name = f"outage{uuid.uuid4().hex[:8]}"
    # An earlier run died between reserving its main attempt and sending under it.
    start = pg_ledger.calls.admit(
        "job:1",
        fingerprint="fp",
        owner="gone",
        lease=timedelta(milliseconds=1),
        max_runs=5,
        task=name,
        plan=lambda here: None,
    )
    pg_ledger.calls.reserve(
        "acme", "job:1#1", 600, fingerprint="fp", reason="first", operation_id=start.operation_id
    )
    time.sleep(0.05)
    grants: list[str] = []
    grant = CallLedger.mark_sending

    def grant_then_outage(self: CallLedger, key: str, **kwargs: Any) -> None:
        grants.append(key)
        if len(grants) == 1:
            proxy.cut()  # run A: the ledger goes away as the send is granted
        grant(self, key, **kwargs)

    monkeypatch.setattr(CallLedger, "mark_sending", grant_then_outage)
    seen: dict[str, Any] = {}

    def job_of(app: Celery, body: Any) -> Any:
        return app.task(
            base=BudgetTask,
            bind=True,
            budget="acme",
            name=name,
            lease_seconds=0.5,
            fingerprint=lambda n: "fp",
            idempotency_key=lambda n: f"job:{n}",
            estimate_cost=lambda n: 600,
        )(body)

    def run_a(self: BudgetTask, n: int) -> int:
        raise AssertionError("run A is never granted its send")

    def run_b(self: BudgetTask, n: int) -> int:
        seen["key"] = self.attempt.key  # B's call is out under it
        if b_outlives_its_lease:
            time.sleep(0.6)
        # Meanwhile A's process, the ledger back, writes what it kept back.
        seen["written"] = catch_up(through_proxy.calls)
        seen["state"] = pg_ledger.attempt("job:1#1").state
        try:
            pg_ledger.calls.reserve("acme", "other", 900)
            seen["other"] = "admitted"
        except BudgetExceeded:
            seen["other"] = "refused"
        return n

    app_a = _eager_app_through(proxy, pg_url)
    app_b = Celery("other-host", set_as_current=False)
    app_b.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=pg_url)
    try:
        with pytest.raises(LedgerUnavailable):
            job_of(app_a, run_a).delay(1).get()
        proxy.restore()
        time.sleep(0.6)  # A's lease expires
        assert job_of(app_b, run_b).delay(1).get() == 1
        assert grants == ["job:1#1", "job:1#1"]
        assert seen == {"key": "job:1#1", "written": 1, "state": "sending", "other": "refused"}
        attempt = pg_ledger.attempt("job:1#1")
        assert (attempt.state, attempt.actual) == ("settled", 600)
        assert pg_ledger.operation("job:1").status == "succeeded"
        balance = pg_ledger.balance("acme")
        assert (balance.spent, balance.held) == (600, 0) and pg_ledger.audit() == []
    finally:
        close_ledgers()
        app_a.close()
        app_b.close()
