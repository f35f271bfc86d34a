"""Scenario 6: the ledger's primary fails over while two hosts are mid-load.

The test makes a PostgreSQL primary and a synchronous standby of its own (PostgreSQL's
streaming replication: ``pg_basebackup -R``, ``synchronous_standby_names``), each on
its own loopback port. Every host reaches both through proxies of its own and names
both in a multi-host ledger URL with ``target_session_attrs=read-write``. Mid-load the
primary dies (immediate stop: every backend killed, as a crash) and the standby is
promoted a moment later. The hosts carry on against the new primary on their own.

Against the fake provider's own record and the new primary: every hold and settlement
committed before the failure is there (a snapshot read from the old primary just
before it died, and every task that returned); every request the provider served has
its attempt, committed as sending before it arrived: nothing was sent without a
committed hold, during the outage either; no hold is lost and the audit is clean.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import Ledger, LedgerUnavailable
from budget_tasks.testing import FakeProvider
from tests.support import wait_for

from ..chaos.invariants import (
    check_audit_and_caps,
    check_no_hold_lost,
    check_requests_match_attempts,
)
from ..chaos.pg_cluster import PgCluster, pg_bin_dir
from ..services import missing
from .test_host_killed import requests_for

pytestmark = pytest.mark.hosts

BEFORE = 24  # tasks sent before the failure
AFTER = 8  # tasks sent once the standby is promoted
OUTAGE = 1.5  # seconds between the primary's death and the promotion
STANDBY = "standby"  # its application_name, which synchronous_standby_names names


def standby_of(primary: PgCluster) -> PgCluster:
    """A streaming standby of ``primary``: a base backup that follows it (``-R``)."""
    standby = PgCluster(primary.bin)
    standby._run(
        "pg_basebackup",
        "-D",
        str(standby.data),
        "-h",
        "127.0.0.1",
        "-p",
        str(primary.port),
        "-U",
        "postgres",
        "-R",  # standby.signal, and primary_conninfo pointing at the primary
        "-X",
        "stream",
        "-c",
        "fast",
        "--no-sync",
    )
    with (standby.data / "postgresql.conf").open("a") as conf:
        # the copied settings name the primary's port and socket: these come later, and win
        conf.write(f"port = {standby.port}\n")
        conf.write(f"unix_socket_directories = '{standby.sockets}'\n")
        conf.write(f"cluster_name = '{STANDBY}'\n")  # its walreceiver's application_name
    return standby


def sql(cluster: PgCluster, statement: str) -> Any:
    with psycopg.connect(cluster.conninfo(), autocommit=True, connect_timeout=5) as conn:
        return conn.execute(statement).fetchall()


@pytest.fixture
def replicated() -> Iterator[tuple[PgCluster, PgCluster, str]]:
    """A primary with a synchronous standby, and a ledger database on them."""
    bin_dir = pg_bin_dir()
    if bin_dir is None or not (bin_dir / "pg_basebackup").exists():
        missing("PostgreSQL binaries (initdb, pg_basebackup)", "not found")
    assert bin_dir is not None
    clusters: list[PgCluster] = []
    try:
        primary = PgCluster(bin_dir)
        clusters.append(primary)
        primary.init().start()
        url = primary.create_database("failover")
        Ledger(url).create_schema()
        standby = standby_of(primary)
        clusters.append(standby)
        standby.start()
        with (primary.data / "postgresql.conf").open("a") as conf:
            # a COMMIT returns only once the standby has the WAL on disk
            conf.write(f"synchronous_standby_names = '{STANDBY}'\n")
        primary._run("pg_ctl", "-D", str(primary.data), "reload")
        wait_for(
            lambda: sql(primary, "SELECT sync_state FROM pg_stat_replication") == [("sync",)],
            30,
            "the standby to stream synchronously",
        )
        yield primary, standby, url
    finally:
        for cluster in clusters:
            cluster.close()


def test_a_primary_that_fails_over_mid_load_loses_nothing_committed_and_sends_nothing_unheld(
    replicated: tuple[PgCluster, PgCluster, str],
    hosts: Any,
    client: Celery,
    fake: FakeProvider,
    hosts_counts: Any,
) -> None:
    primary, standby, url = replicated
    database = url.rsplit("/", 1)[1]
    on_primary = Ledger(url)
    on_standby = Ledger(standby.url(database))
    try:
        on_primary.create_budget("default", 10_000_000)
        fleet = [hosts(f"host-{n}", ledger=url, standby=standby.url(database)) for n in "ab"]
        assert "target_session_attrs=read-write" in fleet[0].ledger_url
        for worker in [host.start(wait=False) for host in fleet]:
            worker.wait_ready()

        # about 6 s of load on 4 processes; calls of unequal length, so that the
        # processes do not finish (and stand between calls) together
        def delay(n: int) -> dict[str, str]:
            return {"fault": f"delay={0.6 + 0.2 * (n % 5):.1f}"}

        results = {
            f"f{n}": client.send_task("hosts.call", args=[f"f{n}"], kwargs=delay(n))
            for n in range(BEFORE)
        }

        def under_way() -> dict[str, Any] | None:
            found = {a.key: a for a in on_primary.attempts()}
            states = Counter(a.state for a in found.values())
            return found if states["settled"] >= BEFORE // 6 and states["sending"] else None

        # What the primary has committed, read just before it dies: some settled,
        # some calls at the provider.
        snapshot = wait_for(under_way, 90, "the load to be under way")
        on_primary.dispose()
        primary.stop("immediate")
        # The hosts' own path finds no primary: the old one is gone, the standby takes
        # no writes (target_session_attrs). Meanwhile they must send nothing unheld.
        probe = Ledger(fleet[0].ledger_url)
        with pytest.raises(LedgerUnavailable, match="read-only"):
            probe.create_budget("probe", 1)
        time.sleep(OUTAGE)
        standby._run("pg_ctl", "-D", str(standby.data), "-w", "promote")
        promoted = sql(standby, "SELECT now()")[0][0]
        assert sql(standby, "SELECT pg_is_in_recovery()") == [(False,)]
        probe.create_budget("probe", 1)  # the same URL now reaches the new primary
        probe.dispose()
        results |= {
            f"g{n}": client.send_task("hosts.call", args=[f"g{n}"], kwargs=delay(n))
            for n in range(AFTER)
        }

        ends: Counter[str] = Counter()
        returned: dict[str, Any] = {}
        for job, result in results.items():
            try:
                returned[job] = result.get(timeout=120)
                ends["ok"] += 1
            except Exception as exc:  # a call whose outcome the outage left unknown
                ends[type(exc).__name__] += 1
        assert set(ends) <= {"ok", "OutcomeUnknown"}, ends
        reconciled = 0
        if ends["OutcomeUnknown"]:
            unknown = [a.key for a in on_standby.attempts() if a.state == "unknown"]
            wait_for(
                lambda: all(fake.billed_for(k, on_standby) for k in unknown),
                60,
                "the provider's bills",
            )
            counts = client.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
            reconciled = counts["found"]

        # The failure came mid-load: some of it done before, calls at the provider as
        # the primary died, the rest after.
        done_before = sum(a.state == "settled" for a in snapshot.values())
        assert 0 < done_before < BEFORE, done_before
        assert any(a.state == "sending" for a in snapshot.values()), snapshot
        # The hosts met the outage, and held back (their writes, or their admissions).
        logs = "\n".join(p.log_path.read_text() for host in fleet for p in host.processes)
        assert "ledger unavailable" in logs.lower()
        now = {a.key: a for a in on_standby.attempts()}
        after = [k for k, a in now.items() if a.state == "settled" and k not in snapshot]
        after += [k for k, a in snapshot.items() if a.state != "settled" and k in now]
        assert after, "nothing was written through the new primary"
        with on_standby.engine.connect() as conn:
            newest = conn.execute(text("SELECT max(created_at) FROM attempts")).scalar_one()
        assert newest > promoted

        # Nothing committed is lost: what the old primary had, and every task that
        # returned (its settlement and result committed first), is on the new one.
        for key, before in snapshot.items():
            assert key in now, f"{key} committed on the old primary, gone after failover"
            if before.state == "settled":
                assert (now[key].state, now[key].actual) == ("settled", before.actual), key
        unsent = 0
        for job, value in returned.items():
            operation = on_standby.operation(f"hosts:{job}")
            assert (operation.status, operation.result) == ("succeeded", value), job
            # One attempt sent and settled at its bill. An admission whose COMMIT's
            # answer the failover cut off leaves a hold never sent: released, and the
            # next delivery admits again.
            mine = [a for k, a in now.items() if k.startswith(f"hosts:{job}#")]
            billed = {a.key: fake.billed_for(a.key, on_standby) for a in mine}
            [sent_one] = [a for a in mine if billed[a.key]]
            assert (sent_one.state, sent_one.actual) == ("settled", billed[sent_one.key]), job
            for other in mine:
                if other is not sent_one:
                    assert (other.state, other.actual) == ("released", 0), other
                    unsent += 1
        # Nothing sent without a committed hold, before, during or after the outage.
        sent = check_requests_match_attempts(on_standby, fake)
        for job in results:
            assert len(requests_for(fake, on_standby, job)) == 1, job
        check_no_hold_lost(on_standby)
        check_audit_and_caps(on_standby)
        spent = sum(a.actual or 0 for a in on_standby.attempts() if a.state == "settled")
        unknown_billed = sum(
            fake.billed_for(a.key, on_standby)
            for a in on_standby.attempts()
            if a.state == "unknown"
        )
        assert fake.state()["billed_total"] == spent + unknown_billed

        hosts_counts(
            6,
            tasks=len(results),
            failovers=1,
            sends=sent,
            settled_before_failover=done_before,
            sending_at_failover=sum(a.state == "sending" for a in snapshot.values()),
            settled_through_new_primary=len(after),
            holds_released_unsent=unsent,
            unknown=ends["OutcomeUnknown"],
            reconciled=reconciled,
        )
    finally:
        on_primary.dispose()
        on_standby.dispose()
