"""The reference app's settings (``celeryconfig.py``) and app (``workers/``): every
setting from its variable, embedded defaults that need no services, and one copy of
each file, which the wheel ships as ``budget_tasks.reference``."""

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("celeryconfig", "workers.app", "workers.tasks")
REFERENCE = tuple(f"budget_tasks.reference.{name}" for name in MODULES)


def load_app(monkeypatch: pytest.MonkeyPatch, *, package: str = "", **env: str):  # type: ignore[no-untyped-def]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for module in (*MODULES, *REFERENCE):
        sys.modules.pop(module, None)
    return importlib.import_module(f"{package}workers.app").app


def test_embedded_defaults_need_no_services(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    # a Redis option set in the environment does not reach the SQLite broker's engine
    app = load_app(
        monkeypatch, BUDGET_TASKS_HOME=str(tmp_path), BUDGET_TASKS_VISIBILITY_TIMEOUT="9"
    )
    assert app.conf.broker_url == f"sqla+sqlite:///{tmp_path}/broker.db"
    assert app.conf.result_backend == f"db+sqlite:///{tmp_path}/results.db"
    assert app.conf.budget_ledger_url == f"sqlite:///{tmp_path}/ledger.db"
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.budget_stale_after == 900
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
        BUDGET_TASKS_STALE_AFTER="60",
        BUDGET_TASKS_REQUEUE_NOT_FOUND="1",
    )
    assert app.conf.broker_url == "redis://127.0.0.1:6379/0"
    assert app.conf.budget_ledger_url == "postgresql+psycopg://postgres@127.0.0.1/ledger"
    options = app.conf.broker_transport_options
    assert options["visibility_timeout"] == 7200
    assert options["unacked_restore_interval"] == 10  # the module's own, kept
    assert app.conf.budget_stale_after == 60
    assert app.conf.budget_requeue_not_found is True


def test_a_bad_number_names_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"BUDGET_TASKS_METRICS_PORT='notaport' is not a valid"):
        load_app(monkeypatch, BUDGET_TASKS_HOME=str(tmp_path), BUDGET_TASKS_METRICS_PORT="notaport")


def test_importing_the_settings_creates_no_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "not-yet"
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BUDGET_TASKS_HOME", str(home))
    sys.modules.pop("celeryconfig", None)
    settings = importlib.import_module("celeryconfig")
    assert settings.budget_ledger_url == f"sqlite:///{home}/ledger.db"
    assert not home.exists()
    # loading the app (what a worker does) makes it, for the embedded SQLite files
    load_app(monkeypatch, BUDGET_TASKS_HOME=str(home))
    assert home.is_dir()


def test_the_wheel_ships_the_top_level_files_not_copies() -> None:
    """budget_tasks/reference links to workers/ and celeryconfig.py: one copy of each."""
    reference = ROOT / "budget_tasks" / "reference"
    assert (reference / "workers").resolve() == ROOT / "workers"
    assert (reference / "celeryconfig.py").resolve() == ROOT / "celeryconfig.py"
    sources = [
        path
        for path in ROOT.rglob("*.py")
        if ".venv" not in path.parts
        and not path.is_symlink()
        and not any(p.is_symlink() for p in path.parents)
    ]
    for task in ("workers.summarize", "workers.research"):
        named = [p for p in sources if re.search(rf"name\s*=\s*\"{task}\"", p.read_text())]
        assert named == [ROOT / "workers" / "tasks.py"], task


@pytest.mark.parametrize("package", ["", "budget_tasks.reference."])
def test_the_app_reads_its_settings_under_either_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, package: str
) -> None:
    """From the checkout (``workers.app``) and from the wheel
    (``budget_tasks.reference.workers.app``): the same tasks, the same settings."""
    app = load_app(monkeypatch, package=package, BUDGET_TASKS_HOME=str(tmp_path))
    app.loader.import_default_modules()
    assert {"workers.summarize", "workers.research"} <= set(app.tasks)
    assert app.conf.budget_ledger_url.endswith(f"{tmp_path}/ledger.db")
    assert f"{package}celeryconfig" in sys.modules
