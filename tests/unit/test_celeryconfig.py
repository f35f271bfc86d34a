import importlib
import sys
from pathlib import Path

import pytest


def load_app(monkeypatch: pytest.MonkeyPatch, **env: str):  # type: ignore[no-untyped-def]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for module in ("budget_tasks.demo.settings", "budget_tasks.demo.app"):
        sys.modules.pop(module, None)
    return importlib.import_module("budget_tasks.demo.app").app


def test_embedded_defaults_need_no_services(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    app = load_app(monkeypatch, BUDGET_TASKS_HOME=str(tmp_path))
    assert app.conf.broker_url == f"sqla+sqlite:///{tmp_path}/broker.db"
    assert app.conf.result_backend == f"db+sqlite:///{tmp_path}/results.db"
    assert app.conf.budget_ledger_url == f"sqlite:///{tmp_path}/ledger.db"
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    # the SQLAlchemy transport passes these to create_engine(), which refuses them
    assert not app.conf.broker_transport_options


def test_environment_points_at_real_services(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    app = load_app(
        monkeypatch,
        BUDGET_TASKS_HOME=str(tmp_path),
        CELERY_BROKER_URL="redis://127.0.0.1:6379/0",
        CELERY_RESULT_BACKEND="redis://127.0.0.1:6379/1",
        BUDGET_TASKS_LEDGER_URL="postgresql+psycopg://postgres@127.0.0.1/ledger",
        BUDGET_TASKS_VISIBILITY_TIMEOUT="7200",
    )
    assert app.conf.broker_url == "redis://127.0.0.1:6379/0"
    assert app.conf.budget_ledger_url == "postgresql+psycopg://postgres@127.0.0.1/ledger"
    assert app.conf.broker_transport_options["visibility_timeout"] == 7200


def test_a_bad_number_names_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"BUDGET_TASKS_METRICS_PORT='notaport': expected a number"
    ):
        load_app(monkeypatch, BUDGET_TASKS_HOME=str(tmp_path), BUDGET_TASKS_METRICS_PORT="notaport")


def test_importing_the_settings_creates_no_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "not-yet"
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BUDGET_TASKS_HOME", str(home))
    sys.modules.pop("budget_tasks.demo.settings", None)
    settings = importlib.import_module("budget_tasks.demo.settings")
    assert settings.budget_ledger_url == f"sqlite:///{home}/ledger.db"
    assert not home.exists()
    # loading the app (what a worker does) makes it, for the embedded SQLite files
    load_app(monkeypatch, BUDGET_TASKS_HOME=str(home))
    assert home.is_dir()
