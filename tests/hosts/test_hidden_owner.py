"""Scenario 7: a host whose /proc is mounted ``hidepid=2`` and whose workers run as
different users. Both workers share the host's PID namespace and boot, so the lease's
shortcut applies ("is its owner's process gone?"), but the worker running as
``nobody`` cannot see the root worker's processes in /proc.

Host h's root worker runs a call that outlasts Redis's visibility timeout; the message
goes to h's other worker, which cannot see the owner. It must not take the live lease
for gone: it waits, delivery after delivery, until the owner settles, then replays the
stored result. The provider is called once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from .test_host_killed import lease, requests_for

pytestmark = pytest.mark.hosts

NOBODY = 65534
CALL_SECONDS = 12  # past the visibility timeout (3 s) and the other worker's start

#: What the worker as ``nobody`` can see of the lease owner's process, asked from its
#: own place (the host's namespaces, its uid): its /proc entry, and whether it shares
#: the owner's PID namespace (the proof in the lease names it).
PROBE = """
import json, os, sys
pid, pidns = sys.argv[1:3]
print(json.dumps({
    "sees_owner": os.path.exists(f"/proc/{pid}"),
    "same_pidns": str(os.stat("/proc/self/ns/pid").st_ino) == pidns,
}))
"""


def test_a_live_lease_whose_owner_proc_hides_is_never_taken_for_gone(
    hosts: Any, client: Celery, fake: FakeProvider, pg_ledger: Ledger, hosts_counts: Any
) -> None:
    h = hosts("host-h", hidepid=True)
    h.start(concurrency=1)  # as root: busy with the call, it takes no other message
    fake.plan(f"delay={CALL_SECONDS}", path="/chat/completions")
    result = client.send_task("hosts.call_long_lease", args=["h1"])
    wait_for(lambda: requests_for(fake, pg_ledger, "h1"), 60, "the provider call")
    owner, expires, _ = lease(pg_ledger, "hosts:h1")
    assert owner is not None and owner.startswith("host-h:")
    on_nobody = h.start(concurrency=1, user=NOBODY)
    assert {os.stat(f"/proc/{pid}").st_uid for pid in on_nobody.children()} == {NOBODY}

    # The scenario holds: the worker as nobody shares the owner's PID namespace (so it
    # would trust /proc), and /proc hides the owner from it.
    pid = owner.split("@")[0].split(":")[1]
    pidns = owner.split("@")[1].split("/")[1]
    seen = json.loads(h.run([sys.executable, "-c", PROBE, pid, pidns], user=NOBODY))
    assert seen == {"sees_owner": False, "same_pidns": True}, seen

    # Until the owner settles (well inside its lease), the lease stays the owner's.
    waited = False
    deadline = time.monotonic() + CALL_SECONDS + 30
    while True:
        assert time.monotonic() < deadline, "the owner never settled"
        # the status and the lease read together: the owner settling between two reads
        # gives its lease back (None) while an earlier read still said running
        with pg_ledger.engine.connect() as conn:
            now, status, owner_now, deliveries = conn.execute(
                text(
                    "SELECT now(), status, lease_owner, deliveries FROM operations "
                    "WHERE key = 'hosts:h1'"
                )
            ).one()
        if status != "running":
            break
        assert now < expires, "the call outlived its lease: the scenario needs it inside"
        assert owner_now == owner, "a live lease whose owner /proc hides was taken over"
        waited = waited or deliveries >= 2
        time.sleep(0.2)
    status = pg_ledger.operation("hosts:h1").status
    assert status == "succeeded", f"the live lease was taken for gone: the operation is {status}"
    assert waited, "the other worker never got the message while the lease was live"

    value = result.get(timeout=60)
    assert value["job"] == "h1"
    wait_for(
        lambda: (
            "replayed" in on_nobody.log_path.read_text()
            or pg_ledger.operation("hosts:h1").replays >= 1
        ),
        30,
        "the replay on the worker as nobody",
    )
    log = on_nobody.log_path.read_text()
    assert "OperationInProgress('hosts:h1')" in log  # it waited on the live lease
    assert "outcome unknown" not in log
    operation = pg_ledger.operation("hosts:h1")
    assert (operation.status, operation.result) == ("succeeded", value)
    assert operation.replays >= 1
    assert len(requests_for(fake, pg_ledger, "h1")) == 1
    attempt = pg_ledger.attempt("hosts:h1#1")
    assert (attempt.state, attempt.actual) == ("settled", fake.billed_for("hosts:h1#1", pg_ledger))
    assert pg_ledger.audit() == []
    hosts_counts(
        7,
        tasks=1,
        deliveries=lease(pg_ledger, "hosts:h1")[2],
        sends=1,
        replays=operation.replays,
    )
