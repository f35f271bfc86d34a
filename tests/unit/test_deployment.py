"""docker-compose.yml cannot be run here (no Docker engine): check that it is wired as
the README says, and that every command, module and setting it names exists."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from budget_tasks.wiring import ENV_SETTINGS, ENV_TRANSPORT

ROOT = Path(__file__).resolve().parents[2]
APP_SERVICES = ("migrate", "fake-provider", "worker", "beat", "dashboard")
#: The services that use the ledger, and those that call (or look up) the providers.
LEDGER_USERS = ("migrate", "worker", "beat", "dashboard")
PROVIDER_USERS = ("worker", "beat")
#: Each credential of the env file, and the only services given it.
CREDENTIALS = {
    "POSTGRES_PASSWORD": {"postgres", *LEDGER_USERS},  # the ledger URL is made from it
    "OPENAI_API_KEY": set(PROVIDER_USERS),
    "ANTHROPIC_API_KEY": set(PROVIDER_USERS),
    "BUDGET_TASKS_DASHBOARD_TOKEN": {"dashboard"},
    "FLOWER_BASIC_AUTH": {"flower"},
    "GF_SECURITY_ADMIN_PASSWORD": {"grafana"},
}


def _defaults(text: str) -> str:
    """The file as compose reads it with none of its variables set: each
    ``${NAME:-default}`` is its default, and a required ``${NAME:?why}`` reads
    ``<NAME>``."""
    text = re.sub(r"\$\{([A-Z_]+):\?[^}]*\}", r"<\1>", text)
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    text = _defaults((ROOT / "docker-compose.yml").read_text())
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def test_services_and_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "redis", *APP_SERVICES} <= set(services)
    for name in ("postgres", "redis", "fake-provider"):
        assert services[name]["healthcheck"]["test"], name
    assert services["flower"]["profiles"] == ["monitoring"]  # optional


def test_startup_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("worker", "beat"):
        needs = services[name]["depends_on"]
        assert needs["migrate"] == {"condition": "service_completed_successfully"}, name
        assert needs["redis"] == {"condition": "service_healthy"}, name
    assert services["worker"]["depends_on"]["fake-provider"]["condition"] == "service_healthy"


def test_environment_uses_the_names_the_code_reads(compose: dict[str, Any]) -> None:
    source = "\n".join(
        p.read_text()
        for p in [
            *(ROOT / "budget_tasks").rglob("*.py"),
            *(ROOT / "workers").rglob("*.py"),
            ROOT / "celeryconfig.py",
        ]
    )
    read = set(re.findall(r"os\.environ\.get\(\s*\"([A-Z_]+)\"", source))
    read |= set(re.findall(r"envvar=\"?([A-Z_]+)", source))
    read |= {"BUDGET_TASKS_LEDGER_URL"}  # read through the LEDGER_URL_ENV constant
    # each vendor's SDK variables, read through its attributes (Vendor.client, bypass)
    read |= set(re.findall(r"(?:key|token|base_url)_env = \"([A-Z_]+)\"", source))
    read |= set(ENV_SETTINGS) | set(ENV_TRANSPORT)  # read by configure(app)
    read |= {"BUDGET_TASKS_DASHBOARD_TOKEN"}  # read through the TOKEN_ENV constant
    for name in APP_SERVICES:
        env = compose["services"][name]["environment"]
        unknown = set(env) - read - {"PYTHONPATH"}
        assert not unknown, (name, unknown)
        if name in LEDGER_USERS:
            url = env["BUDGET_TASKS_LEDGER_URL"]
            assert url == "postgresql+psycopg://budget:<POSTGRES_PASSWORD>@postgres:5432/budget"
        assert env["CELERY_BROKER_URL"].startswith("redis://")
        assert int(env["BUDGET_TASKS_VISIBILITY_TIMEOUT"]) > int(
            env["BUDGET_TASKS_PROVIDER_TIMEOUT"]
        )
    for name in PROVIDER_USERS:  # the fake provider unless the env file names the APIs
        env = compose["services"][name]["environment"]
        assert env["OPENAI_BASE_URL"] == "http://fake-provider:8089/v1"
        assert env["ANTHROPIC_BASE_URL"] == "http://fake-provider:8089"


def example_env() -> dict[str, str]:
    """What budget-tasks.env.example sets (the file a deployment copies and fills)."""
    lines = (ROOT / "budget-tasks.env.example").read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line and not line.startswith("#")]
    return {k: v for k, v in pairs}


def test_no_credential_is_inline_and_every_port_listens_on_loopback(
    compose: dict[str, Any],
) -> None:
    """The compose file holds no password or key: each comes from the env file (kept
    out of git; its example lists every credential), and each service is given only
    the credentials it uses (the fake provider none, Flower only its login); what it
    publishes (the dashboard, metrics: budget names and spend; Flower: task arguments
    and results) listens on 127.0.0.1 only; Flower refuses to start without a login."""
    services = compose["services"]
    raw = (ROOT / "docker-compose.yml").read_text()
    for secret in ("sk-", "budget:budget@", "change-me", "env_file"):
        assert secret not in raw, secret
    for credential, users in CREDENTIALS.items():
        given = {
            name
            for name, service in services.items()
            if f"<{credential}>" in str(service.get("environment", {}))
            or credential in dict(service.get("environment", {}))
        }
        assert given == users, credential
    assert set(CREDENTIALS) <= set(example_env())
    assert "budget-tasks.env" in (ROOT / ".gitignore").read_text().splitlines()
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published, "the metrics and Flower are published"
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), (name, port)
    flower = " ".join(services["flower"]["entrypoint"])
    assert 'test -n "$$FLOWER_BASIC_AUTH"' in flower and "--basic-auth=" in flower
    assert "FLOWER_BASIC_AUTH" in example_env()


def test_every_command_names_something_that_exists(compose: dict[str, Any]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in APP_SERVICES:
        command = compose["services"][name]["command"]
        if command[0] == "budget-tasks":
            assert "budget-tasks" in scripts
            done = subprocess.run(
                [sys.executable, "-m", "budget_tasks.cli", *command[1:], "--help"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 0, done.stderr
        elif command[0] == "celery":
            assert command[1:3] == ["-A", "workers.app"]
            assert importlib.util.find_spec("workers.app") is not None
            assert command[3] in ("worker", "beat")
        else:
            assert command[:2] == ["python", "-m"]
            assert importlib.util.find_spec(command[2]) is not None
            done = subprocess.run(
                [sys.executable, "-m", command[2], "--help"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 0
            for flag in command[3::2]:
                assert flag in done.stdout, flag
    worker = compose["services"]["worker"]["command"]
    assert "--prefetch-multiplier=1" in worker


def test_the_worker_exposes_metrics_with_a_shared_multiprocess_directory(
    compose: dict[str, Any],
) -> None:
    worker = compose["services"]["worker"]
    env = worker["environment"]
    assert env["CELERY_BROKER_URL"].startswith("redis://")  # the shared settings are kept
    port = env["BUDGET_TASKS_METRICS_PORT"]
    assert f"127.0.0.1:{port}:{port}" in worker["ports"]
    assert any(mount.startswith(env["PROMETHEUS_MULTIPROC_DIR"]) for mount in worker["tmpfs"])


def test_the_image_copies_what_the_services_run() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
                copied.add(source)
    # the reference app the services run from /app, and what budget_tasks/ links to
    assert {"celeryconfig.py", "workers", "budget_tasks"} <= copied
    assert 'pip install ".[openai,anthropic,dashboard]"' in dockerfile


def test_compose_runs_your_own_module_and_restarts_its_services() -> None:
    """APP_DIR is mounted where every app service imports from, and CELERY_APP names
    the app the worker, its health check and beat run (the reference app by default);
    the long-running services come back after a crash or a reboot."""
    raw = (ROOT / "docker-compose.yml").read_text()
    data = yaml.safe_load(_defaults(raw))
    services = data["services"]
    mounted = "${APP_DIR:-./examples}:/app/user:ro"
    assert mounted in raw and (ROOT / "examples").is_dir()
    for name in APP_SERVICES:
        service = services[name]
        assert service["environment"]["PYTHONPATH"] == "/app/user", name
        assert "./examples:/app/user:ro" in service["volumes"], name
    for name in ("worker", "beat"):
        assert services[name]["command"][1:3] == ["-A", "workers.app"]
    assert raw.count("-A ${CELERY_APP:-workers.app}") == 1  # the health check
    assert raw.count('"-A", "${CELERY_APP:-workers.app}"') == 2  # worker, beat
    for name in ("postgres", "redis", "fake-provider", "worker", "beat", "dashboard"):
        assert services[name]["restart"] == "unless-stopped", name
    assert services["migrate"]["restart"] == "no"  # a one-shot job


def test_a_scrape_passes_over_a_metrics_file_a_new_process_has_not_sized_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from budget_tasks.metrics import registry_for

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(
        mmap_key("budget_tasks_denials_total", "budget_tasks_denials_total", ["budget"], ["a"], ""),
        3.0,
        0.0,
    )
    written.close()
    (tmp_path / "counter_102.db").touch()  # made by a fork, not sized yet
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    class NoLedger:
        def report(self) -> list[object]:
            return []

    text = generate_latest(registry_for(NoLedger())).decode()
    assert 'budget_tasks_denials_total{budget="a"} 3.0' in text
