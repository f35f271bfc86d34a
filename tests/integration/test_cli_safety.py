"""The operator CLI, driven as a subprocess, against what it must not trust (names and
keys with control characters) and what it must record (who acted, and why)."""

from __future__ import annotations

import getpass
import socket
from typing import Any

import pytest
from sqlalchemy import text

from budget_tasks import Ledger
from budget_tasks.delivery.flow import Delivery, OperationManager
from budget_tasks.delivery.options import DeliveryOptions

from .test_cli import as_json, cli, ok

#: what a hostile name carries: clear the screen, a fake row, a right-to-left override
HOSTILE = "evil\x1b[2J\nfake-row  999  none\u202e"


def _legacy_budget(ledger: Ledger, name: str) -> None:
    """A budget whose name came in before names were checked (an older release, a
    hand-written row): the CLI must still print it safely."""
    ledger.create_budget("plain", 1_000)
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE budgets SET name = :n WHERE name = 'plain'"), {"n": name})


def test_no_control_character_from_the_ledger_reaches_the_terminal(
    pg_url: str, pg_ledger: Ledger
) -> None:
    _legacy_budget(pg_ledger, HOSTILE)
    pg_ledger.create_budget("team", 1_000)
    pg_ledger.calls.reserve("team", "held", 100)
    pg_ledger.calls.mark_sending("held")
    pg_ledger.calls.mark_unknown("held", "timed out")
    note = "the gateway said \x1b]0;pwned\x07 and"
    pg_ledger.resolve_attempt("held", 90, note=note, by="operator", actor="ana")
    for args in (("budget", "list"), ("holds",), ("budget", "show", "team"), ("actions",)):
        out = ok(pg_url, *args)
        assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    listed = ok(pg_url, "budget", "list")
    # a header, its rule and one line per budget: the name's line break faked no row
    assert len(listed.splitlines()) == 4
    assert "evil\\x1b[2J\\nfake-row" in listed and "\\u202e" in listed
    assert "\\x1b]0;pwned\\x07" in ok(pg_url, "actions")
    # an error naming it is one line, escaped too
    done = cli(pg_url, "budget", "show", "evil\x1bX")
    assert done.returncode == 2 and "\x1b" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["two\nlines", "esc\x1b[2J", "bell\x07"])
def test_a_budget_name_with_control_characters_is_refused(pg_url: str, name: str) -> None:
    done = cli(pg_url, "budget", "create", name, "--cap", "100")
    assert done.returncode == 2
    assert "budget name must be printable" in done.stderr
    assert "\x1b" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _failed_operation(ledger: Ledger) -> None:
    manager = OperationManager(ledger.calls, DeliveryOptions(task="jobs.summarize"))

    def broken(scope: Any) -> Any:
        scope.record_usage(300)
        raise ValueError("the user's bug")

    with pytest.raises(ValueError, match="the user's bug"):
        manager.deliver(
            Delivery(key="doc-9", fingerprint="f", budget="team", estimate=lambda: 900, run=broken)
        )


def test_every_operator_action_is_a_journal_row_naming_who_and_why(
    pg_url: str, pg_ledger: Ledger
) -> None:
    """resolve, set-cap, adjust, freeze, unfreeze and reopen, each from the CLI: each
    is a journal row with its actor (--by, or the OS user and host) and its reason,
    listed by `actions`; the audit still proves the counters."""
    me = f"{getpass.getuser()}@{socket.gethostname()}"
    pg_ledger.create_budget("team", 10_000)
    pg_ledger.calls.reserve("team", "held", 100)
    pg_ledger.calls.mark_sending("held")
    pg_ledger.calls.mark_unknown("held", "timed out")
    _failed_operation(pg_ledger)

    ok(pg_url, "resolve", "held", "--actual", "80", "--note", "invoice line 7", "--by", "ana")
    ok(pg_url, "budget", "set-cap", "team", "--cap", "20000", "--note", "Q4 growth")
    ok(pg_url, "adjust", "held", "--delta", "5", "--reason", "credit note 12", "--by", "bo")
    ok(pg_url, "budget", "freeze", "team", "--note", "runaway agent", "--by", "cy")
    ok(pg_url, "budget", "unfreeze", "team", "--note", "agent fixed")
    ok(pg_url, "operations", "reopen", "doc-9", "--reason", "bug fixed", "--by", "di")

    done = as_json(pg_url, "actions")
    assert [(e["kind"], e["actor"], e["note"]) for e in done] == [
        ("reopen", "di", "bug fixed"),
        ("unfreeze", me, "agent fixed"),
        ("freeze", "cy", "runaway agent"),
        ("adjustment", "bo", "credit note 12"),
        ("cap", me, "Q4 growth"),
        ("charge", "ana", "operator: invoice line 7"),
    ]
    assert done[3]["attempt"] == "held" and done[0]["attempt"] is None
    table = ok(pg_url, "actions", "--budget", "team")
    assert "runaway agent" in table and "cy" in table
    # a run's own rows name no actor: only operators' rows are listed
    with pg_ledger.engine.connect() as conn:
        runs = conn.execute(text("SELECT count(*) FROM journal WHERE actor IS NULL")).scalar()
    assert runs and runs > 0
    assert pg_ledger.audit() == []
