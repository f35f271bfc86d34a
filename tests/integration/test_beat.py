"""The periodic jobs against the real ledger and the fake provider through the SDK:
stale holds flagged once and never released, reconciliation settling what the
provider billed, periods renewed by their written policy, old payloads purged."""

from __future__ import annotations

import socket
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest
from celery import Celery
from prometheus_client import REGISTRY
from sqlalchemy import text

import budget_tasks.metrics  # noqa: F401  (importing it adds the Prometheus hooks sink)
from budget_tasks import BudgetTask, Ledger, OutcomeUnknown
from budget_tasks.beat import (
    flag_stale_holds,
    purge_expired_operations,
    reconcile_unknown,
    renew_periods,
    stale_hold,
)
from budget_tasks.ledger.leases import owner_id, this_process
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from budget_tasks.testing import FakeProvider, ManualClock
from tests.support import race
from tests.support.sdk_calls import LOOKUP_ANTHROPIC_MESSAGES, LOOKUP_OPENAI_CHAT, openai_chat

PROMPT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 48,
    "messages": [{"role": "user", "content": "Reconcile me."}],
}


def unknown_attempt(ledger: Ledger, key: str, *, lookup: str = LOOKUP_OPENAI_CHAT) -> None:
    ledger.calls.reserve("team", key, 10_000)
    ledger.calls.describe_attempt(key, lookup=lookup, model="gpt-4o-mini")
    ledger.calls.mark_sending(key, provider="openai")
    ledger.calls.mark_unknown(key, "read timeout")


def stale_count(budget: str) -> float:
    return REGISTRY.get_sample_value("budget_tasks_stale_holds_total", {"budget": budget}) or 0.0


def test_stale_holds_are_flagged_once_announced_and_never_released(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    pg_ledger.create_budget("team", 1_000_000)
    unknown_attempt(pg_ledger, "old")
    pg_ledger.calls.reserve("team", "reserved-only", 10_000)  # not sent: not a stale send
    clock.advance(minutes=20)
    unknown_attempt(pg_ledger, "young")
    heard: list[Any] = []
    receiver = lambda sender, hold, **kw: heard.append(hold.key)  # noqa: E731
    stale_hold.connect(receiver)
    before = stale_count("team")
    try:
        flagged = flag_stale_holds(pg_ledger, timedelta(minutes=15))
        again = flag_stale_holds(pg_ledger, timedelta(minutes=15))
    finally:
        stale_hold.disconnect(receiver)
    assert [h.key for h in flagged] == ["old"]
    assert again == []
    assert heard == ["old"]
    assert stale_count("team") == before + 1
    assert pg_ledger.attempt("old").flagged_at == clock()
    assert pg_ledger.balance("team").held == 30_000  # nothing released


def flag_in_process(url: str, start: str) -> int:
    clock = ManualClock(datetime.fromisoformat(start))
    ledger = Ledger(url, clock=clock)
    try:
        return len(ledger.upkeep.flag_stale(timedelta(minutes=1)))
    finally:
        ledger.dispose()


def test_two_flaggers_at_once_flag_each_hold_once(
    pg_url: str, pg_ledger: Ledger, clock: ManualClock
) -> None:
    pg_ledger.create_budget("team", 10_000_000)
    for n in range(40):
        unknown_attempt(pg_ledger, f"h{n}")
    later = (clock() + timedelta(hours=1)).isoformat()
    counts = race(flag_in_process, [(pg_url, later), (pg_url, later)])
    assert sum(counts) == 40
    assert all(a.flagged_at is not None for a in pg_ledger.attempts())


@pytest.fixture
def eager(pg_url: str, pg_ledger: Ledger, fake: FakeProvider) -> Any:
    app = Celery("beat-tests", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=pg_url)
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)

    @app.task(
        base=BudgetTask,
        bind=True,
        budget="team",
        name=f"beat{uuid.uuid4().hex}",
        idempotency_key=lambda doc: f"doc:{doc}",
        estimate_cost=lambda doc: estimates.openai_chat(PROMPT).amount,
    )
    def summarize(self: BudgetTask, doc: str) -> str:
        return str(openai_chat(client, attempt=self.attempt, **PROMPT).result["content"])

    return summarize, client


def test_a_timeout_is_reconciled_with_what_the_provider_billed(
    eager: Any, fake: FakeProvider, pg_ledger: Ledger
) -> None:
    summarize, client = eager
    fake.plan("hang=2")
    with pytest.raises(openai.APITimeoutError):
        summarize.delay("a").get()
    [attempt] = pg_ledger.attempts()
    assert (attempt.state, attempt.lookup, attempt.model) == (
        "unknown",
        "openai.chat",
        "gpt-4o-mini",
    )
    with pytest.raises(OutcomeUnknown):
        summarize.delay("a").get()  # held, not resent
    counts = reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))
    assert counts["found"] == 1
    settled = pg_ledger.attempt(attempt.key)
    assert settled.state == "settled"
    assert settled.actual == fake.billed_for(attempt.key, pg_ledger) > 0
    assert pg_ledger.balance("team").held == 0
    # The provider's answer is stored on the operation and replays: no second call.
    replayed = summarize.delay("a").get()
    assert replayed == pg_ledger.operation("doc:a").result
    assert replayed["content"].startswith("fake")
    assert len([s for s in fake.served_as(pg_ledger) if s.idempotency_key == attempt.key]) == 1
    assert pg_ledger.audit() == []


def test_not_found_releases_and_requeues_pending_backs_off(
    pg_url: str, pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)
    # The provider stores completions (another call's is there): "not found" means something.
    openai_chat(client, key=pg_ledger.provider_key("another-call"), **PROMPT)
    start = pg_ledger.calls.admit(
        "op-lost",
        fingerprint="f",
        owner="me",
        lease=timedelta(minutes=5),
        max_runs=3,
        task="tests.summarize",
        payload={"args": ["lost", "text"], "kwargs": {}},
    )
    pg_ledger.calls.reserve("team", "op-lost#1", 10_000, operation_id=start.operation_id)
    pg_ledger.calls.describe_attempt("op-lost#1", lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini")
    pg_ledger.calls.mark_sending("op-lost#1")
    pg_ledger.calls.mark_unknown("op-lost#1", "connection reset")
    assert pg_ledger.calls.end_run("op-lost", owner="me").status == "unknown"  # the run gave up
    requeued: list[tuple[str, str, dict[str, Any]]] = []
    # The ledger clock moves past the send's timeout (1 s) + margin (0).
    clock.advance(seconds=2)
    counts = reconcile_unknown(
        pg_ledger,
        lambda kind: client,
        margin=timedelta(0),
        requeue=lambda *args: requeued.append(args),
    )
    assert counts["not_found"] == 1
    assert pg_ledger.attempt("op-lost#1").state == "released"
    assert pg_ledger.operation("op-lost").status == "retryable"
    assert requeued == [("tests.summarize", "op-lost", {"args": ["lost", "text"], "kwargs": {}})]
    # A send that is recent (on the real clock) is only pending, and is not looked up
    # again before its backoff has passed.
    now = Ledger(pg_url)
    unknown_attempt(now, "just-now")
    pending = reconcile_unknown(now, lambda kind: client, margin=timedelta(minutes=5))
    assert pending["pending"] == 1
    assert reconcile_unknown(now, lambda kind: client)["pending"] == 0
    assert now.attempt("just-now").lookups == 1
    now.dispose()


def test_unknowable_stays_held_and_is_flagged(pg_ledger: Ledger, clock: ManualClock) -> None:
    pg_ledger.create_budget("team", 1_000_000)
    unknown_attempt(pg_ledger, "claude-call", lookup=LOOKUP_ANTHROPIC_MESSAGES)
    counts = reconcile_unknown(pg_ledger, lambda kind: None)
    assert counts["unknowable"] == 1
    assert pg_ledger.attempt("claude-call").state == "unknown"
    clock.advance(hours=1)
    assert [h.key for h in flag_stale_holds(pg_ledger, timedelta(minutes=15))] == ["claude-call"]
    assert pg_ledger.balance("team").held == 10_000


def test_an_operations_main_attempt_of_0_left_unknown_is_released_not_looked_up(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    """A main attempt of 0 that an earlier version marked unknown: no call was ever
    sent under it, so no lookup could find it; reconciliation releases it (and leaves
    an attempt of 0 reserved outside any operation to its lookup: its key was given
    to whoever reserved it)."""
    pg_ledger.create_budget("team", 1_000_000)
    start = pg_ledger.calls.admit(
        "agent:7", fingerprint="f", owner="gone", lease=timedelta(seconds=1), max_runs=3
    )
    for key, operation_id in (("agent:7#1", start.operation_id), ("loose", None)):
        pg_ledger.calls.reserve("team", key, 0, operation_id=operation_id)
        pg_ledger.calls.mark_sending(key)
        pg_ledger.calls.mark_unknown(key, "an earlier version's beat: worker lost")
    clock.advance(timedelta(seconds=2))
    counts = reconcile_unknown(pg_ledger, lambda kind: None)
    assert (counts["not_found"], counts["unknowable"]) == (1, 1)
    assert pg_ledger.attempt("agent:7#1").state == "released"
    assert pg_ledger.attempt("loose").state == "unknown"
    assert pg_ledger.operation("agent:7").status == "retryable"
    assert pg_ledger.audit() == []


def reconcile_in_process(url: str, base_url: str) -> int:
    ledger = Ledger(url)
    client = openai_client(base_url=base_url, api_key="x", timeout=5.0)
    try:
        return reconcile_unknown(ledger, lambda kind: client, margin=timedelta(0))["found"]
    finally:
        ledger.dispose()


def test_two_reconcilers_at_once_settle_once(
    pg_url: str, pg_ledger: Ledger, fake: FakeProvider
) -> None:
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=0.5)
    pg_ledger.create_budget("team", 10_000_000)
    keys = [f"r{n}" for n in range(12)]
    for key in keys:
        pg_ledger.calls.reserve("team", key, 10_000)
        pg_ledger.calls.mark_sending(key)
        with pytest.raises(openai.APITimeoutError):
            openai_chat(
                client,
                attempt=_Described(pg_ledger, key),
                extra_headers={"x-fake-fault": "hang=1"},
                **PROMPT,
            )
        pg_ledger.calls.mark_unknown(key, "timeout")
    found = race(reconcile_in_process, [(pg_url, fake.openai_base_url)] * 2)
    assert sum(found) == len(keys)
    with pg_ledger.engine.connect() as conn:
        charges = conn.execute(text("SELECT count(*) FROM journal WHERE kind = 'charge'")).scalar()
    assert charges == len(keys)
    assert pg_ledger.balance("team").spent == sum(fake.billed_for(k, pg_ledger) for k in keys)
    assert pg_ledger.audit() == []


class _Described:
    """An attempt as the call helpers see it, for a bare ledger attempt."""

    def __init__(self, ledger: Ledger, key: str) -> None:
        self.ledger, self.key = ledger, key

    @property
    def provider_key(self) -> str:
        return self.ledger.provider_key(self.key)

    def describe(
        self,
        lookup: str,
        model: str,
        response_id: str | None = None,
        timeout: float | None = None,
        request: str | None = None,
        bound: Any = None,
    ) -> None:
        self.ledger.calls.describe_attempt(
            self.key, lookup=lookup, model=model, timeout=timeout, request=request, bound=bound
        )

    def record_request_id(self, request_id: str) -> None:
        self.ledger.calls.record_request_id(self.key, request_id)

    def record(self, sent: Any) -> None:
        pass


def test_renew_periods_applies_rollover_and_late_settlements_keep_their_period(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    pg_ledger.create_budget(
        "daily", 1_000, period="day", renewal="rollover", rollover_ceiling=2_500
    )
    pg_ledger.create_budget("flat", 1_000)
    pg_ledger.calls.reserve("daily", "spent", 300)
    pg_ledger.calls.mark_sending("spent")
    pg_ledger.calls.settle("spent", 300)
    pg_ledger.calls.reserve("daily", "late", 200)
    pg_ledger.calls.mark_sending("late")
    day1 = pg_ledger.balance("daily").period_start
    clock.advance(days=1)
    assert renew_periods(pg_ledger) == 1
    assert renew_periods(pg_ledger) == 1  # idempotent
    # carried: 1000 - 300 spent - 200 still held = 500
    assert pg_ledger.balance("daily").cap == 1_500
    pg_ledger.calls.settle("late", 150)
    assert pg_ledger.balance("daily", at=day1).spent == 450
    assert pg_ledger.balance("daily").spent == 0
    clock.advance(days=1)
    renew_periods(pg_ledger)
    assert pg_ledger.balance("daily").cap == 2_500  # 1000 + 1500 would be 2500: at the ceiling


def test_purge_drops_payloads_and_keeps_the_journal(
    eager: Any, pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    summarize, _ = eager
    summarize.delay("p").get()
    with pg_ledger.engine.connect() as conn:
        journal_before = conn.execute(text("SELECT * FROM journal ORDER BY id")).all()
    clock.advance(datetime.now(UTC) - clock() + timedelta(days=6))
    assert purge_expired_operations(pg_ledger, timedelta(days=7)).total == 0
    assert pg_ledger.operation("doc:p").result is not None
    clock.advance(days=2)
    assert purge_expired_operations(pg_ledger, timedelta(days=7)).operations == 1
    op = pg_ledger.operation("doc:p")
    assert (op.result, op.payload, op.status) == (None, None, "succeeded")
    with pg_ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT * FROM journal ORDER BY id")).all() == journal_before
    assert [a.state for a in pg_ledger.attempts()] == ["settled"]
    assert summarize.delay("p").get() is None  # still a replay, never a resend
    assert len(fake.served()) == 1


def renew_in_process(url: str, at: str) -> int:
    ledger = Ledger(url, clock=ManualClock(datetime.fromisoformat(at)))
    try:
        return renew_periods(ledger)
    finally:
        ledger.dispose()


def test_two_renewals_at_once_open_each_period_once(
    pg_url: str, pg_ledger: Ledger, clock: ManualClock
) -> None:
    for n in range(10):
        pg_ledger.create_budget(f"d{n}", 1_000, period="day", renewal="rollover")
        pg_ledger.upkeep.open_period(f"d{n}")
    tomorrow = (clock() + timedelta(days=1)).isoformat()
    assert race(renew_in_process, [(pg_url, tomorrow)] * 2) == [10, 10]
    with pg_ledger.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT budget_id, count(*) FROM budget_periods GROUP BY budget_id")
        ).all()
    assert sorted(count for _, count in rows) == [2] * 10  # yesterday's and today's, once
    assert pg_ledger.audit() == []


def test_a_send_left_sending_by_a_run_that_is_gone_is_reconciled(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    """A worker died mid-call and its message was lost with the broker: no delivery
    comes back to mark the attempt unknown. Reconciliation adopts it once no run holds
    its operation, and settles it at the provider's bill."""
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    pg_ledger.create_budget("team", 1_000_000)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id on this host that no longer runs
    here = socket.gethostname()
    me = this_process()
    assert me is not None
    owners = {
        # this boot and PID namespace, process gone: not live at once
        "dead": f"{here}:{dead.pid}:tok@{me.boot}/{me.pidns}/1",
        "alive": owner_id(),  # this very process: still running
        # another PID namespace (a container sharing the hostname): its pids mean
        # nothing here, so its lease runs to expiry
        "away": f"{here}:{dead.pid}:tok@{me.boot}/4026000000/1",
    }
    for name, owner in owners.items():
        lease = timedelta(minutes=60 if name == "alive" else 5)
        start = pg_ledger.calls.admit(
            f"op-{name}", fingerprint="f", owner=owner, lease=lease, max_runs=3
        )
        key = f"op-{name}#1"
        pg_ledger.calls.reserve("team", key, 10_000, operation_id=start.operation_id)
        pg_ledger.calls.describe_attempt(key, lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini")
        pg_ledger.calls.mark_sending(key, provider="openai")
        openai_chat(
            client, key=pg_ledger.provider_key(key), **PROMPT
        )  # reached the provider; the run died after
    counts = reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))
    assert counts["found"] == 1
    dead_attempt = pg_ledger.attempt("op-dead#1")
    assert (dead_attempt.state, dead_attempt.actual) == (
        "settled",
        fake.billed_for("op-dead#1", pg_ledger),
    )
    assert pg_ledger.operation("op-dead").status == "succeeded"
    assert pg_ledger.attempt("op-alive#1").state == "sending"
    assert pg_ledger.attempt("op-away#1").state == "sending"
    clock.advance(timedelta(minutes=6))  # the other host's lease has expired
    assert reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))["found"] == 1
    assert pg_ledger.attempt("op-away#1").state == "settled"
    assert pg_ledger.attempt("op-alive#1").state == "sending"  # never taken from a live lease
    assert pg_ledger.balance("team").held == 10_000
    assert pg_ledger.audit() == []


def test_live_leases_past_the_limit_never_hide_the_holds_of_dead_runs(
    pg_ledger: Ledger, clock: ManualClock
) -> None:
    """More live runs than one pass reads (12 against a limit of 10), all older than
    the dead ones: the dead runs' holds are adopted all the same, on the first pass.
    Dead by time (their leases expired) and dead by proof (this host and namespace,
    the process gone, its lease still running by time)."""
    pg_ledger.create_budget("team", 1_000_000)
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = this_process()
    assert me is not None
    elsewhere = "other-host:4242:tok@boot-of-another-host/4026000001/1"

    def sending(name: str, owner: str, lease: timedelta) -> str:
        start = pg_ledger.calls.admit(name, fingerprint="f", owner=owner, lease=lease, max_runs=3)
        key = f"{name}#1"
        pg_ledger.calls.reserve("team", key, 100, operation_id=start.operation_id)
        pg_ledger.calls.mark_sending(key, provider="openai")
        return key

    live = [sending(f"live-{n}", elsewhere, timedelta(minutes=60)) for n in range(12)]
    expired = [sending(f"expired-{n}", elsewhere, timedelta(minutes=5)) for n in range(2)]
    proved = sending(
        "proved",
        f"{socket.gethostname()}:{gone.pid}:tok@{me.boot}/{me.pidns}/1",
        timedelta(minutes=60),
    )
    clock.advance(timedelta(minutes=6))
    adopted = pg_ledger.upkeep.mark_orphans_unknown(limit=10)
    assert sorted(adopted) == sorted([*expired, proved])
    assert {pg_ledger.attempt(k).state for k in live} == {"sending"}
    assert pg_ledger.audit() == []


def test_not_found_waits_for_the_timeout_the_attempt_was_sent_with(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    """The call went out with a 120 s client timeout; beat's own client has 1 s. Ten
    seconds after the send the provider may still be working on it: "not found" means
    "not yet", whatever beat's client would wait."""
    beat_client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    openai_chat(
        beat_client, key=pg_ledger.provider_key("stored"), **PROMPT
    )  # the provider stores completions
    pg_ledger.create_budget("team", 1_000_000)
    pg_ledger.calls.reserve("team", "slow-call", 10_000)
    pg_ledger.calls.describe_attempt(
        "slow-call", lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini", timeout=120
    )
    pg_ledger.calls.mark_sending("slow-call")
    pg_ledger.calls.mark_unknown("slow-call", "worker lost")
    assert pg_ledger.attempt("slow-call").timeout_ms == 120_000
    clock.advance(seconds=10)
    counts = reconcile_unknown(pg_ledger, lambda kind: beat_client, margin=timedelta(0))
    assert (counts["pending"], counts["not_found"]) == (1, 0)
    assert pg_ledger.attempt("slow-call").state == "unknown"
    clock.advance(minutes=10)  # past 120 s and past the lookup's backoff
    counts = reconcile_unknown(pg_ledger, lambda kind: beat_client, margin=timedelta(0))
    assert counts["not_found"] == 1
    assert pg_ledger.attempt("slow-call").state == "released"


def test_one_refused_resolution_does_not_stop_the_batch(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)
    for key in ("first", "second"):
        unknown_attempt(pg_ledger, key)
        openai_chat(client, key=pg_ledger.provider_key(key), **PROMPT)  # both reached the provider

    class MeddledUpkeep:
        """Beat's face of the ledger, where an operator settled 'first' a moment
        before beat did."""

        def __getattr__(self, name: str) -> Any:
            return getattr(pg_ledger.upkeep, name)

        def resolve_attempt(self, key: str, actual: int, **kwargs: Any) -> Any:
            if key == "first":
                pg_ledger.resolve_attempt(key, actual + 1, note="invoice", by="operator")
            return pg_ledger.upkeep.resolve_attempt(key, actual, **kwargs)

    class Meddled:
        upkeep = MeddledUpkeep()

        def __getattr__(self, name: str) -> Any:
            return getattr(pg_ledger, name)

    counts = reconcile_unknown(Meddled(), lambda kind: client, margin=timedelta(0))  # type: ignore[arg-type]
    assert (counts["failed"], counts["found"]) == (1, 1)
    assert (
        pg_ledger.attempt("first").actual == fake.billed_for("first", pg_ledger) + 1
    )  # theirs stands
    assert pg_ledger.attempt("second").actual == fake.billed_for("second", pg_ledger)
    assert pg_ledger.audit() == []


def test_settlements_by_reconciliation_feed_the_overrun_and_ratio_metrics(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)
    pg_ledger.calls.reserve("team", "low", 1)  # an estimate far below the bill
    pg_ledger.calls.describe_attempt("low", lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini")
    pg_ledger.calls.mark_sending("low")
    openai_chat(client, key=pg_ledger.provider_key("low"), **PROMPT)
    pg_ledger.calls.mark_unknown("low", "worker lost")

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"budget": "team"}) or 0.0

    overruns = sample("budget_tasks_overruns_total")
    ratios = sample("budget_tasks_actual_to_estimate_ratio_count")
    assert reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))["found"] == 1
    assert pg_ledger.attempt("low").actual == fake.billed_for("low", pg_ledger) > 1
    assert sample("budget_tasks_overruns_total") == overruns + 1
    assert sample("budget_tasks_actual_to_estimate_ratio_count") == ratios + 1


def test_a_reconciler_whose_claim_another_outlived_tells_nothing_it_did_not_write(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    """Two beats: one claims an attempt, and its run is slow (a lookup before it, a
    slow provider); past the claim's back-off the other beat claims it too, finds it
    and settles it. The first then finds the call as well: its settlement changes
    nothing, and it must not count, log or tell (metrics) a second settlement."""
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)
    pg_ledger.calls.reserve("team", "slow", 10_000)
    pg_ledger.calls.describe_attempt("slow", lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini")
    pg_ledger.calls.mark_sending("slow")
    openai_chat(client, key=pg_ledger.provider_key("slow"), **PROMPT)
    pg_ledger.calls.mark_unknown("slow", "worker lost")
    ratios = (
        REGISTRY.get_sample_value("budget_tasks_actual_to_estimate_ratio_count", {"budget": "team"})
        or 0.0
    )
    other: list[dict[str, int]] = []

    def slow_clients(kind: str) -> Any:
        if not other:  # the first run's lookup: meanwhile the other beat runs through
            clock.advance(minutes=2)
            other.append(reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0)))
        return client

    first = reconcile_unknown(pg_ledger, slow_clients, margin=timedelta(0))
    assert other[0]["found"] == 1
    assert (first["found"], first["failed"]) == (0, 1)
    settled = pg_ledger.attempt("slow")
    assert (settled.state, settled.actual) == ("settled", fake.billed_for("slow", pg_ledger))
    with pg_ledger.engine.connect() as conn:
        charges = conn.execute(text("SELECT count(*) FROM journal WHERE kind = 'charge'")).scalar()
    assert charges == 1
    assert (
        REGISTRY.get_sample_value("budget_tasks_actual_to_estimate_ratio_count", {"budget": "team"})
        == ratios + 1
    )
    assert pg_ledger.audit() == []


def test_a_run_that_outlives_its_lease_while_beat_finds_its_call_returns_what_was_stored(
    pg_ledger: Ledger, fake: FakeProvider, clock: ManualClock
) -> None:
    """A worker stalls with its main call out past its lease; beat adopts the call,
    finds it at the provider, settles it at the bill and, as no live run holds the
    operation, the operation adopts the provider's answer as its result. Then the
    stalled run wakes with the answer and returns its own result. Its settlement lands
    once (no second charge), its result does not replace the stored one, and it
    returns the stored answer: every delivery of the key returns the same value (the
    adopted answer, not the run's own shape; see docs/failures.md)."""
    from budget_tasks.delivery.flow import Delivery, OperationManager
    from budget_tasks.delivery.options import DeliveryOptions

    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    pg_ledger.create_budget("team", 1_000_000)
    manager = OperationManager(pg_ledger.calls, DeliveryOptions(task="t", lease_seconds=60))

    def stalled(scope: Any) -> Any:
        sent = openai_chat(client, attempt=scope, **PROMPT)
        clock.advance(timedelta(minutes=10))  # the lease expired while the call was out
        counts = reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))
        assert counts["found"] == 1
        assert pg_ledger.operation("stall").status == "succeeded"  # adopted meanwhile
        return sent.result["content"].upper()  # the run's own result

    def run_again(scope: Any) -> Any:
        raise AssertionError("a finished operation is replayed, not run")

    deliver = {"key": "stall", "fingerprint": "f", "budget": "team"}
    estimate = estimates.openai_chat(PROMPT).amount
    returned = manager.deliver(Delivery(**deliver, estimate=lambda: estimate, run=stalled))
    stored = pg_ledger.operation("stall").result
    assert isinstance(stored, dict) and returned == stored  # the stored answer, not .upper()
    assert stored["content"] == stored["content"].lower()
    assert manager.deliver(Delivery(**deliver, estimate=lambda: estimate, run=run_again)) == stored
    attempt = pg_ledger.attempt("stall#1")
    assert (attempt.state, attempt.actual) == ("settled", fake.billed_for("stall#1", pg_ledger))
    assert len([s for s in fake.served() if s.method == "POST"]) == 1
    assert pg_ledger.balance("team").spent == attempt.actual  # charged once
    assert pg_ledger.audit() == []
