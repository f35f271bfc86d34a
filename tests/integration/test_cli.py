"""The operator CLI driven as a subprocess, as an operator or a script would."""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from budget_tasks import BudgetExceeded, Ledger
from budget_tasks.testing import ManualClock

from ..services import scratch_database


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUDGET_TASKS_LEDGER_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def ok(url: str, *args: str) -> str:
    done = cli(url, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def as_json(url: str, *args: str) -> Any:
    return json.loads(ok(url, *args, "--json"))


def test_budgets_holds_resolve_audit_and_status(pg_url: str, pg_ledger: Ledger) -> None:
    assert "created budget acme" in ok(pg_url, "budget", "create", "acme", "--cap", "100000")
    ok(
        pg_url,
        "budget",
        "create",
        "support",
        "--cap",
        "50000",
        "--parent",
        "acme",
        "--period",
        "day",
        "--renewal",
        "rollover",
        "--rollover-ceiling",
        "150000",
    )
    listed = as_json(pg_url, "budget", "list")
    assert [(b["name"], b["parent"], b["period"]) for b in listed] == [
        ("acme", None, "none"),
        ("support", "acme", "day"),
    ]
    # an attempt whose outcome is unknown, and one reserved but never sent (on the real
    # clock, as the CLI reads the current period)
    ledger = Ledger(pg_url)
    ledger.calls.reserve("support", "call-1", 20_000)
    ledger.calls.mark_sending("call-1", request_id="req_77")
    ledger.calls.mark_unknown("call-1", "read timeout")
    ledger.calls.reserve("support", "call-2", 5_000)
    ledger.dispose()

    table = ok(pg_url, "holds", "--budget", "support")
    assert "call-1" in table and "req_77" in table and "unknown" in table
    stale = as_json(pg_url, "holds", "--stale", "--age", "0")
    assert [h["key"] for h in stale] == ["call-1"]  # reserved-only holds are not stale sends
    assert as_json(pg_url, "holds", "--stale") == []  # younger than the default 15 minutes

    # a reserved (never sent) attempt cannot be charged, only released
    refused = cli(pg_url, "resolve", "call-2", "--actual", "10", "--note", "x")
    assert refused.returncode == 2
    assert "never sent" in refused.stderr
    resolved = as_json(pg_url, "resolve", "call-1", "--actual", "18000", "--note", "invoice 7")
    assert (resolved["state"], resolved["actual"]) == ("settled", 18_000)
    again = ok(pg_url, "resolve", "call-1", "--actual", "18000", "--note", "invoice 7")
    assert "nothing changed" in again
    conflict = cli(pg_url, "resolve", "call-1", "--actual", "1", "--note", "oops")
    assert conflict.returncode == 2
    assert "already settled at 18000" in conflict.stderr
    ok(pg_url, "resolve", "call-2", "--actual", "0", "--note", "worker died before sending")
    with pg_ledger.engine.connect() as conn:
        notes = conn.execute(
            text("SELECT kind, note FROM journal WHERE kind <> 'hold' ORDER BY id")
        ).all()
    assert [tuple(n) for n in notes] == [
        ("charge", "operator: invoice 7"),
        ("charge", "operator: invoice 7"),
        ("release", "operator: worker died before sending"),
        ("release", "operator: worker died before sending"),
    ]  # one entry per budget in the chain (support and acme)

    status = {r["budget"]: r for r in as_json(pg_url, "status")}
    assert (status["support"]["spent"], status["support"]["held"]) == (18_000, 0)
    assert status["acme"]["available"] == 100_000 - 18_000
    assert "audit: every counter equals its journal" in ok(pg_url, "audit")

    with pg_ledger.engine.begin() as conn:
        conn.execute(text("UPDATE budget_periods SET spent = spent + 1"))
    broken = cli(pg_url, "audit")
    assert broken.returncode == 1
    assert "spent" in broken.stdout


def test_freeze_and_bad_input_exit_non_zero_with_a_clear_message(
    pg_url: str, pg_ledger: Ledger
) -> None:
    ok(pg_url, "budget", "create", "acme", "--cap", "100")
    assert "frozen" in ok(pg_url, "budget", "freeze", "acme")
    assert as_json(pg_url, "budget", "show", "acme")["budget"]["frozen"] is True
    ok(pg_url, "budget", "unfreeze", "acme")
    for args, message in [
        (("budget", "show", "nope"), "unknown budget 'nope'"),
        (("budget", "create", "x", "--cap", "-5"), "the amount cannot be negative"),
        (("budget", "create", "acme", "--cap", "5"), "already exists"),
        (("resolve", "nope", "--actual", "1", "--note", "x"), "unknown attempt 'nope'"),
        (("budget", "create", "y", "--cap", "1.5"), "'1.5' is not an amount: give dollars"),
        (("budget", "create", "y", "--cap", "0.0000001usd"), "finer than a micro-dollar"),
    ]:
        done = cli(pg_url, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
    unreachable = cli("postgresql+psycopg://postgres@127.0.0.1:1/none", "status")
    assert unreachable.returncode == 2
    assert "ledger unavailable" in unreachable.stderr


def test_caps_corrections_and_freezes_from_the_cli(pg_url: str, pg_ledger: Ledger) -> None:
    ok(pg_url, "budget", "create", "acme", "--cap", "1000")
    pg_ledger.calls.reserve("acme", "call-1", 600)
    pg_ledger.calls.mark_sending("call-1")
    pg_ledger.calls.settle("call-1", 600)
    raised = as_json(pg_url, "budget", "set-cap", "acme", "--cap", "2000", "--note", "Q4 deal")
    assert (raised["name"], raised["cap"]) == ("acme", 2000)
    # dollars typed and shown; micro-USD typed too, and kept in --json
    assert "cap $0.002 -> $0.0006" in ok(pg_url, "budget", "set-cap", "acme", "--cap", "$0.0006")
    below = cli(pg_url, "budget", "set-cap", "acme", "--cap", "599")
    assert below.returncode == 2 and below.stderr.count("\n") == 1
    assert "spent and holds 600" in below.stderr and "freeze it" in below.stderr
    fixed = as_json(
        pg_url, "adjust", "call-1", "--delta", "-100", "--reason", "refund", "--ref", "r1"
    )
    assert fixed["applied"] is True
    again = as_json(
        pg_url, "adjust", "call-1", "--delta", "-100", "--reason", "refund", "--ref", "r1"
    )
    assert again["applied"] is False  # the same provider reference applies once
    assert pg_ledger.balance("acme").spent == 500
    assert as_json(pg_url, "budget", "freeze", "acme")["frozen"] is True
    assert as_json(pg_url, "budget", "unfreeze", "acme")["frozen"] is False
    with pg_ledger.engine.connect() as conn:
        kinds = conn.execute(
            text("SELECT kind, cap_delta, note FROM journal WHERE kind = 'cap'")
        ).all()
    assert [tuple(k) for k in kinds] == [
        ("cap", 1000, "Q4 deal"),
        ("cap", -1400, "cap 2000 -> 600"),
    ]
    assert "audit: every counter equals its journal" in ok(pg_url, "audit")


# -- issue 13: the first hour of a user --------------------------------------------------

#: The installed console script: as a user runs it, its sys.path does not start at the
#: current directory (``python -m`` would put it there).
SCRIPT = str(Path(sys.executable).with_name("budget-tasks"))
UPGRADE = "run `budget-tasks db upgrade`"
EXPECTED = "expected postgresql://USER@HOST:5432/DBNAME or sqlite:///PATH/ledger.db"


def command(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The console script with none of the settings it reads in its environment but ``env``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BUDGET_TASKS_LEDGER_URL", "BUDGET_TASKS_STALE_AFTER")
    }
    return subprocess.run(
        [SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        cwd=cwd,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed, having checked it is one line and exit 2."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    return done.stderr.rstrip("\n")


def write_app(where: Path, ledger_url: str, stale_after: int = 60) -> Path:
    """A user's Celery app module, ``myapp``, in ``where``."""
    (where / "myapp.py").write_text(
        "from celery import Celery\n"
        "app = Celery('myapp', set_as_current=False)\n"
        f"app.conf.budget_ledger_url = {ledger_url!r}\n"
        f"app.conf.budget_stale_after = {stale_after}\n"
        "other = Celery('other', set_as_current=False)\n"
        "other.conf.budget_ledger_url = 'notaurl'\n"
    )
    return where


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("notaurl", f"invalid ledger URL: it does not parse; {EXPECTED}"),
        ("", f"invalid ledger URL: it is empty; {EXPECTED}"),
        (
            "postgresql://u:secret@127.0.0.1:notaport/x",
            "invalid ledger URL: its port is not a number",
        ),
    ],
    ids=["notaurl", "empty", "port"],
)
@pytest.mark.parametrize("args", [("status",), ("db", "upgrade")], ids=" ".join)
def test_a_malformed_ledger_url_is_one_line_and_exit_2(
    url: str, message: str, args: tuple[str, ...]
) -> None:
    assert one_line_error(command(*args, "--ledger-url", url)) == f"error: {message}"


@pytest.fixture(params=["postgres", "sqlite"])
def schemaless_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database that exists and has no ledger tables."""
    if request.param == "sqlite":
        (tmp_path / "empty.db").touch()  # an empty file is an empty SQLite database
        yield f"sqlite:///{tmp_path}/empty.db"
        return
    request.getfixturevalue("pg_url")  # PostgreSQL is there (or the test skips)
    with scratch_database() as url:
        yield url


def test_a_ledger_without_its_schema_says_run_db_upgrade(schemaless_url: str) -> None:
    line = one_line_error(command("status", "--ledger-url", schemaless_url))
    assert line.startswith("error: the ledger schema is missing or out of date (")
    assert line.endswith(f"): {UPGRADE}")
    # and doing what it says is enough
    assert command("db", "upgrade", "--ledger-url", schemaless_url).returncode == 0
    assert command("status", "--ledger-url", schemaless_url).returncode == 0


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://postgres@127.0.0.1:1/x", "port 1 failed: Connection refused"),
        (
            "postgresql://postgres@127.0.0.1:5432/bt_missing_{}",
            'failed: FATAL:  database "bt_missing_{}" does not exist',
        ),
    ],
    ids=["no server", "no database"],
)
def test_db_upgrade_without_a_server_or_database_is_one_line_and_exit_2(
    pg_url: str, url: str, reason: str
) -> None:
    name = uuid.uuid4().hex[:8]
    line = one_line_error(command("db", "upgrade", "--ledger-url", url.format(name)))
    assert line.startswith("error: cannot reach the ledger database: connection failed: ")
    assert line.endswith(reason.format(name))


def test_the_app_option_gives_the_ledger_url(
    pg_url: str, pg_ledger: Ledger, tmp_path: Path
) -> None:
    home = write_app(tmp_path, pg_url)
    done = command("-A", "myapp", "budget", "create", "acme", "--cap", "100", cwd=home)
    assert done.returncode == 0, done.stderr
    assert pg_ledger.budget("acme").cap == 100
    # --ledger-url, then env, then the app: the first given is used
    env_first = command("-A", "myapp", "status", cwd=home, BUDGET_TASKS_LEDGER_URL="notaurl")
    assert one_line_error(env_first).startswith("error: invalid ledger URL: it does not parse")
    explicit = command(
        "-A", "myapp", "status", "--ledger-url", pg_url, cwd=home, BUDGET_TASKS_LEDGER_URL="x"
    )
    assert explicit.returncode == 0 and "acme" in explicit.stdout, explicit.stderr
    # module:attr names the app (this one's URL is bad)
    named = one_line_error(command("-A", "myapp:other", "status", cwd=home))
    assert named.startswith("error: invalid ledger URL: it does not parse")


def test_an_app_that_cannot_be_imported_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('settings are wrong')\n")
    (tmp_path / "empty.py").write_text("")
    for app, message in [
        ("nosuchapp", "cannot import the Celery app 'nosuchapp': No module named 'nosuchapp'"),
        ("broken", "cannot import the Celery app 'broken': settings are wrong"),
        ("empty", "module 'empty' has no Celery app named app or celery (name it: -A empty:NAME)"),
    ]:
        line = one_line_error(command("-A", app, "status", cwd=tmp_path))
        assert line == f"error: {message}"


def test_stale_holds_use_the_configured_age_and_what_beat_flagged(
    pg_url: str, pg_ledger: Ledger, tmp_path: Path
) -> None:
    earlier = Ledger(pg_url, clock=ManualClock(datetime.now(UTC) - timedelta(seconds=120)))
    earlier.create_budget("acme", 1000)
    earlier.calls.reserve("acme", "flagged", 10)
    earlier.calls.mark_sending("flagged")
    beat = Ledger(pg_url)  # the beat job of an app whose budget_stale_after is 60 s
    assert [h.key for h in beat.upkeep.flag_stale(timedelta(seconds=60))] == ["flagged"]
    earlier.calls.reserve("acme", "unflagged", 10)  # as old, sent after beat's last run
    earlier.calls.mark_sending("unflagged")
    earlier.dispose()
    beat.dispose()
    home = write_app(tmp_path, pg_url, stale_after=60)

    def stale(*args: str, **env: str) -> list[str]:
        done = command(*args, "holds", "--stale", "--json", cwd=home, **env)
        assert done.returncode == 0, done.stderr
        return [h["key"] for h in json.loads(done.stdout)]

    url = {"BUDGET_TASKS_LEDGER_URL": pg_url}
    assert stale(**url) == ["flagged"]  # 900 s by default, and beat flagged it
    assert stale(**url, BUDGET_TASKS_STALE_AFTER="60") == ["flagged", "unflagged"]
    assert stale("-A", "myapp") == ["flagged", "unflagged"]  # its budget_stale_after
    assert stale("-A", "myapp", BUDGET_TASKS_STALE_AFTER="900") == ["flagged"]


def test_a_budget_without_a_period_says_so(pg_url: str, pg_ledger: Ledger) -> None:
    made = command("budget", "create", "plain", "--cap", "5usd", "--ledger-url", pg_url)
    assert made.stdout == "created budget plain: cap $5.00, no period\n"
    assert command("budget", "show", "plain", "--ledger-url", pg_url).stdout == (
        "budget plain (no period)\nall time: cap $5.00, spent $0.00, held $0.00, available $5.00\n"
        "open holds: 0\n"
    )
    daily = command(
        "budget", "create", "daily", "--cap", "5", "--period", "day", "--ledger-url", pg_url
    )
    assert daily.stdout == "created budget daily: cap $0.000005 per day\n"
    shown = command("budget", "show", "daily", "--ledger-url", pg_url).stdout.splitlines()
    assert shown[0] == "budget daily (period day, renewal reset)"
    assert shown[1].startswith("period from 20")


def test_providers_lists_what_bills_and_price_shows_a_models_rates() -> None:
    """What an operator asks before a deploy: is this endpoint metered, and at what
    price does a snapshot settle."""
    import json as _json

    from click.testing import CliRunner

    from budget_tasks.cli import main

    runner = CliRunner()
    done = runner.invoke(main, ["providers", "--vendor", "openai", "--json"])
    assert done.exit_code == 0, done.output
    rules = _json.loads(done.output)
    metered = {r["endpoint"] for r in rules if r["kind"] == "metered"}
    assert {"openai.chat", "openai.embeddings", "openai.images"} <= metered
    assert any(r["kind"] == "refused" and "batches" in r["pattern"] for r in rules)
    done = runner.invoke(main, ["price", "claude-haiku-4-5-20251001", "--vendor", "anthropic"])
    assert done.exit_code == 0 and "1000000" in done.output  # $1 per million input tokens
    batch = runner.invoke(
        main, ["price", "claude-haiku-4-5", "--vendor", "anthropic", "--batch", "--json"]
    )
    assert _json.loads(batch.output)["input"] == 500_000
    unknown = runner.invoke(main, ["price", "no-such-model", "--vendor", "openai"])
    assert unknown.exit_code == 2 and "no price" in unknown.output
    assert runner.invoke(main, ["providers", "--vendor", "nosuch"]).exit_code == 2


def test_holds_of_an_unknown_budget_is_an_error_not_an_empty_table(
    pg_url: str, pg_ledger: Ledger
) -> None:
    ok(pg_url, "budget", "create", "acme", "--cap", "100")
    done = cli(pg_url, "holds", "--budget", "nosuch")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: unknown budget 'nosuch'"
    assert done.stdout == ""
    assert "attempt" in ok(pg_url, "holds", "--budget", "acme")  # a known one: its table


def test_the_ledger_url_may_come_before_the_command_and_wins_over_the_environment(
    pg_url: str, pg_ledger: Ledger, tmp_path: Path
) -> None:
    ok(pg_url, "budget", "create", "acme", "--cap", "100")
    elsewhere = f"sqlite:///{tmp_path}/other.db"
    ok(elsewhere, "db", "upgrade")  # the environment names another, empty, ledger
    before = ok(elsewhere, "--ledger-url", pg_url, "budget", "list")
    after = ok(elsewhere, "budget", "list", "--ledger-url", pg_url)
    assert "acme" in before and before == after
    assert "acme" not in ok(elsewhere, "budget", "list")


def test_usage_errors_are_one_line_and_exit_2(pg_url: str) -> None:
    for args, says in [
        (("budget", "create", "acme"), "Missing option '--cap'"),
        (("budget", "create"), "Missing argument 'NAME'"),
        (("holds", "--nosuch"), "No such option '--nosuch'"),
        (("nosuch",), "No such command 'nosuch'"),
    ]:
        done = cli(pg_url, *args)
        assert done.returncode == 2, args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (
            args,
            done.stderr,
        )
        assert lines[0].endswith("--help)")
    assert cli(pg_url, "--help").returncode == 0


def test_reading_a_sqlite_ledger_that_is_not_there_does_not_create_it(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.db"
    for args in (("status",), ("holds",), ("budget", "list"), ("audit",)):
        done = cli(f"sqlite:///{fresh}", *args)
        assert done.returncode == 2, args
        assert "no ledger database at" in done.stderr and "db upgrade" in done.stderr
        assert not fresh.exists(), args
    ok(f"sqlite:///{fresh}", "db", "upgrade")  # the one command that makes it
    assert fresh.exists()
    assert ok(f"sqlite:///{fresh}", "status").startswith("budget")


def test_a_frozen_parent_shows_on_its_children(pg_url: str, pg_ledger: Ledger) -> None:
    ok(pg_url, "budget", "create", "org", "--cap", "1000")
    ok(pg_url, "budget", "create", "team", "--cap", "500", "--parent", "org")
    ok(pg_url, "budget", "create", "squad", "--cap", "100", "--parent", "team")
    ok(pg_url, "budget", "freeze", "org")
    listed = {b["name"]: b for b in as_json(pg_url, "budget", "list")}
    assert {name: b["frozen_by"] for name, b in listed.items()} == {
        "org": "org",
        "team": "org",
        "squad": "org",
    }
    assert listed["squad"]["frozen"] is False  # its own flag is unchanged
    table = ok(pg_url, "budget", "list")
    assert [line.split()[-1] for line in table.splitlines()[2:]] == ["yes", "org", "org"]
    assert "FROZEN by org" in ok(pg_url, "budget", "show", "squad")
    assert "squad (frozen by org)" in ok(pg_url, "status")
    ok(pg_url, "budget", "unfreeze", "org")
    ok(pg_url, "budget", "freeze", "team")
    listed = {b["name"]: b["frozen_by"] for b in as_json(pg_url, "budget", "list")}
    assert listed == {"org": None, "team": "team", "squad": "team"}


def test_every_option_of_budget_create_says_what_it_does_and_budget_help_names_set_cap() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", "budget", "create", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--period", "--parent", "--tenant", "--renewal", "--rollover-ceiling"):
        line = next(line for line in done.stdout.splitlines() if line.strip().startswith(option))
        described = done.stdout.split(option, 1)[1].split("\n  --", 1)[0]
        assert len(described.split()) > 3, (option, line)
    # the ceiling a rollover budget gets when none is given, as the ledger applies it
    from budget_tasks.ledger.periods import DEFAULT_ROLLOVER_MULTIPLE

    ceiling = " ".join(done.stdout.split("--rollover-ceiling", 1)[1].split("\n  --", 1)[0].split())
    assert f"default: {DEFAULT_ROLLOVER_MULTIPLE}x the cap" in ceiling, ceiling
    group = subprocess.run(
        [sys.executable, "-m", "budget_tasks.cli", "budget", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "set their caps" in group.stdout and "set-cap" in group.stdout


def test_operations_list_show_and_reopen_a_failed_one(pg_url: str, pg_ledger: Ledger) -> None:
    """A run that failed for good (a user's bug after a billed call) is listed, shown
    with its attempts and journal, reopened with a reason (recorded), and then run by
    its next delivery. An operation that did not fail, or that still holds money, is
    not reopened."""
    from budget_tasks.delivery.flow import Delivery, OperationManager
    from budget_tasks.delivery.options import DeliveryOptions
    from budget_tasks.ledger.leases import owner_id

    ledger = Ledger(pg_url)
    ledger.create_budget("team", 1_000_000)
    manager = OperationManager(ledger.calls, DeliveryOptions(task="jobs.summarize"))
    runs: list[str] = []

    def broken(scope: Any) -> Any:
        runs.append("broken")
        scope.record_usage(300)  # the call under the main attempt billed 300
        raise ValueError("the user's bug")

    def fixed(scope: Any) -> Any:
        runs.append("fixed")
        scope.record_usage(700)
        return "summary"

    def deliver(run: Any) -> Any:
        return manager.deliver(
            Delivery(key="doc-7", fingerprint="f", budget="team", estimate=lambda: 900, run=run)
        )

    with pytest.raises(ValueError, match="the user's bug"):
        deliver(broken)
    failed = as_json(pg_url, "operations", "list", "--status", "failed")
    assert [(o["key"], o["status"]) for o in failed] == [("doc-7", "failed")]
    assert as_json(pg_url, "operations", "list", "--status", "succeeded") == []
    shown = as_json(pg_url, "operations", "show", "doc-7")
    assert [(a["key"], a["state"], a["actual"]) for a in shown["attempts"]] == [
        ("doc-7#1", "settled", 300)  # billed, then the bug: settled at the bill
    ]
    assert [(e["kind"], e["held_delta"], e["spent_delta"]) for e in shown["journal"]] == [
        ("hold", 900, 0),
        ("charge", -900, 300),
    ]
    table = ok(pg_url, "operations", "show", "doc-7")
    assert "doc-7: failed" in table and "ValueError: the user's bug" in table

    reopened = as_json(pg_url, "operations", "reopen", "doc-7", "--reason", "bug fixed in 1.2")
    assert reopened["status"] == "retryable" and reopened["error"] is None
    [event] = as_json(pg_url, "operations", "show", "doc-7")["events"]
    assert (event["kind"], event["from_status"], event["to_status"], event["by"]) == (
        "reopen",
        "failed",
        "retryable",
        f"{getpass.getuser()}@{socket.gethostname()}",  # who ran the command
    )
    assert event["note"] == "bug fixed in 1.2"
    assert deliver(fixed) == "summary"
    assert runs == ["broken", "fixed"]
    assert ledger.operation("doc-7").status == "succeeded"
    assert [(a.key, a.state, a.reason) for a in ledger.attempts()] == [
        ("doc-7#1", "settled", "first"),
        ("doc-7#2", "settled", "manual"),
    ]

    again = cli(pg_url, "operations", "reopen", "doc-7", "--reason", "x")
    assert again.returncode == 2
    assert "cannot be reopened: it is succeeded" in again.stderr
    # a failed operation whose call is still unknown holds money: not reopened
    owner = owner_id()
    start = ledger.calls.admit(
        "doc-8", fingerprint="f", owner=owner, lease=timedelta(minutes=5), max_runs=3
    )
    ledger.calls.reserve("team", "doc-8#1", 500, operation_id=start.operation_id)
    ledger.calls.mark_sending("doc-8#1")
    ledger.calls.mark_unknown("doc-8#1", "read timeout")
    ledger.calls.end_run("doc-8", owner=owner, status="failed")
    held = cli(pg_url, "operations", "reopen", "doc-8", "--reason", "x")
    assert held.returncode == 2
    assert "its call doc-8#1 still holds money" in held.stderr
    assert cli(pg_url, "operations", "show", "nope").stderr.strip() == (
        "error: unknown operation 'nope'"
    )
    ledger.dispose()


def test_fake_provider_serves_the_official_sdk_offline() -> None:
    """`budget-tasks fake-provider` says how to point the SDKs at it, and answers them."""
    import openai

    server = subprocess.Popen(
        [sys.executable, "-m", "budget_tasks.cli", "fake-provider", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline() for _ in range(3)]
        exports = dict(pair.split("=", 1) for line in lines[1:] for pair in line.split()[1:])
        assert set(exports) == {
            "OPENAI_BASE_URL",
            "OPENAI_API_KEY",
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_API_KEY",
        }
        client = openai.OpenAI(
            base_url=exports["OPENAI_BASE_URL"], api_key=exports["OPENAI_API_KEY"], max_retries=0
        )
        answer = client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=8,
            messages=[{"role": "user", "content": "offline"}],
        )
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert "RuntimeWarning" not in (server.stderr.read() if server.stderr else "")


def test_an_escrowed_budget_is_made_and_its_grants_shown(backend_url: str) -> None:
    ok(backend_url, "budget", "create", "org", "--cap", "800")
    ok(backend_url, "budget", "create", "crew", "--cap", "500", "--parent", "org", "--escrow")
    Ledger(backend_url).calls.reserve("crew", "k1", 10)
    shown = ok(backend_url, "budget", "show", "crew")
    assert "parent org, escrow" in shown
    assert "held $0.00001, drawn $0.0001, available $0.00049" in shown
    # the parent shows its tenant's hold; what the grant holds unused is available
    shown = ok(backend_url, "budget", "show", "org")
    assert "held $0.00001, unused grants below $0.00009, available $0.00079" in shown
    rows = {r["budget"]: r for r in as_json(backend_url, "status")}
    assert (rows["org"]["held"], rows["org"]["granted"], rows["org"]["available"]) == (10, 90, 790)
    assert (rows["crew"]["drawn"], rows["crew"]["held"]) == (100, 10)
    refused = cli(backend_url, "budget", "create", "solo", "--cap", "5", "--escrow")
    assert refused.returncode != 0
    assert "escrow needs a parent" in refused.stderr


def test_a_sliced_budget_is_made_shown_and_resliced(backend_url: str) -> None:
    ok(backend_url, "budget", "create", "hot", "--cap", "800", "--slices", "4")
    assert "4 slices" in ok(backend_url, "budget", "show", "hot")
    assert [b["name"] for b in as_json(backend_url, "budget", "list")] == ["hot"]
    assert "hot: 8 slices" in ok(backend_url, "budget", "set-slices", "hot", "8")
    refused = cli(backend_url, "budget", "set-slices", "hot", "0")
    assert refused.returncode != 0
    assert "slices must be" in refused.stderr


def test_the_demo_without_the_openai_sdk_says_so_in_one_line() -> None:
    # the package installed without its openai extra: the SDK cannot be imported
    without_sdk = (
        "import runpy, sys; sys.modules['openai'] = None; "
        "sys.argv = ['budget-tasks', 'demo']; "
        "runpy.run_module('budget_tasks.cli', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", without_sdk], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "error: the demo's workers call the fake provider through the official openai SDK, "
        "which is not installed here: pip install 'budget-tasks[openai]'"
    ]
    assert done.stdout == ""  # nothing ran: no worker, no ledger


# -- issue 43: the front door -------------------------------------------------------------


def test_db_current_and_check_say_where_the_schema_is(tmp_path: Path) -> None:
    from budget_tasks import migrations

    head = migrations.head()
    url = f"sqlite:///{tmp_path}/ledger.db"
    assert "no ledger database" in one_line_error(command("db", "current", "--ledger-url", url))
    behind = f"{int(head) - 1:04d}"
    command("db", "upgrade", "--revision", behind, "--ledger-url", url)
    shown = command("db", "current", "--ledger-url", url)
    assert shown.returncode == 0
    assert shown.stdout == f"ledger schema at revision {behind}; this release's head is {head}\n"
    checked = command("db", "check", "--ledger-url", url)
    assert checked.returncode == 1 and checked.stdout == ""
    assert f"not this release's head {head}: run budget-tasks db upgrade" in checked.stderr
    command("db", "upgrade", "--ledger-url", url)
    assert command("db", "current", "--ledger-url", url).stdout == (
        f"ledger schema at revision {head} (head)\n"
    )
    checked = command("db", "check", "--ledger-url", url)
    assert (checked.returncode, checked.stdout) == (0, f"ledger schema at head ({head})\n")


def test_db_check_on_a_database_never_migrated_exits_1(pg_url: str) -> None:
    with scratch_database("bt_never") as url:
        checked = command("db", "check", "--ledger-url", url)
        assert checked.returncode == 1
        assert "at no revision, not this release's head" in checked.stderr
        shown = command("db", "current", "--ledger-url", url).stdout
        assert shown.startswith("ledger schema not migrated")


def test_celery_runs_the_cli_as_its_budget_sub_command(
    tmp_path: Path, pg_url: str, pg_ledger: Ledger
) -> None:
    """`celery -A myapp budget ...` through Celery's own entry point: the ledger from the
    app's budget_ledger_url, the library's errors one line and exit 2."""
    write_app(tmp_path, pg_url)
    pg_ledger.create_budget("via-celery", 2_500_000)
    celery = str(Path(sys.executable).with_name("celery"))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "BUDGET_TASKS_LEDGER_URL"}
        return subprocess.run(
            [celery, "-A", "myapp", "budget", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
            check=False,
        )

    shown = run("status")
    assert shown.returncode == 0, shown.stderr
    assert "via-celery  $2.50" in shown.stdout
    shown_json = json.loads(run("budget", "show", "via-celery", "--json").stdout)
    assert shown_json["budget"]["cap"] == 2_500_000
    missing = run("budget", "show", "nope")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == ["error: unknown budget 'nope'"]


def test_holds_leave_out_holds_of_zero_unless_all(pg_url: str, pg_ledger: Ledger) -> None:
    pg_ledger.create_budget("acme", 10_000)
    pg_ledger.calls.reserve("acme", "main-0", 0)
    pg_ledger.calls.reserve("acme", "call-1", 1)  # one micro-dollar: the least shown
    listed = ok(pg_url, "holds")
    assert "call-1" in listed and "$0.000001" in listed and "main-0" not in listed
    everything = ok(pg_url, "holds", "--all")
    assert "main-0" in everything and "call-1" in everything
    assert [h["key"] for h in as_json(pg_url, "holds", "--all")] == ["main-0", "call-1"]


def test_money_is_typed_in_dollars_or_micro_usd_and_the_two_agree(
    pg_url: str, pg_ledger: Ledger
) -> None:
    ok(pg_url, "budget", "create", "in-dollars", "--cap", "12.345678usd")
    ok(pg_url, "budget", "create", "in-micros", "--cap", "12345678")
    ok(pg_url, "budget", "create", "quoted", "--cap", "$12.345678")
    caps = {b["name"]: b["cap"] for b in as_json(pg_url, "budget", "list")}
    assert caps == {"in-dollars": 12_345_678, "in-micros": 12_345_678, "quoted": 12_345_678}
    assert "$12.345678" in ok(pg_url, "status")
    pg_ledger.calls.reserve("in-dollars", "k", 1_000_000)
    pg_ledger.calls.mark_sending("k")
    pg_ledger.calls.mark_unknown("k", "timeout")
    done = ok(pg_url, "resolve", "k", "--actual", "0.75usd", "--note", "invoice")
    assert "charged $0.75" in done
    assert pg_ledger.attempt("k").actual == 750_000
    fixed = ok(pg_url, "adjust", "k", "--delta", "-0.25usd", "--reason", "credit", "--ref", "c1")
    assert "-$0.25" in fixed and pg_ledger.balance("in-dollars").spent == 500_000


@pytest.mark.parametrize("escrow", [False, True], ids=["plain", "escrow"])
def test_a_tenant_shows_what_its_parent_lets_it_admit_and_exactly_that_is_admitted(
    pg_url: str, pg_ledger: Ledger, escrow: bool
) -> None:
    """Two tenants of 2,000,000 under a parent of 3,000,000: once one spent 1,500,000
    the other's own available stays near 2,000,000, but it can admit only what the
    parent has left, and `status` says so."""
    pg_ledger.create_budget("org", 3_000_000)
    for tenant in ("t1", "t2"):
        pg_ledger.create_budget(tenant, 2_000_000, parent="org", escrow=escrow)
    calls = pg_ledger.calls
    calls.reserve("t1", "k1", 1_500_000)
    calls.mark_sending("k1")
    calls.settle("k1", 1_500_000)
    calls.reserve("t2", "k2", 100)
    rows = {r["budget"]: r for r in as_json(pg_url, "status")}
    assert rows["org"]["spent"] == 1_500_000 and rows["org"]["held"] == 100  # rolled up
    assert (rows["t2"]["available"], rows["t2"]["usable"]) == (1_999_900, 1_499_900)
    assert rows["t1"]["usable"] == 500_000  # its own cap is the tighter
    shown = ok(pg_url, "budget", "show", "t2")
    assert "available $1.9999, usable $1.4999" in shown
    assert as_json(pg_url, "budget", "show", "t2")["usable"] == 1_499_900
    assert ", usable" not in ok(pg_url, "budget", "show", "t1")  # said only where it differs
    assert "$1.4999" in ok(pg_url, "status")
    with pytest.raises(BudgetExceeded):
        calls.reserve("t2", "one-more", 1_499_901)
    calls.reserve("t2", "exactly", 1_499_900)
    assert {r["budget"]: r["usable"] for r in as_json(pg_url, "status")} == {
        "org": 0,
        "t1": 0,
        "t2": 0,
    }
    calls.release("exactly", "not sent")
    pg_ledger.freeze("org")  # a frozen parent admits nothing below it
    assert {r["budget"]: r["usable"] for r in as_json(pg_url, "status")}["t2"] == 0
