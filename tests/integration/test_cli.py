"""The operator CLI driven as a subprocess, as an operator or a script would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from sqlalchemy import text

from budget_tasks import Ledger


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
    ledger.reserve("support", "call-1", 20_000)
    ledger.mark_sending("call-1", request_id="req_77")
    ledger.mark_unknown("call-1", "read timeout")
    ledger.reserve("support", "call-2", 5_000)
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
        (("budget", "create", "x", "--cap", "-5"), "must not be negative"),
        (("budget", "create", "acme", "--cap", "5"), "already exists"),
        (("resolve", "nope", "--actual", "1", "--note", "x"), "unknown attempt 'nope'"),
        (("budget", "create", "y", "--cap", "1.5"), "is not a valid integer"),
    ]:
        done = cli(pg_url, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
    unreachable = cli("postgresql+psycopg://postgres@127.0.0.1:1/none", "status")
    assert unreachable.returncode == 2
    assert "ledger unavailable" in unreachable.stderr


def test_caps_corrections_and_freezes_from_the_cli(pg_url: str, pg_ledger: Ledger) -> None:
    ok(pg_url, "budget", "create", "acme", "--cap", "1000")
    pg_ledger.reserve("acme", "call-1", 600)
    pg_ledger.mark_sending("call-1")
    pg_ledger.settle("call-1", 600)
    raised = as_json(pg_url, "budget", "set-cap", "acme", "--cap", "2000", "--note", "Q4 deal")
    assert (raised["name"], raised["cap"]) == ("acme", 2000)
    assert "cap 2000 -> 600" in ok(pg_url, "budget", "set-cap", "acme", "--cap", "600")
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
