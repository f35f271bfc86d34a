"""budget_tasks.configure(app): what it wires, what it leaves to the app; and the
public namespace of the package."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

import budget_tasks
from budget_tasks import BudgetTask, Ledger, configure, rate_limits
from budget_tasks.providers import OpenAI, registry
from budget_tasks.wiring import (
    BEAT_SCHEDULE,
    _set_at_start,
    set_rate_limits,
    startup_problems,
    unknown_providers,
)


def test_the_schedule_is_merged_and_the_apps_own_entries_win() -> None:
    app = Celery("wired", set_as_current=False)
    mine = {"task": "jobs.nightly", "schedule": 86400.0}
    slower = {"task": "budget_tasks.renew_periods", "schedule": 600.0}
    app.config_from_object(
        SimpleNamespace(beat_schedule={"nightly": mine, "budget-tasks-renew-periods": slower})
    )
    configure(app, ledger_url="sqlite:///x.db")
    schedule = app.conf.beat_schedule
    assert set(schedule) == {"nightly", *BEAT_SCHEDULE}
    assert schedule["nightly"] == mine
    assert schedule["budget-tasks-renew-periods"] == slower
    assert schedule["budget-tasks-reconcile-unknown"]["task"] == "budget_tasks.reconcile_unknown"
    assert app.conf.budget_ledger_url == "sqlite:///x.db"
    app.close()


def test_delivery_settings_are_defaults_the_app_can_override() -> None:
    plain = configure(Celery("plain", set_as_current=False))
    assert (
        plain.conf.task_acks_late,
        plain.conf.task_reject_on_worker_lost,
        plain.conf.worker_prefetch_multiplier,
    ) == (True, True, 1)
    own = Celery("own", set_as_current=False)
    own.config_from_object(SimpleNamespace(worker_prefetch_multiplier=4))
    configure(own)
    assert own.conf.worker_prefetch_multiplier == 4  # the app's own choice stands
    assert own.conf.task_acks_late is True


def test_configure_after_the_config_was_read_still_merges() -> None:
    app = Celery("late", set_as_current=False)
    assert app.conf.beat_schedule == {}  # reading the config finalises it
    configure(app)
    assert set(app.conf.beat_schedule) == set(BEAT_SCHEDULE)


def test_a_visibility_timeout_shorter_than_a_lease_is_a_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = Celery("vt", set_as_current=False, broker="redis://127.0.0.1:6379/0")
    # longer than any lease of the shared tasks other test modules registered in every
    # app of this process (the check names the app's longest lease)
    lease = 1_000_000.0
    app.conf.broker_transport_options = {"visibility_timeout": lease - 1}
    configure(app)

    @app.task(base=BudgetTask, name=f"vt.job.{uuid.uuid4().hex[:6]}", lease_seconds=lease)
    def job() -> int:
        return 1

    problems = startup_problems(app, BudgetTask)
    assert len(problems) == 1
    assert f"visibility timeout ({lease - 1:g} s) is shorter than {job.name}'s" in problems[0]
    # it names the setting the app set (and the variable that would set it)
    assert "raise broker_transport_options['visibility_timeout'] (or env " in problems[0]
    monkeypatch.setenv("BUDGET_TASKS_VISIBILITY_TIMEOUT", f"{lease - 1:g}")
    [from_env] = startup_problems(app, BudgetTask)
    assert "raise env BUDGET_TASKS_VISIBILITY_TIMEOUT above the longest lease" in from_env
    app.conf.broker_transport_options = {"visibility_timeout": lease}
    assert startup_problems(app, BudgetTask) == []  # exactly the lease is enough
    app.close()


def test_the_package_namespace_is_its_public_api() -> None:
    names = dir(budget_tasks)
    assert "Any" not in names and "TYPE_CHECKING" not in names
    assert {"BudgetTask", "configure", "Ledger", "__version__"} <= set(names)
    assert set(budget_tasks.__all__) <= set(names)


def test_every_variable_the_readme_lists_sets_its_setting_in_any_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user's own app (not the reference one) reads the BUDGET_TASKS_* variables, over
    its own settings as the CLI does, so beat, the worker and the CLI agree."""
    from budget_tasks.wiring import ENV_SETTINGS

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = page[page.index("| Environment variable |") :].split("\n\n")[0]
    listed = {
        (m.group(1), m.group(2))
        for m in re.finditer(r"^\| `(BUDGET_TASKS_[A-Z_]+)` \| `(budget_[a-z_]+)` \|", table, re.M)
    }
    assert listed == {(name, setting) for name, (setting, _) in ENV_SETTINGS.items()}
    values = {
        "BUDGET_TASKS_LEDGER_URL": ("sqlite:///env.db", "sqlite:///env.db"),
        "BUDGET_TASKS_STALE_AFTER": ("45", 45.0),
        "BUDGET_TASKS_RECONCILE_MARGIN": ("0", 0.0),
        "BUDGET_TASKS_REQUEUE_NOT_FOUND": ("1", True),
        "BUDGET_TASKS_RETENTION_DAYS": ("2.5", 2.5),
        "BUDGET_TASKS_METRICS_PORT": ("9101", 9101),
        "BUDGET_TASKS_DRIFT_SINCE": ("3600", 3600.0),
        "BUDGET_TASKS_DRIFT_SETTLE": ("600", 600.0),
        "BUDGET_TASKS_DRIFT_BY": ("project", "project"),
        "BUDGET_TASKS_METRICS_ADDR": ("127.0.0.2", "127.0.0.2"),
        "BUDGET_TASKS_RATE_LIMITS": (
            '{"openai": {"*": {"requests": 600}}}',
            {"openai": {"*": {"requests": 600}}},
        ),
        "BUDGET_TASKS_RATE_GATEWAYS": (" litellm, portkey ", ["litellm", "portkey"]),
        "BUDGET_TASKS_VISIBILITY_TIMEOUT": ("7200", None),
        "BUDGET_TASKS_RESTORE_INTERVAL": ("5", None),
    }
    for name, (text, _) in values.items():
        monkeypatch.setenv(name, text)
    app = Celery("users-own", set_as_current=False)
    app.config_from_object(
        SimpleNamespace(
            broker_url="redis://127.0.0.1:6379/0", budget_stale_after=900, budget_retention_days=7
        )
    )
    configure(app)
    for name, (_, expected) in values.items():
        if expected is not None:
            assert app.conf[ENV_SETTINGS[name][0]] == expected, name
    options = app.conf.broker_transport_options
    assert (options["visibility_timeout"], options["unacked_restore_interval"]) == (7200.0, 5.0)
    # an explicit argument still wins over the environment
    given = configure(Celery("given", set_as_current=False), ledger_url="sqlite:///given.db")
    assert given.conf.budget_ledger_url == "sqlite:///given.db"
    # the Redis options stay off another broker (SQLAlchemy's would refuse them)
    assert not given.conf.broker_transport_options
    for bad in ('{"openai": {"*": {"rpm": 600}}}', "600", "{not json"):
        monkeypatch.setenv("BUDGET_TASKS_RATE_LIMITS", bad)
        with pytest.raises(ValueError, match="BUDGET_TASKS_RATE_LIMITS="):
            configure(Celery("bad", set_as_current=False))
    monkeypatch.delenv("BUDGET_TASKS_RATE_LIMITS")
    monkeypatch.setenv("BUDGET_TASKS_STALE_AFTER", "soon")
    with pytest.raises(ValueError, match="BUDGET_TASKS_STALE_AFTER='soon'"):
        configure(Celery("bad", set_as_current=False))
    app.close()


def rated_app(url: str, limits: dict[str, Any], gateways: Any = None) -> Celery:
    """An app whose worker sets ``limits`` in the ledger at ``url`` as it starts."""
    app = Celery("rated", set_as_current=False)
    app.conf.budget_ledger_url = url
    app.conf.budget_rate_limits = limits
    if gateways is not None:
        app.conf.budget_rate_gateways = gateways
    return app


def windows_of(url: str) -> list[tuple[str, str, str, int]]:
    ledger = Ledger(url)
    try:
        return [(w.provider, w.scope, w.kind, w.per_minute) for w in ledger.rates.windows()]
    finally:
        ledger.dispose()


#: One known vendor's limit, and one for a name no vendor has (a typo, or a gateway).
MIXED = {"openai": {"gpt-4o-mini": {"requests": 600}}, "opnai": {"*": {"requests": 5}}}


def test_configured_limits_naming_a_provider_no_vendor_has_set_none_and_say_why(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """As ``limits set`` without ``--gateway``: a typo would hold nothing, so the
    worker's start sets none of the limits and logs one error naming the provider and
    the setting that would let it in."""
    app = rated_app(sqlite_url, MIXED)
    with pytest.raises(ValueError, match=r"names 'opnai', which no vendor known here has"):
        set_rate_limits(app)
    assert windows_of(sqlite_url) == []  # not even openai's
    with caplog.at_level(logging.INFO, logger="budget_tasks"):
        _set_at_start(app)  # what the worker_init handler runs
    [record] = [r for r in caplog.records if r.name == "budget_tasks"]
    assert record.levelno == logging.ERROR
    said = record.getMessage()
    assert "'opnai'" in said and "budget_rate_gateways" in said
    assert "BUDGET_TASKS_RATE_GATEWAYS" in said and "no rate limit is set" in said
    assert windows_of(sqlite_url) == []
    app.close()


@pytest.mark.parametrize("gateways", [["opnai"], "opnai", " litellm , opnai "])
def test_a_gateway_named_in_budget_rate_gateways_has_its_limits_set(
    sqlite_url: str, gateways: Any
) -> None:
    app = rated_app(sqlite_url, MIXED, gateways)
    assert [limit.provider for limit in set_rate_limits(app)] == ["openai", "opnai"]
    assert windows_of(sqlite_url) == [
        ("openai", "gpt-4o-mini", "requests", 600),
        ("opnai", "*", "requests", 5),
    ]
    app.close()


def test_a_vendor_the_app_registers_needs_no_gateway_entry(sqlite_url: str) -> None:
    """A gateway registered as a vendor of its own (before the worker starts, as an app
    module does at import) is known: its calls take from its windows."""
    registry.register(OpenAI("llm-gateway", hosts=[]))
    try:
        app = rated_app(sqlite_url, {"llm-gateway": {"*": {"tokens": 90_000}}})
        assert len(set_rate_limits(app)) == 1
        assert windows_of(sqlite_url) == [("llm-gateway", "*", "tokens", 90_000)]
        app.close()
    finally:
        registry.unregister("llm-gateway")
    assert unknown_providers(rate_limits.limits_of({"llm-gateway": {"*": {"tokens": 1}}}), ()) == [
        "llm-gateway"
    ]


@pytest.mark.parametrize("bad", [{"opnai": True}, 5, ["opnai", 3], [""]])
def test_budget_rate_gateways_is_a_list_of_names(sqlite_url: str, bad: Any) -> None:
    app = rated_app(sqlite_url, MIXED, bad)
    with pytest.raises(TypeError, match="budget_rate_gateways lists provider names"):
        set_rate_limits(app)
    assert windows_of(sqlite_url) == []
    app.close()
