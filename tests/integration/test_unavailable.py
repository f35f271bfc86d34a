"""Fail closed: with the database out of reach the ledger refuses, never bypasses,
and it recovers on its own when the database is back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from budget_tasks import BudgetTask, Ledger, LedgerUnavailable, OutcomeUnknown
from budget_tasks.config import close_ledgers
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


def test_ledger_lost_inside_run_keeps_the_hold_and_gives_the_lease_back_later(
    proxied: tuple[FaultProxy, Ledger], pg_ledger: Ledger, pg_url: str
) -> None:
    """run() meets the outage after its send was granted: what the error meant cannot be
    written, so the attempt stays 'sending' (held), the task fails with
    LedgerUnavailable (a worker retries the message), and once the ledger answers the
    next delivery gives the lease back and keeps the hold as unknown: no resend."""
    proxy, _ = proxied
    pg_ledger.create_budget("acme", 1_000)
    database = pg_url.rsplit("/", 1)[1]
    app = Celery("outage-in-run", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        budget_ledger_url=f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{database}",
    )
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
        self.attempt.record_request_id("req_1")
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
