"""Scenario 3: a host cut off from Redis long enough for the visibility timeout to hand
its unacknowledged message to another host while the first still runs it.

Host a runs a call the provider takes seconds to answer, and loses Redis meanwhile (it
cannot ack). Host b restores the message once the visibility timeout passes and runs
it: it finds a's live lease and waits, delivery after delivery; a, which still reaches
PostgreSQL, settles the call and stores its result; b's next delivery replays that
result. The provider is called once.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from .test_host_killed import lease, requests_for

pytestmark = pytest.mark.hosts


def test_a_message_handed_to_a_second_host_while_the_first_runs_it_is_never_sent_twice(
    hosts: Any, client: Celery, fake: FakeProvider, pg_ledger: Ledger, hosts_counts: Any
) -> None:
    a, b = hosts("host-a"), hosts("host-b")
    a.start()
    # the call outlasts the visibility timeout, not its lease
    fake.plan("delay=6", path="/chat/completions")
    result = client.send_task("hosts.call_long_lease", args=["r1"])
    wait_for(lambda: requests_for(fake, pg_ledger, "r1"), 60, "the provider call")
    owner, _, _ = lease(pg_ledger, "hosts:r1")
    assert owner is not None and owner.startswith("host-a:")
    a.redis.cut()  # a runs on, and can no longer ack
    on_b = b.start()

    value = result.get(timeout=90)  # b's delivery, replaying what a stored
    assert value["job"] == "r1"
    log_b = on_b.log_path.read_text()
    assert "OperationInProgress('hosts:r1')" in log_b  # b waited on a's live lease
    assert "replayed" in log_b or "succeeded" in log_b
    operation = pg_ledger.operation("hosts:r1")
    assert operation.status == "succeeded"
    assert operation.result == value
    assert operation.replays >= 1
    assert len(requests_for(fake, pg_ledger, "r1")) == 1
    attempt = pg_ledger.attempt("hosts:r1#1")
    assert (attempt.state, attempt.actual) == ("settled", fake.billed_for("hosts:r1#1", pg_ledger))
    a.redis.restore()
    assert pg_ledger.audit() == []
    hosts_counts(
        3,
        tasks=1,
        partitions=1,
        deliveries=lease(pg_ledger, "hosts:r1")[2],
        sends=1,
        replays=operation.replays,
    )
