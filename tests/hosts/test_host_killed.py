"""Scenario 1: a whole host killed mid-call (every process of its namespaces, SIGKILL).

Another host gets the message when Redis's visibility timeout passes, but cannot see
the dead host's processes (another PID namespace, another hostname): it finds a live
lease and waits, delivery after delivery, until the lease expires by time; then it
takes the operation over, finds the call was sent with its outcome unknown, and sends
nothing. The hold stays until reconciliation settles it at what the provider billed.
Checked against the fake provider's own record.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from .host_tasks import LEASE_SECONDS

pytestmark = pytest.mark.hosts


def requests_for(fake: FakeProvider, ledger: Ledger, job: str) -> list[Any]:
    keys = {ledger.provider_key(f"hosts:{job}#{n}") for n in range(1, 6)}
    return [s for s in fake.served() if s.method == "POST" and s.idempotency_key in keys]


def lease(ledger: Ledger, key: str) -> tuple[str | None, Any, int]:
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text("SELECT lease_owner, lease_expires_at, deliveries FROM operations WHERE key = :k"),
            {"k": key},
        ).one()
    return row[0], row[1], int(row[2])


def test_a_host_killed_mid_call_is_waited_for_then_reconciled_never_resent(
    hosts: Any, client: Celery, fake: FakeProvider, pg_ledger: Ledger, hosts_counts: Any
) -> None:
    a, b = hosts("host-a"), hosts("host-b")
    a.start()
    # the provider answers after the host is dead and its lease has expired
    fake.plan(f"delay={LEASE_SECONDS + 2:g}", path="/chat/completions")
    result = client.send_task("hosts.call", args=["k1"])
    wait_for(lambda: requests_for(fake, pg_ledger, "k1"), 60, "the provider call")
    owner, expires, deliveries = lease(pg_ledger, "hosts:k1")
    assert owner is not None and owner.startswith("host-a:")
    assert deliveries == 1
    a.kill()
    on_b = b.start()

    # Host b gets the message again and finds host a's lease live: it waits, and the
    # attempt stays as host a left it, until the lease expires by the database's clock.
    waited = False
    while True:
        with pg_ledger.engine.connect() as conn:
            now = conn.execute(text("SELECT now()")).scalar_one()
        owner_now, _, deliveries = lease(pg_ledger, "hosts:k1")
        if now >= expires:
            break
        assert owner_now == owner, "a live lease of a host that cannot be seen was taken"
        assert pg_ledger.attempt("hosts:k1#1").state == "sending"
        waited = waited or deliveries >= 2
        time.sleep(0.2)
    assert waited, "host b never delivered the message while host a's lease was live"

    # Then b takes it over: the call was sent and its outcome is unknown; nothing resent.
    with pytest.raises(Exception, match=r"OutcomeUnknown|outcome"):
        result.get(timeout=90)
    log = on_b.log_path.read_text()
    assert "retry: Retry in 0.5s: OperationInProgress('hosts:k1')" in log
    assert "outcome unknown, its hold kept" in log  # host b concluded it
    assert pg_ledger.operation("hosts:k1").status == "unknown"
    attempt = pg_ledger.attempt("hosts:k1#1")
    assert attempt.state == "unknown"
    assert len(requests_for(fake, pg_ledger, "k1")) == 1
    held = pg_ledger.balance("default").held
    assert held == attempt.amount  # the hold stays until the provider says

    # Reconciliation (through host b's worker) settles it at what the provider billed,
    # once the provider has finished the call the dead host sent.
    wait_for(lambda: fake.billed_for("hosts:k1#1", pg_ledger), 60, "the provider's bill")
    counts = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
    assert counts["found"] == 1
    settled = pg_ledger.attempt("hosts:k1#1")
    assert (settled.state, settled.actual) == ("settled", fake.billed_for("hosts:k1#1", pg_ledger))
    assert pg_ledger.balance("default").held == 0
    assert len(requests_for(fake, pg_ledger, "k1")) == 1
    assert pg_ledger.audit() == []
    hosts_counts(
        1,
        tasks=1,
        kills=1,
        deliveries=lease(pg_ledger, "hosts:k1")[2],
        sends=1,
        replays=0,
        reconciled=counts["found"],
    )
