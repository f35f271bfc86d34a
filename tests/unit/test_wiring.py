"""budget_tasks.configure(app): what it wires, what it leaves to the app; and the
public namespace of the package."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from celery import Celery

import budget_tasks
from budget_tasks import BudgetTask, configure
from budget_tasks.wiring import BEAT_SCHEDULE, startup_problems


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


def test_a_visibility_timeout_shorter_than_a_lease_is_a_problem() -> None:
    app = Celery("vt", set_as_current=False, broker="redis://127.0.0.1:6379/0")
    app.conf.broker_transport_options = {"visibility_timeout": 300}
    configure(app)

    @app.task(base=BudgetTask, name=f"vt.job.{uuid.uuid4().hex[:6]}", lease_seconds=600.0)
    def job() -> int:
        return 1

    problems = startup_problems(app, BudgetTask)
    assert len(problems) == 1
    assert "visibility timeout (300 s) is shorter than" in problems[0]
    app.conf.broker_transport_options = {"visibility_timeout": 600}
    assert startup_problems(app, BudgetTask) == []  # exactly the lease is enough
    app.close()


def test_the_package_namespace_is_its_public_api() -> None:
    names = dir(budget_tasks)
    assert "Any" not in names and "TYPE_CHECKING" not in names
    assert {"BudgetTask", "configure", "Ledger", "__version__"} <= set(names)
    assert set(budget_tasks.__all__) <= set(names)
