"""Scenario 2: a host cut off from PostgreSQL mid-load, its connections reset, and
separately black-holed (the proxy accepts and forwards nothing, no reset: the host's
queries hang until the path heals).

While it is cut off, it sends nothing that has no committed hold: the tasks sent then
reach the provider only after the heal. The calls already at the provider when the
path went answer into the outage; their outcomes are written once it heals (the writes
kept back, or reconciliation where a run could not keep them). No hold is lost: every
request the provider served is one settled attempt, charged what it billed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from .test_host_killed import requests_for

pytestmark = pytest.mark.hosts

IN_FLIGHT = ("k1", "k2")
DURING = ("k3", "k4")


@pytest.mark.parametrize("fault", ["reset", "blackhole"])
def test_a_host_cut_off_from_postgresql_sends_nothing_unheld_and_loses_no_hold(
    fault: str,
    hosts: Any,
    client: Celery,
    fake: FakeProvider,
    pg_ledger: Ledger,
    hosts_counts: Any,
) -> None:
    a = hosts("host-a")
    a.start()
    fake.plan("delay=3", count=len(IN_FLIGHT), path="/chat/completions")
    results = {job: client.send_task("hosts.call", args=[job]) for job in IN_FLIGHT}
    wait_for(
        lambda: all(requests_for(fake, pg_ledger, job) for job in IN_FLIGHT),
        60,
        "the in-flight calls at the provider",
    )
    if fault == "reset":
        a.pg.cut()
    else:
        a.pg.blackhole()
    results |= {job: client.send_task("hosts.call", args=[job]) for job in DURING}
    # the in-flight calls answer into the outage; nothing new reaches the provider
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        for job in DURING:
            assert not requests_for(fake, pg_ledger, job), f"{job} was sent unheld"
        time.sleep(0.2)
    assert {job: len(requests_for(fake, pg_ledger, job)) for job in IN_FLIGHT} == {
        "k1": 1,
        "k2": 1,
    }
    a.pg.restore()

    ends = {}
    for job, result in results.items():
        try:
            result.get(timeout=120)
            ends[job] = "ok"
        except Exception as exc:  # a run that could not keep its writes: unknown
            ends[job] = type(exc).__name__
    assert set(ends.values()) <= {"ok", "OutcomeUnknown"}, ends
    assert all(ends[job] == "ok" for job in DURING), ends  # sent after the heal
    reconciled = 0
    if "OutcomeUnknown" in ends.values():
        wait_for(
            lambda: all(fake.billed_for(f"hosts:{j}#1", pg_ledger) for j in IN_FLIGHT),
            60,
            "the provider's bills",
        )
        reconciled = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)["found"]

    # every request served is one attempt, settled at what the provider billed
    for job in (*IN_FLIGHT, *DURING):
        assert len(requests_for(fake, pg_ledger, job)) == 1, job
        attempt = pg_ledger.attempt(f"hosts:{job}#1")
        assert (attempt.state, attempt.actual) == (
            "settled",
            fake.billed_for(f"hosts:{job}#1", pg_ledger),
        ), job
    assert pg_ledger.balance("default").held == 0
    assert pg_ledger.audit() == []
    hosts_counts(
        2,
        tasks=len(ends),
        partitions=1,
        sends=len(ends),
        unknown_at_heal=list(ends.values()).count("OutcomeUnknown"),
        reconciled=reconciled,
    )
