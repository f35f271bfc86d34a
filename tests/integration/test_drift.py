"""Drift: the ledger against the vendors' own usage and cost reports, served by the
fake provider from its record of what it served and billed (traffic that did not go
through the ledger included), read with the official SDKs over HTTP with an admin
key."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest
from celery import Celery
from prometheus_client import REGISTRY

import budget_tasks.metrics  # noqa: F401  (installs the Prometheus sink)
from budget_tasks import BudgetTask, Ledger, signals
from budget_tasks.beat import check_provider_drift
from budget_tasks.drift import UNLISTED, DriftReport, Threshold, check_drift, model_family
from budget_tasks.errors import DriftOff
from budget_tasks.pricing.prices import Pricing
from budget_tasks.pricing.table import parse_prices
from budget_tasks.providers import registry
from budget_tasks.providers.base import Vendor, sdk_client
from budget_tasks.testing import FakeProvider, ManualClock
from budget_tasks.transport import guarded_anthropic_client, guarded_openai_client

from ..conftest import empty_ledger_tables
from ..support.drift_world import World
from ..workers import Worker

#: Any difference at all is drift: the fake bills exactly what the ledger charges.
EXACT = Threshold(relative=0.0, tokens=0, money=0)
OPENAI_ADMIN = "sk-admin-drift-0123456789abcdef"
ANTHROPIC_ADMIN = "sk-ant-admin01-drift-0123456789abcdef"
KEY_A = "sk-proj-alpha-0123456789abcdefABCD"
KEY_B = "sk-proj-bravo-9876543210fedcbaWXYZ"
ASK = [{"role": "user", "content": "How far did the ledger drift?"}]
#: ``python -m budget_tasks.cli`` with its ledger on a clock set by hand (``argv[1]``,
#: an ISO time), for a run as if made later than now.
CLI_AT = """
import sys
from datetime import datetime

from budget_tasks import Ledger
from budget_tasks.cli import _common, run
from budget_tasks.testing import ManualClock

clock = ManualClock(datetime.fromisoformat(sys.argv.pop(1)))


def open_ledger(url):
    _common.refuse_missing_sqlite(url)
    return Ledger(url, clock=clock)


_common.open_ledger = open_ledger
run()
"""


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A provider of this test's own: its reports hold this test's traffic alone."""
    with FakeProvider() as server:
        yield server


@pytest.fixture
def app(backend_url: str) -> Iterator[Celery]:
    app = Celery(f"drift-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    Ledger(backend_url).create_budget("team", 100_000_000)
    yield app
    app.close()


def admin(vendor: str, fake: FakeProvider) -> Any:
    """The SDK client that reads ``vendor``'s reports at the fake, with an admin key."""
    if vendor == "openai":
        return sdk_client(
            registry.vendor("openai"),
            base_url=fake.openai_base_url,
            api_key=OPENAI_ADMIN,
            timeout=10.0,
        )
    return sdk_client(
        registry.vendor("anthropic"), base_url=fake.url, api_key=ANTHROPIC_ADMIN, timeout=10.0
    )


def run(app: Celery, body: Callable[[BudgetTask], Any]) -> Any:
    """``body`` as a BudgetTask run once (its calls reserve their own bounds)."""
    key = f"drift:{uuid.uuid4().hex[:8]}"
    task = app.task(
        base=BudgetTask,
        bind=True,
        name=f"drift-{uuid.uuid4().hex[:6]}",
        budget="team",
        idempotency_key=lambda *a, **k: key,
        estimate_cost=lambda *a, **k: 0,
    )(body)
    return task.delay().get()


def check(
    backend_url: str,
    vendor: str,
    fake: FakeProvider,
    *,
    by: str | None = "model",
    settle: timedelta = timedelta(seconds=60),
    later: timedelta = timedelta(minutes=2),
    threshold: Threshold = EXACT,
    bucket: str = "1m",
    since: timedelta = timedelta(minutes=30),
) -> DriftReport:
    """A drift check of the last ``since``, made as if ``later`` from now (its windows
    final by then, unless the report lags past ``settle``)."""
    ledger = Ledger(backend_url)
    try:
        real = datetime.now(UTC)
        return check_drift(
            ledger,
            registry.vendor(vendor),
            since=real - since,
            by=by,
            bucket=bucket,
            settle=settle,
            threshold=threshold,
            admin=admin(vendor, fake),
            now=real + later,
        )
    finally:
        ledger.dispose()


def minutes_on(minutes: int = 2) -> ManualClock:
    """A clock ``minutes`` past the real one (moved by hand): the minute a call was just
    sent in has ended by it, and its window is final (``settle`` 0)."""
    clock = ManualClock(datetime.now(UTC))
    clock.advance(minutes=minutes)
    return clock


def measured(report: DriftReport, measure: str, group: str | None = None) -> tuple[int, int]:
    """The ledger's and the provider's sum of ``measure`` (in ``group``), over its
    windows (not their totals)."""
    lines = [
        line
        for line in report.lines
        if line.measure == measure and not line.total and (group is None or line.group == group)
    ]
    return sum(line.ledger for line in lines), sum(line.provider for line in lines)


def bypass(fake: FakeProvider, key: str = "sk-bypass-0000111122223333") -> Any:
    """A call straight to the provider, past the ledger (a plain SDK client)."""
    plain = openai.OpenAI(base_url=fake.openai_base_url, api_key=key, max_retries=0)
    try:
        return plain.chat.completions.create(
            model="gpt-4o-mini", max_completion_tokens=40, messages=ASK
        )
    finally:
        plain.close()


def past_the_ledger(fake: FakeProvider) -> int:
    """What the fake billed for requests that carried no Idempotency-Key: the guarded
    transport sends one with every call, so these went past the ledger."""
    return sum(s.billed for s in fake.served() if s.method == "POST" and not s.idempotency_key)


def test_a_clean_run_has_no_drift_and_traffic_past_the_ledger_is_the_drift(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0)
    claude = guarded_anthropic_client(base_url=fake.url, api_key=KEY_A, timeout=10.0)

    def calls(self: BudgetTask) -> int:
        for n in range(3):
            oai.chat.completions.create(
                model="gpt-4o-mini", max_completion_tokens=20 + n, messages=ASK
            )
        streamed = oai.chat.completions.create(
            model="gpt-4.1-nano", max_completion_tokens=16, stream=True, messages=ASK
        )
        for _ in streamed:
            pass
        claude.messages.create(model="claude-haiku-4-5", max_tokens=30, messages=ASK)
        return 5

    assert run(app, calls) == 5
    for vendor in ("openai", "anthropic"):
        report = check(backend_url, vendor, fake)
        assert report.lines and report.drifted == [], report.lines
        # a call sent as a minute ended may be counted by the provider in the next
        assert {line.status for line in report.lines} <= {"ok", "pending", "shifted"}
        for measure in ("input_tokens", "output_tokens"):
            ledger, provider = measured(report, measure)
            assert ledger == provider > 0, (vendor, measure)
    report = check(backend_url, "openai", fake)
    assert {line.group for line in report.lines} == {"gpt-4o-mini", "gpt-4.1-nano"}
    # money is compared by day: today's is not final, but its figures agree already
    ledger_cost, provider_cost = measured(report, "cost")
    billed = sum(s.billed for s in fake.served() if s.method == "POST" and "/v1/chat" in s.path)
    assert ledger_cost == provider_cost == billed > 0

    answer = bypass(fake)
    usage = answer.usage
    report = check(backend_url, "openai", fake)
    drifted = report.drifted
    assert drifted and {line.group for line in drifted} == {"gpt-4o-mini"}
    difference = {
        m: sum(d.difference for d in drifted if d.measure == m and not d.total)
        for m in ("input_tokens", "output_tokens")
    }
    assert difference == {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
    }
    cost = [line for line in report.lines if line.measure == "cost" and not line.total]
    assert sum(line.difference for line in cost) == past_the_ledger(fake) > 0
    # anthropic saw no traffic past the ledger
    assert check(backend_url, "anthropic", fake).drifted == []


def test_a_stale_price_table_drifts_in_money_for_its_model_alone(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """The ledger priced gpt-4o-mini at twice its list price: the tokens agree, and the
    money drifts for that model only, by exactly what the stale table added."""
    stale = Pricing(
        parse_prices(
            {
                "version": "stale-2024",
                "models": {"gpt-4o-mini": {"input": 300_000, "output": 1_200_000}},
            }
        )
    )
    oai = guarded_openai_client(
        base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0, prices=stale
    )

    def calls(self: BudgetTask) -> None:
        for model in ("gpt-4o-mini", "gpt-4.1-nano", "gpt-4o-mini"):
            # the standard tier asked for: the stale table has no other tier's prices
            oai.chat.completions.create(
                model=model, max_completion_tokens=24, messages=ASK, service_tier="default"
            )

    run(app, calls)
    report = check(backend_url, "openai", fake, later=timedelta(days=2))
    drifted = report.drifted
    assert {(line.group, line.measure) for line in drifted} == {("gpt-4o-mini", "cost")}
    [line] = drifted
    billed = sum(s.billed for s in fake.served() if s.method == "POST" and s.model == "gpt-4o-mini")
    assert line.provider == billed > 0
    assert line.ledger == 2 * billed  # every rate doubled: the charge doubled
    for measure in ("input_tokens", "output_tokens"):
        for model in ("gpt-4o-mini", "gpt-4.1-nano"):
            ledger, provider = measured(report, measure, model)
            assert ledger == provider > 0


def test_an_unknown_hold_is_shown_apart_and_accounts_for_what_it_was_billed(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """A call that timed out after the provider billed it: its hold stays unknown, and
    the report's buckets hold what it was billed. That difference is the open
    attempt's (reconciliation settles it), not drift; once reconciled, none is left."""
    from budget_tasks.beat import reconcile_unknown

    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=0.5)
    fake.plan("hang=2", path="/chat/completions")

    def calls(self: BudgetTask) -> None:
        oai.chat.completions.create(model="gpt-4o-mini", max_completion_tokens=24, messages=ASK)

    with pytest.raises(openai.APITimeoutError):  # its outcome is unknown: the task fails
        run(app, calls)
    ledger = Ledger(backend_url)
    [attempt] = [a for a in ledger.attempts() if a.state == "unknown"]
    report = check(backend_url, "openai", fake, later=timedelta(days=2))
    assert report.drifted == []
    opened = [line for line in report.lines if line.status == "open"]
    assert {line.measure for line in opened} == {"input_tokens", "output_tokens", "cost"}
    [cost] = [line for line in opened if line.measure == "cost"]
    assert cost.open == 1 and cost.ledger == 0
    assert 0 < cost.provider == fake.served()[0].billed <= cost.open_bound == attempt.amount
    time.sleep(2)  # the answer the fake held back has gone out (and been stored)

    def client(kind: str) -> Any:
        return sdk_client(
            registry.vendor(kind), base_url=fake.openai_base_url, api_key=KEY_A, timeout=5.0
        )

    assert reconcile_unknown(ledger, client)["found"] == 1
    ledger.dispose()
    report = check(backend_url, "openai", fake, later=timedelta(days=2))
    assert report.lines and {line.status for line in report.lines} == {"ok"}


def test_a_window_the_report_has_not_caught_up_with_is_pending_not_drift(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    fake.report_delay = 600.0  # the report shows nothing younger than 10 minutes
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0)

    def calls(self: BudgetTask) -> None:
        oai.chat.completions.create(model="gpt-4o-mini", max_completion_tokens=24, messages=ASK)

    run(app, calls)
    # settled past the report's own delay: the window is pending, not drift
    waiting = check(backend_url, "openai", fake, settle=timedelta(minutes=15))
    assert waiting.drifted == [] and waiting.lines
    assert {line.status for line in waiting.lines} == {"pending"}
    assert measured(waiting, "input_tokens")[1] == 0  # the report has none of it yet
    # a settle shorter than the report's delay takes its lag for drift: why it exists
    hasty = check(backend_url, "openai", fake, settle=timedelta(seconds=1))
    assert {line.measure for line in hasty.drifted} == {"input_tokens", "output_tokens"}
    fake.report_delay = 0.0
    caught_up = check(backend_url, "openai", fake, settle=timedelta(seconds=1))
    assert caught_up.drifted == []


def test_every_page_of_the_reports_is_read_once(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """The sums agree only if every page was read, and none twice."""
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0)

    def calls(self: BudgetTask) -> None:
        oai.chat.completions.create(model="gpt-4o-mini", max_completion_tokens=24, messages=ASK)

    run(app, calls)
    answer = bypass(fake)
    # 30 hours of minutes: 1,800 buckets, the most a page holds is 1,440
    report = check(backend_url, "openai", fake, since=timedelta(hours=30), by=None)
    pages = [s for s in fake.served() if s.path.startswith("/v1/organization/usage/completions")]
    assert len(pages) == 2
    ledger, provider = measured(report, "input_tokens")
    assert ledger > 0 and provider - ledger == answer.usage.prompt_tokens
    ledger, provider = measured(report, "output_tokens")
    assert ledger > 0 and provider - ledger == answer.usage.completion_tokens
    assert {line.group for line in report.lines} == {"all"}


def test_drift_by_api_key_and_by_project_names_the_key_that_went_past_the_ledger(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    key_a = fake.add_key(KEY_A, project="proj_alpha")
    key_b = fake.add_key(KEY_B, project="proj_bravo")
    first = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0)
    second = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_B, timeout=10.0)

    def calls(self: BudgetTask) -> None:
        for client in (first, second, first):
            client.chat.completions.create(
                model="gpt-4o-mini", max_completion_tokens=24, messages=ASK
            )

    run(app, calls)
    clean = check(backend_url, "openai", fake, by="api_key", later=timedelta(days=2))
    assert clean.drifted == []
    assert {line.group for line in clean.lines} == {key_a, key_b}
    # OpenAI's cost report is grouped by key too (Anthropic's is not)
    assert {line.measure for line in clean.lines} == {"input_tokens", "output_tokens", "cost"}

    bypass(fake, KEY_B)
    by_key = check(backend_url, "openai", fake, by="api_key", later=timedelta(days=2))
    assert {line.group for line in by_key.drifted} == {key_b}
    [cost] = [line for line in by_key.drifted if line.measure == "cost"]
    assert cost.difference == past_the_ledger(fake) > 0
    claude = check(backend_url, "anthropic", fake, by="api_key")
    assert any("cannot be grouped by api_key" in note for note in claude.notes)
    by_project = check(backend_url, "openai", fake, by="project", later=timedelta(days=2))
    assert {line.group for line in by_project.drifted} == {"proj_bravo"}
    assert {line.measure for line in by_project.drifted} == {
        "input_tokens",
        "output_tokens",
        "cost",
    }
    [cost] = [line for line in by_project.drifted if line.measure == "cost"]
    assert cost.difference == past_the_ledger(fake) > 0


def test_without_an_admin_key_drift_is_off_and_said_once(
    fake: FakeProvider, pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.delenv("OPENAI_ADMIN_KEY", raising=False)
    vendor = registry.vendor("openai")
    assert vendor.admin_client(5.0) is None
    ledger = Ledger(pg_url)
    try:
        with pytest.raises(DriftOff, match="OPENAI_ADMIN_KEY"):
            check_drift(ledger, vendor, since=ledger.views.now() - timedelta(hours=1))
        name = f"drift-off-{uuid.uuid4().hex[:6]}"
        lonely = _renamed(vendor, name)
        with caplog.at_level(logging.WARNING, "budget_tasks"):
            for _ in range(3):
                counts = check_provider_drift(
                    ledger, [lonely], lambda v: v.admin_client(5.0), since=timedelta(hours=1)
                )
                assert counts["off"] == 1 and counts["checked"] == 0
        said = [r for r in caplog.records if f"drift is off for {name}" in r.getMessage()]
        assert len(said) == 1
    finally:
        ledger.dispose()


def _renamed(vendor: Vendor, name: str) -> Vendor:
    """``vendor`` under another name (a process says each name's drift is off once)."""
    import copy

    other = copy.copy(vendor)
    other.name = name
    return other


@pytest.mark.parametrize("backend_url", ["postgres"], indirect=True)
def test_the_beat_job_exports_the_drift_and_signals_it(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key=KEY_A, timeout=10.0)

    def calls(self: BudgetTask) -> None:
        oai.chat.completions.create(model="gpt-4o-mini", max_completion_tokens=24, messages=ASK)

    run(app, calls)
    answer = bypass(fake)
    heard: list[dict[str, Any]] = []

    def receiver(sender: Any, **facts: Any) -> None:
        heard.append({"sender": sender, **facts})

    signals.drift.connect(receiver)
    # the job's windows end at the ledger's now: on this clock, after the minute the
    # calls were sent in
    ledger = Ledger(backend_url, clock=minutes_on())
    vendor = registry.vendor("openai")
    try:
        counts = check_provider_drift(
            ledger,
            [vendor],
            lambda v: admin("openai", fake),
            since=timedelta(minutes=30),
            by="model",
            bucket="1m",
            settle=timedelta(seconds=0),
            threshold=EXACT,
        )
    finally:
        signals.drift.disconnect(receiver)
        ledger.dispose()
    assert counts == {"checked": 1, "drifted": counts["drifted"], "off": 0, "failed": 0}
    assert counts["drifted"] >= 2  # input and output tokens of gpt-4o-mini
    [told] = heard
    assert told["sender"] == "openai"
    assert {line.measure for line in told["lines"]} == {"input_tokens", "output_tokens"}
    gauge = REGISTRY.get_sample_value(
        "budget_tasks_provider_drift",
        {"provider": "openai", "by": "model", "group": "gpt-4o-mini", "measure": "input_tokens"},
    )
    assert gauge == answer.usage.prompt_tokens > 0


def test_model_family_strips_the_snapshot_only() -> None:
    assert model_family("gpt-4o-mini-2024-07-18") == "gpt-4o-mini"
    assert model_family("claude-haiku-4-5-20251001") == "claude-haiku-4-5"
    assert model_family("gpt-3.5-turbo-instruct-0914") == "gpt-3.5-turbo-instruct"
    assert model_family("gpt-4.1-nano") == "gpt-4.1-nano"
    assert model_family("claude-haiku-4-5") == "claude-haiku-4-5"
    assert model_family(None) == "(no model)"


TEXT = "The ledger is what we believe we spent; the provider's bill is the truth."


def test_a_real_worker_keeps_what_its_answers_used_and_the_cli_names_the_key_past_it(
    start_worker: Callable[..., Worker], client: Celery, fake: FakeProvider, pg_url: str
) -> None:
    """The reference app in a real ``celery worker``: each attempt it settles keeps its
    answer's tokens and its key's hint; `budget-tasks drift` reads the reports with the
    admin key from the environment and exits 1 on the key that went past the ledger;
    the beat job runs in the worker with the admin key from its environment."""
    from budget_tasks.providers.reports import hint_of

    key_a = fake.add_key(KEY_A, project="proj_alpha")
    key_b = fake.add_key(KEY_B, project="proj_bravo")
    start_worker(OPENAI_API_KEY=KEY_A, OPENAI_ADMIN_KEY=OPENAI_ADMIN)
    for n in range(3):
        done = client.send_task("workers.summarize", args=[f"drift-{n}", TEXT]).get(timeout=60)
        assert done["summary"]
    ledger = Ledger(pg_url)
    try:
        served = {s.idempotency_key: s for s in fake.served() if s.method == "POST"}
        settled = [a for a in ledger.attempts() if a.state == "settled" and a.actual]
        assert len(settled) == len(served) == 3
        for attempt in settled:
            sent = served[ledger.provider_key(attempt.key)]
            usage = sent.usage or {}
            assert attempt.input_tokens == usage["input_tokens"] + usage.get(
                "cached_input_tokens", 0
            )
            assert attempt.output_tokens == usage["output_tokens"] > 0
            assert (attempt.provider, attempt.credential) == ("openai", hint_of(KEY_A))
            assert attempt.actual == sent.billed
    finally:
        ledger.dispose()
    answer = bypass(fake, KEY_B)
    env = {
        **os.environ,
        "BUDGET_TASKS_LEDGER_URL": pg_url,
        "OPENAI_BASE_URL": fake.openai_base_url,
        "OPENAI_ADMIN_KEY": OPENAI_ADMIN,
    }
    args = ["drift", "--provider", "openai"]
    command = [sys.executable, "-m", "budget_tasks.cli", *args]
    # as if run later: the minute they were sent in has ended by the CLI ledger's clock
    later = [sys.executable, "-c", CLI_AT, minutes_on()().isoformat(), *args]
    options = ["--since", "1h", "--bucket", "1m", "--settle", "0s", "--by", "api_key"]
    exact = ["--relative", "0", "--min-tokens", "0", "--min-cost", "0"]
    done = subprocess.run(
        [*later, *options, *exact, "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    final = [line for line in report["lines"] if line["status"] != "pending" and not line["total"]]
    assert {line["group"] for line in final} == {key_a, key_b}
    for line in final:
        if line["group"] == key_a:  # the worker's traffic: the report agrees
            assert line["status"] == "ok" and line["ledger"] == line["provider"] > 0
        else:
            assert line["status"] == "drift" and line["ledger"] == 0
    tokens = {line["measure"]: line["difference"] for line in final if line["group"] == key_b}
    assert tokens == {
        "input_tokens": answer.usage.prompt_tokens,
        "output_tokens": answer.usage.completion_tokens,
    }
    table = subprocess.run(
        [*later, *options, *exact], env=env, capture_output=True, text=True, timeout=60
    )
    assert table.returncode == 1 and key_b in table.stdout and "drift" in table.stdout
    # without the admin key: one clear line, exit 2
    off = subprocess.run(
        [*command, *options],
        env={k: v for k, v in env.items() if k != "OPENAI_ADMIN_KEY"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert off.returncode == 2 and "drift is off for openai" in off.stderr
    # a provider that cannot be reached is an error (exit 2), never read as drift (1)
    unreachable = subprocess.run(
        [*command, *options],
        env={**env, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode == 2
    assert unreachable.stderr.strip().splitlines() == [
        "error: openai's reports could not be read: APIConnectionError: Connection error."
    ]
    counts = client.send_task("budget_tasks.check_drift").get(timeout=60)
    assert counts == {"checked": 1, "drifted": 0, "off": 1, "failed": 0}  # anthropic: no key


# -- the world changing under the check (issue 54) --------------------------------------

OLD = "sk-proj-rotated-old-0123456789abcOLD1"
NEW = "sk-proj-rotated-new-0123456789abcNEW2"
AWAY = "sk-proj-owner-away-0123456789abcAWY3"
CLAUDE_OLD = "sk-ant-api03-rotated-old-0123456789abcdefOLD4"
CLAUDE_NEW = "sk-ant-api03-rotated-new-0123456789abcdefNEW5"


@pytest.fixture
def world(fake: FakeProvider, pg_url: str) -> Iterator[World]:
    """The ledger (PostgreSQL) and this test's fake on one clock moved by hand, from
    twenty minutes ago: every window it sends in has ended by the real clock too."""
    empty_ledger_tables(pg_url)
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=20)
    made = World(pg_url, fake, start)
    yield made
    made.close()


def by_group(report: DriftReport, measure: str) -> dict[str, tuple[int, int]]:
    """Each group's ledger and provider figures of ``measure``, over its windows."""
    groups = {line.group for line in report.lines if line.measure == measure}
    return {group: measured(report, measure, group) for group in groups}


def test_a_key_rotated_and_deleted_moves_nothing_and_every_key_of_a_project_is_read(
    world: World,
) -> None:
    """Only metered traffic: an old key, a key whose owner has left its project (the
    project's list leaves it out unless asked), then the old key rotated (a new one
    made, the old one deleted through the admin API). By key and by project nothing
    drifts: the deleted key's traffic is the unlisted keys' on both sides, and the
    other keys' figures agree under their own ids."""
    old = world.fake.add_key(OLD, project="proj_alpha")
    away = world.fake.add_key(AWAY, project="proj_bravo", owner_access="inactive")
    since = world.clock()
    for key in (OLD, OLD, AWAY):
        assert world.metered("openai", key) == "settled"
    world.advance()
    new = world.fake.add_key(NEW, project="proj_alpha")
    for key in (NEW, NEW, AWAY):
        assert world.metered("openai", key) == "settled"
    world.retire("openai", old, "proj_alpha")

    by_key = world.check("openai", since=since, by="api_key", threshold=EXACT)
    assert by_key.drifted == [], by_key.lines
    for measure in ("input_tokens", "output_tokens", "cost"):
        figures = by_group(by_key, measure)
        assert set(figures) == {UNLISTED, new, away}
        assert all(ledger == provider > 0 for ledger, provider in figures.values()), figures
    by_project = world.check("openai", since=since, by="project", threshold=EXACT)
    assert by_project.drifted == [], by_project.lines
    figures = by_group(by_project, "input_tokens")
    assert set(figures) == {UNLISTED, "proj_alpha", "proj_bravo"}
    assert all(ledger == provider > 0 for ledger, provider in figures.values()), figures


def test_traffic_past_the_ledger_with_a_key_deleted_since_drifts_among_the_unlisted_keys(
    world: World,
) -> None:
    """A key that also sent past the ledger, then rotated and deleted: the leak is the
    unlisted keys' drift, exactly what went past; the new key's traffic agrees."""
    old = world.fake.add_key(OLD, project="proj_alpha")
    since = world.clock()
    world.metered("openai", OLD)
    world.bypass("openai", OLD, input_tokens=1_500, output_tokens=40)
    world.advance()
    world.fake.add_key(NEW, project="proj_alpha")
    world.metered("openai", NEW)
    world.retire("openai", old, "proj_alpha")
    leaked = past_the_ledger(world.fake)
    for by in ("api_key", "project"):
        report = world.check("openai", since=since, by=by, threshold=EXACT)
        drifted = [line for line in report.drifted if not line.total]
        assert {line.group for line in report.drifted} == {UNLISTED}, report.lines
        difference = {line.measure: line.difference for line in drifted}
        assert difference == {"input_tokens": 1_500, "output_tokens": 40, "cost": leaked}


def test_an_archived_anthropic_key_keeps_its_traffic_under_its_own_id(world: World) -> None:
    """Anthropic archives a key (its API deletes none); its list leaves archived keys
    out unless asked for them. The check reads every status: the old key's traffic
    stays its own."""
    old = world.fake.add_key(CLAUDE_OLD, project="wrkspc_a", vendor="anthropic")
    since = world.clock()
    world.metered("anthropic", CLAUDE_OLD)
    world.advance()
    new = world.fake.add_key(CLAUDE_NEW, project="wrkspc_a", vendor="anthropic")
    world.metered("anthropic", CLAUDE_NEW)
    world.retire("anthropic", old, "wrkspc_a")
    report = world.check("anthropic", since=since, by="api_key", threshold=EXACT)
    assert report.drifted == [], report.lines
    figures = by_group(report, "input_tokens")
    assert set(figures) == {old, new}
    assert all(ledger == provider > 0 for ledger, provider in figures.values()), figures


def test_a_slow_leak_drifts_in_the_total_beside_a_call_an_operator_resolved(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """882 tokens past the ledger in each of two minutes (each under the 1,000-token
    threshold), and in a third a call whose outcome was unknown, settled by an
    operator with no tokens recorded. The resolved call can account for no more than
    its request allowed: the total still drifts, and `budget-tasks drift` exits 1."""
    from click.testing import CliRunner

    from budget_tasks.cli import main

    since = world.clock()
    for _ in range(2):
        world.metered("openai", KEY_A)
        world.bypass("openai", KEY_A, input_tokens=882)
        world.advance()
    # it allowed 16,000 output tokens: they account for nothing of the input's leak
    assert world.metered("openai", KEY_A, max_tokens=16_000, fault="reset") == "unknown"
    assert world.resolve_unknown() == 1
    [resolved] = [a for a in world.ledger.attempts() if a.input_tokens is None]
    assert resolved.state == "settled" and resolved.input_bound is not None

    report = world.check("openai", since=since)
    inputs = sorted(
        (line for line in report.lines if line.measure == "input_tokens" and not line.total),
        key=lambda line: line.start,
    )
    # each minute alone is within the thresholds
    assert [line.status for line in inputs] == ["ok", "ok", "ok"]
    assert [line.untold for line in inputs] == [0, 0, 1]
    assert inputs[2].untold_bound == resolved.input_bound
    [drifted] = report.drifted
    assert (drifted.measure, drifted.total, drifted.untold) == ("input_tokens", True, 1)
    # what the provider counts beyond the ledger: the leak and the resolved call's own
    assert drifted.difference == 2 * 882 + inputs[2].provider

    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", world.ledger.url)
    monkeypatch.setenv("OPENAI_BASE_URL", world.fake.openai_base_url)
    monkeypatch.setenv("OPENAI_ADMIN_KEY", OPENAI_ADMIN)
    args = ["drift", "--provider", "openai", "--since", "1h", "--bucket", "1m", "--settle", "0s"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 1, done.output
    assert "total" in done.output and "drift" in done.output


def test_an_open_calls_output_bound_does_not_excuse_an_input_leak(world: World) -> None:
    """A call whose outcome is unknown allowed 16,000 output tokens and a few dozen
    input ones; 4,007 input tokens went past the ledger in its minute. The open call
    accounts for its own input bound in the input line, and no more: it drifts."""
    since = world.clock()
    assert world.metered("openai", KEY_A, max_tokens=16_000, fault="reset") == "unknown"
    [attempt] = world.ledger.attempts()
    assert attempt.input_bound is not None and attempt.output_bound == 16_000
    assert attempt.input_bound < 1_000
    world.bypass("openai", KEY_A, input_tokens=4_007)
    report = world.check("openai", since=since)
    lines = {line.measure: line for line in report.lines if not line.total}
    assert (lines["input_tokens"].status, lines["input_tokens"].open) == ("drift", 1)
    assert lines["input_tokens"].open_bound == attempt.input_bound
    assert lines["input_tokens"].difference > 4_007  # the leak, and the open call's own
    assert lines["output_tokens"].open_bound == 16_000
    assert lines["output_tokens"].status == "ok"  # its few dozen tokens: within the thresholds
    assert report.drifted == [lines["input_tokens"]]
