"""The first hour of a user, as a user has it: the wheel and the sdist built, the wheel
installed into a fresh virtualenv outside the checkout, and from a new directory:

1. the README's Quick start run offline as written (``budget-tasks fake-provider`` as
   a process and the exports it prints, its shell lines in order, its ``jobs.py``
   verbatim), with a real ``celery worker`` and ``celery beat``, Redis, and a fresh
   PostgreSQL database after ``budget-tasks db upgrade``; only the ledger the README
   exports and the broker are pointed at the test's own services; then
   ``budget-tasks -A jobs status`` with no provider key, and the Testing section's
   examples, as written, beside that ``jobs.py`` (eager, and through Celery's own
   worker fixture) in the same shell;
2. ``budget-tasks demo`` from the installed wheel;
3. the example test of the pytest plugin, with the venv's own pytest;
4. a worker of an app that skips the wiring warns about it at start;
5. the bare wheel (no extras) imports every public name and runs a BudgetTask.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from budget_tasks import Ledger
from tests.support import wait_for

from ..demo_output import check_embedded_demo
from ..services import (
    REDIS_HOST,
    REDIS_PORT,
    check_postgres,
    check_redis,
    redis_db,
    scratch_database,
)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RECONCILED = re.compile(r"Task budget_tasks\.reconcile_unknown\[.*\] succeeded")
REDIS_DBS = (redis_db("first hour: broker"), redis_db("first hour: results"))

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def quick_start() -> tuple[list[str], str, list[str]]:
    """The Quick start's setup lines, its ``jobs.py`` and its run lines, as written."""
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("<!-- --8<-- [end:quick-start]")]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.S)
    assert [kind for kind, _ in blocks] == ["bash", "python", "bash"], "the section changed"
    setup, code, run = (body for _, body in blocks)

    def lines(body: str) -> list[str]:
        return [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]

    return lines(setup), code, lines(run)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built with the sdist from this checkout."""
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [built] = dist.glob("budget_tasks-*.whl")
    [sdist] = dist.glob("budget_tasks-*.tar.gz")
    assert sdist.stat().st_size > 0
    return built


def _venv_with(tmp_path_factory: pytest.TempPathFactory, requirement: str) -> Path:
    env_dir = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    subprocess.run(
        [str(env_dir / "bin" / "pip"), "install", "-q", requirement],
        check=True,
        capture_output=True,
        timeout=900,
    )
    return env_dir


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed with the extras the Quick start names, in a new venv outside
    the checkout."""
    return _venv_with(tmp_path_factory, f"{wheel}[openai,testing]")


BARE_USE = """
import importlib, tempfile

from celery import Celery

import budget_tasks
from budget_tasks import BudgetTask, Ledger

for name in ("budget_tasks", "budget_tasks.ledger", "budget_tasks.transport",
             "budget_tasks.providers", "budget_tasks.beat", "budget_tasks.hooks",
             "budget_tasks.pricing", "budget_tasks.bypass"):
    module = importlib.import_module(name)
    names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
    for public in names:
        getattr(module, public)  # every public name resolves
url = f"sqlite:///{tempfile.mkdtemp()}/ledger.db"
ledger = Ledger(url)
ledger.create_schema()
ledger.create_budget("acme", 1000)
app = Celery("bare")
app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=url)


@app.task(base=BudgetTask, bind=True, budget="acme", estimate_cost=lambda: 10,
          idempotency_key=lambda: "bare:1")
def job(self):
    self.attempt.record_usage(7)
    return "ran"


assert job.delay().get() == "ran" and job.delay().get() == "ran"
assert ledger.balance("acme").spent == 7
print("bare install ok")
"""


def test_the_bare_wheel_imports_every_public_name_and_runs_a_budget_task(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`pip install budget-tasks`, no extras: no SDK, no pytest. Every public name
    imports, and a BudgetTask runs and replays (eagerly, on SQLite)."""
    bare = _venv_with(tmp_path_factory, str(wheel))
    sdk = subprocess.run(
        [str(bare / "bin" / "python"), "-c", "import openai"], capture_output=True, check=False
    )
    assert sdk.returncode != 0, "the bare install must not bring an SDK"
    done = subprocess.run(
        [str(bare / "bin" / "python"), "-c", BARE_USE],
        cwd=bare,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bare install ok" in done.stdout


@pytest.fixture
def user_env(venv: Path) -> dict[str, str]:
    """A shell of the user's: the venv first on PATH, nothing of this checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CELERY_", "BUDGET_", "OPENAI_", "ANTHROPIC_", "PYTHON", "VIRTUAL"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


@pytest.fixture
def services() -> Iterator[tuple[str, str, str]]:
    check_postgres()
    check_redis()
    urls = []
    for db in REDIS_DBS:
        redis.Redis(REDIS_HOST, REDIS_PORT, db=db).flushdb()
        urls.append(f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}")
    with scratch_database("bt_user") as ledger_url:
        yield ledger_url, urls[0], urls[1]


def run(command: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        shlex.split(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


class Background:
    """A long-running command of the Quick start (worker, beat), with its log."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], name: str) -> None:
        self.log_path = cwd / f"{name}.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            shlex.split(command),
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self.log.close()


def offline_command() -> str:
    """The command the Quick start names for running offline."""
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("<!-- --8<-- [end:quick-start]")]
    found = re.search(r"Run `([^`]+)` in another terminal and\s+export", section)
    assert found, "the Quick start no longer says how to run offline"
    return found.group(1)


def testing_examples() -> str:
    """The README's test module beside ``jobs.py``, with the worker example that
    docs/testing.md adds to it ("Both examples can sit in the same module")."""
    text = README.read_text()
    section = text[text.index("### Testing your own tasks") : text.index("## The CLI in brief")]
    [eager] = re.findall(r"```python\n(.*?)```", section, re.S)
    page = (ROOT / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert blocks[0] == eager, "docs/testing.md's first example is the README's"
    assert "Both examples can sit in the same module" in page
    return eager + "\n\n" + blocks[1]


def fake_requests(base: str) -> list[dict[str, object]]:
    """What the fake provider process served (its state route)."""
    with urllib.request.urlopen(f"{base}/_fake/state", timeout=10) as answer:
        state = json.load(answer)
    return [r for r in state["requests"] if r["method"] == "POST"]


def test_the_quick_start_offline_as_written_then_its_tests_then_the_demo(
    venv: Path,
    user_env: dict[str, str],
    services: tuple[str, str, str],
    tmp_path: Path,
    wheel_installed_outside: None,
) -> None:
    ledger_url, broker_url, backend_url = services
    setup, code, commands = quick_start()
    home = tmp_path / "project"
    home.mkdir()
    (home / "jobs.py").write_text(code)
    env = dict(user_env)
    # Celery reads these over the app's own broker and backend: the test's Redis dbs
    env.update(CELERY_BROKER_URL=broker_url, CELERY_RESULT_BACKEND=backend_url)
    env["BUDGET_TASKS_HOME"] = str(tmp_path / "budget-tasks-home")

    # offline: the fake provider in "another terminal", and the exports it prints
    provider = Background(offline_command(), home, env, "fake-provider")
    exports = wait_for(
        lambda: re.search(
            r"^\s*export (OPENAI_BASE_URL=\S+ OPENAI_API_KEY=\S+)$", provider.text(), re.M
        ),
        30,
        "the fake provider to print its exports",
    )
    offline = dict(pair.split("=", 1) for pair in exports.group(1).split())
    worker = beat = None
    try:
        for line in setup:
            if line.startswith("createdb "):
                # the ledger's own database: the test's scratch one stands in for it
                assert line == "createdb -h 127.0.0.1 -U postgres budget_tasks", line
                continue
            if line.startswith("export "):
                name, value = line.removeprefix("export ").split("=", 1)
                assert value, line
                if name == "BUDGET_TASKS_LEDGER_URL":  # the database createdb made
                    assert value.endswith("@127.0.0.1:5432/budget_tasks"), value
                # the ledger: the test's database; the key: what the fake printed
                env[name] = {"BUDGET_TASKS_LEDGER_URL": ledger_url, **offline}[name]
                continue
            run(line, home, env)
        env.update(offline)  # "export the OPENAI_BASE_URL and OPENAI_API_KEY it prints"

        background = [c for c in commands if c.split()[:2] == ["celery", "-A"]]
        assert [c.split()[3] for c in background] == ["worker", "beat"]
        worker = Background(background[0], home, env, "worker")
        beat = Background(background[1], home, env, "beat")
        wait_for(lambda: "ready." in worker.text(), 90, "the worker to be ready")
        assert "budget-tasks:" not in worker.text(), worker.text()  # no wiring warning
        outputs = [run(c, home, env) for c in commands if c not in background]
        first, again, status = outputs
        assert first == again and first.strip()  # the second job replayed the first
        posts = fake_requests(offline["OPENAI_BASE_URL"].removesuffix("/v1"))
        ledger = Ledger(ledger_url)
        try:
            assert [p["idempotency_key"] for p in posts] == [
                ledger.provider_key("summarize:doc-7:openai.chat:1")
            ]
            assert ledger.balance("acme").spent == posts[0]["billed"] > 0
            assert ledger.balance("acme").held == 0
            assert ledger.audit() == []
        finally:
            ledger.dispose()
        assert "acme" in status
        # the CLI reads the app without a provider key (no secrets needed to operate)
        keyless = {k: v for k, v in env.items() if not k.startswith("OPENAI_")}
        assert "acme" in run("budget-tasks -A jobs status", home, keyless)

        # the Testing section's module beside jobs.py, with the venv's own pytest, in
        # this shell (which exports the deployment's broker and the fake's URL and key)
        (home / "test_jobs.py").write_text(testing_examples())
        served_before = len(fake_requests(offline["OPENAI_BASE_URL"].removesuffix("/v1")))
        out = run("python -m pytest -q -p no:cacheprovider test_jobs.py", home, env)
        assert "2 passed" in out, out
        # its calls went to the test's own fake, not to the one the shell points at
        assert len(fake_requests(offline["OPENAI_BASE_URL"].removesuffix("/v1"))) == served_before

        # the demo, from the wheel, in a directory of its own (SQLite, no services);
        # meanwhile beat's first minute passes
        demo_dir = tmp_path / "demo"
        demo_dir.mkdir()
        demo_env = {k: v for k, v in user_env.items()}
        demo_env["HOME"] = str(tmp_path / "demo-home")
        demo = run("budget-tasks demo", demo_dir, demo_env, timeout=400)
        check_embedded_demo(demo, Path(demo_env["HOME"]))

        # beat sent the reconciliation job, and the worker ran it
        wait_for(lambda: "budget_tasks.reconcile_unknown" in beat.text(), 120, "beat's first run")
        wait_for(lambda: RECONCILED.search(worker.text()), 60, "the worker to run it")
    finally:
        for process in (worker, beat, provider):
            if process is not None:
                process.stop()

    # the plugin's example test, with the venv's own pytest, from a new directory
    tests_dir = tmp_path / "usertests"
    tests_dir.mkdir()
    shutil.copy(ROOT / "examples" / "test_summarize.py", tests_dir)
    out = run("python -m pytest -q -p no:cacheprovider test_summarize.py", tests_dir, user_env)
    assert "2 passed" in out


@pytest.fixture
def wheel_installed_outside(venv: Path, user_env: dict[str, str]) -> None:
    """The venv's budget_tasks is the installed wheel's, not this checkout."""
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import budget_tasks; print(budget_tasks.__file__)"],
        cwd=venv,
        env=user_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert str(venv) in where and str(ROOT) not in where, where


BARE_APP = """
from celery import Celery
from budget_tasks import BudgetTask

app = Celery("bare")
app.conf.broker_transport_options = {"visibility_timeout": 60}


@app.task(base=BudgetTask, bind=True, budget="acme", estimate_cost=lambda: 1)
def job(self):
    return 1
"""


def test_a_worker_of_an_app_without_the_wiring_warns_at_start(
    venv: Path, user_env: dict[str, str], services: tuple[str, str, str], tmp_path: Path
) -> None:
    ledger_url, broker_url, _ = services
    (tmp_path / "bare.py").write_text(BARE_APP)
    env = dict(user_env, CELERY_BROKER_URL=broker_url, BUDGET_TASKS_LEDGER_URL=ledger_url)
    worker = Background("celery -A bare worker --loglevel=INFO", tmp_path, env, "bare")
    try:
        wait_for(lambda: "ready." in worker.text(), 90, "the worker to be ready")
        time.sleep(0.5)
        log = worker.text()
    finally:
        worker.stop()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "budget-tasks:" in line]
    assert len(warnings) == 2, log
    assert "beat jobs are not registered" in warnings[0]
    assert "visibility timeout (60 s) is shorter than bare.job's lease (600 s)" in warnings[1]
