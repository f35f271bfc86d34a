"""Scenario 4: clock skew. Host a's clock is five minutes ahead, host b's five minutes
behind (the clock the ledger reads as the host's is replaced in each worker). Leases
and periods follow the database's clock, so nothing changes: a's lease runs its
length by the database, and when a dies mid-call, b takes over when that lease
expires by the database, not ten minutes later (which b's own clock against a's would
say) and not before.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from .host_tasks import LEASE_SECONDS, SKEW_ENV
from .test_host_killed import lease, requests_for

pytestmark = pytest.mark.hosts

SKEW = 300  # seconds


def db_now(ledger: Ledger) -> Any:
    with ledger.engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar_one()


def test_hosts_whose_clocks_disagree_follow_the_databases_clock(
    hosts: Any, client: Celery, fake: FakeProvider, pg_ledger: Ledger, hosts_counts: Any
) -> None:
    a, b = hosts("host-a"), hosts("host-b")
    a.start(**{SKEW_ENV: str(SKEW)})
    fake.plan(f"delay={LEASE_SECONDS + 2:g}", path="/chat/completions")
    sent_at = db_now(pg_ledger)
    result = client.send_task("hosts.call", args=["s1"])
    wait_for(lambda: requests_for(fake, pg_ledger, "s1"), 60, "the provider call")
    owner, expires, _ = lease(pg_ledger, "hosts:s1")
    assert owner is not None and owner.startswith("host-a:")
    # a's lease runs LEASE_SECONDS by the database, not by a's clock five minutes ahead
    assert sent_at < expires <= db_now(pg_ledger) + timedelta(seconds=LEASE_SECONDS + 1)
    attempt = pg_ledger.attempt("hosts:s1#1")
    assert abs((attempt.created_at - sent_at).total_seconds()) < 5

    a.kill()
    on_b = b.start(**{SKEW_ENV: str(-SKEW)})
    while db_now(pg_ledger) < expires:
        assert lease(pg_ledger, "hosts:s1")[0] == owner  # not before it expires
        time.sleep(0.2)
    with pytest.raises(Exception, match=r"OutcomeUnknown|outcome"):
        result.get(timeout=60)  # well before the ten minutes the raw clocks would say
    took_over = db_now(pg_ledger)
    assert took_over - expires < timedelta(seconds=30)
    assert "outcome unknown, its hold kept" in on_b.log_path.read_text()
    assert len(requests_for(fake, pg_ledger, "s1")) == 1
    assert pg_ledger.attempt("hosts:s1#1").state == "unknown"
    assert pg_ledger.audit() == []
    hosts_counts(4, tasks=1, kills=1, skew_seconds=SKEW, sends=1, replays=0)
