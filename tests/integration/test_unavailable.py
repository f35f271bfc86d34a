"""Fail closed: with the database out of reach the ledger refuses, never bypasses,
and it recovers on its own when the database is back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from budget_tasks import BudgetTask, Ledger, LedgerUnavailable, OutcomeUnknown
from budget_tasks.config import close_ledgers
from budget_tasks.providers.calls import Sent
from budget_tasks.testing.harness import FaultProxy

from ..services import PG_ADMIN_URL


def test_unreachable_database_refuses_every_call() -> None:
    ledger = Ledger("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    calls = [
        lambda: ledger.reserve("acme", "k", 10),
        lambda: ledger.mark_sending("k"),
        lambda: ledger.settle("k", 10),
        lambda: ledger.release("k", "x"),
        lambda: ledger.balance("acme"),
        lambda: ledger.create_budget("acme", 10),
        lambda: ledger.audit(),
        lambda: ledger.holds(),
    ]
    for call in calls:
        with pytest.raises(LedgerUnavailable, match="nothing may be sent"):
            call()


def test_unopenable_sqlite_file_refuses(tmp_path: object) -> None:
    ledger = Ledger("sqlite:////nonexistent-dir/ledger.db")
    with pytest.raises(LedgerUnavailable):
        ledger.reserve("acme", "k", 10)


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
    ledger.reserve("acme", "before", 10)  # pooled connections now exist
    ledger.mark_sending("before")

    proxy.cut()
    with pytest.raises(LedgerUnavailable):
        ledger.reserve("acme", "during", 10)
    with pytest.raises(LedgerUnavailable):
        ledger.settle("before", 10)
    # Read through a direct connection: nothing was written during the outage.
    assert [a.key for a in pg_ledger.attempts()] == ["before"]
    assert pg_ledger.balance("acme").held == 10

    proxy.restore()
    # The stale pooled connections are replaced without an error reaching the caller.
    assert ledger.reserve("acme", "after", 10).created
    assert ledger.settle("before", 10)
    assert ledger.balance("acme").held == 10
    assert pg_ledger.audit() == []


def test_stale_pool_after_a_restart_is_replaced_transparently(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger
) -> None:
    proxy, ledger = proxied
    pg_ledger.create_budget("acme", 100)
    ledger.reserve("acme", "a", 10)
    ledger.budgets()
    proxy.cut()  # every pooled connection dies, as in a database restart
    proxy.restore()
    assert ledger.reserve("acme", "b", 10).created
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
