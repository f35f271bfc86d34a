"""`budget-tasks dashboard` over HTTP (Starlette's TestClient) on a PostgreSQL ledger
filled by real work: what each view shows, its JSON and CSV, and that a write needs
the token and this site's form, or gets 403 and writes nothing."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from click.testing import CliRunner
from starlette.testclient import TestClient

from budget_tasks import Ledger
from budget_tasks.cli import main
from budget_tasks.dashboard import create_app
from budget_tasks.testing import ManualClock

from .dashboard_ledger import fill, journal_rows

TOKEN = "op-token-7f3a"
ORIGIN = "http://testserver"


@pytest.fixture
def filled(pg_ledger: Ledger, clock: ManualClock) -> Ledger:
    fill(pg_ledger, clock)
    return pg_ledger


@pytest.fixture
def web(filled: Ledger) -> Iterator[TestClient]:
    with TestClient(create_app(filled, token=TOKEN)) as client:
        yield client


def csrf_of(html: str, attempt: str) -> str:
    form = re.search(
        rf'name="attempt" value="{re.escape(attempt)}">\s*<input type="hidden" name="csrf" '
        r'value="([^"]+)"',
        html,
    )
    assert form is not None, f"no resolve form for {attempt}"
    return form.group(1)


def journal_of(ledger: Ledger, key: str) -> list[tuple[Any, ...]]:
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT j.kind, j.held_delta, j.spent_delta, j.note, j.actor FROM journal j "
                "JOIN attempts a ON a.id = j.attempt_id WHERE a.key = :key ORDER BY j.id"
            ),
            {"key": key},
        ).all()
    return [tuple(r) for r in rows]


def test_budgets_show_spent_held_available_burn_and_overruns(web: TestClient) -> None:
    budgets = web.get("/api/budgets").json()
    assert [(b["budget"], b["depth"]) for b in budgets] == [
        ("acme", 0),
        ("acme-support", 1),  # the tenant under its parent
        ("research", 0),
    ]
    support = budgets[1]
    assert (support["cap"], support["spent"], support["held"], support["available"]) == (
        400_000,
        56_000,
        40_000,
        304_000,
    )
    # settled: 50k estimated charged 30k, 20k charged 26k (an overrun of 6k)
    assert (support["settled"], support["estimated"], support["charged"]) == (2, 70_000, 56_000)
    assert (support["overruns"], support["overrun"], support["actual_to_estimate"]) == (
        1,
        6_000,
        0.8,
    )
    # 56k in the 13h10m of today's period: the rest lasts past midnight
    assert support["window_s"] == 13 * 3600 + 10 * 60
    assert support["burn"]["per_hour"] == 56_000 * 3600 // support["window_s"]
    assert support["burn"]["before_period_end"] is False
    acme = budgets[0]
    assert (acme["spent"], acme["held"], acme["settled"], acme["overruns"]) == (
        56_000,
        40_000,
        2,
        1,
    )
    assert acme["burn"]["before_period_end"] is True  # within the month at this rate
    research = budgets[2]
    assert (research["spent"], research["held"]) == (700 + 300, 15_000 + 10_000 + 5_000)
    # no period: 1000 in the last 24h, and no period end to reach the cap before
    assert research["burn"]["per_hour"] == 1_000 // 24
    assert research["burn"]["before_period_end"] is None

    page = web.get("/").text
    bars = re.findall(r'<tr class="budget" data-budget="([^"]+)">.*?</svg>', page, re.S)
    assert bars == ["acme", "acme-support", "research"]
    support_bar = re.search(r'data-budget="acme-support">.*?</svg>', page, re.S)
    assert support_bar is not None
    # spent 56k, held 40k, available 304k of a 400k cap: 14%, 10%, 76%
    assert re.findall(r'<rect class="(\w+)" x="[\d.]+" y="0" width="([\d.]+)"', support_bar[0]) == [
        ("spent", "14.0"),
        ("held", "10.0"),
        ("available", "76.0"),
    ]
    assert "$0.056" in page and "before the period ends" in page


def test_holds_worklist_attempt_and_operations(web: TestClient) -> None:
    holds = web.get("/api/holds").json()
    assert [
        (h["attempt"], h["state"], h["provider"], h["model"], h["request_id"])
        for h in holds["holds"]
    ] == [
        ("claude-1", "unknown", "anthropic", "claude-haiku-4-5", "req_ant_1"),
        ("claude-2", "unknown", "anthropic", "claude-haiku-4-5", "req_ant_2"),
        ("gpt-1", "unknown", "openai", "gpt-4o-mini", "req_oai_9"),
        ("gpt-2", "reserved", None, None, None),
    ]
    assert holds["by_state_and_age"]["unknown"]["1-15m"] == 3
    assert holds["by_state_and_age"]["reserved"]["1-15m"] == 1
    summary = web.get("/api/holds/summary").json()
    assert [(r["state"], r["1-15m"], r["over 1d"]) for r in summary] == [
        ("unknown", 3, 0),
        ("reserved", 1, 0),
    ]

    # reconciliation can look the stored OpenAI chat up; not the Anthropic messages
    worklist = web.get("/api/worklist").json()
    assert [w["attempt"] for w in worklist] == ["claude-1", "claude-2"]
    assert "Anthropic Messages API has no lookup" in worklist[0]["why"]

    shown = web.get("/api/attempt", params={"key": "call-2"}).json()
    assert [
        (e["budget"], e["kind"], e["held_delta"], e["spent_delta"]) for e in shown["journal"]
    ] == [
        ("acme", "hold", 20_000, 0),  # the chain's rows in budget-id order
        ("acme-support", "hold", 20_000, 0),
        ("acme", "charge", -20_000, 26_000),
        ("acme-support", "charge", -20_000, 26_000),
    ]
    op = web.get("/api/attempt", params={"key": "doc-2#1"}).json()["operation"]
    assert (op["operation"], op["status"], [a["attempt"] for a in op["attempts"]]) == (
        "doc-2",
        "failed",
        ["doc-2#1"],
    )
    assert web.get("/api/attempt", params={"key": "nope"}).status_code == 404

    failed = web.get("/api/operations", params={"status": "failed"}).json()
    assert [(o["operation"], [a["actual"] for a in o["attempts"]]) for o in failed] == [
        ("doc-2", [300])
    ]
    assert "Reopen" in web.get("/operations").text
    assert web.get("/api/operations", params={"status": "bogus"}).status_code == 400

    spend = web.get("/api/spend", params={"budget": "acme-support", "bucket": "hour"}).json()
    assert [(p["at"][11:16], p["spent"], p["total"]) for p in spend["points"]] == [
        ("12:00", 56_000, 56_000)
    ]
    assert spend["cap"] == 400_000
    assert 'class="cap"' in web.get("/budget", params={"budget": "acme-support"}).text
    assert web.get("/api/spend", params={"budget": "nope"}).status_code == 404


def test_every_table_exports_as_csv(web: TestClient, filled: Ledger) -> None:
    filled.calls.reserve("research", "=HYPERLINK(1)", 1)  # a key a spreadsheet would run
    got = web.get("/api/holds", params={"format": "csv"})
    assert got.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(got.text)))
    assert [r["attempt"] for r in rows][-1] == "'=HYPERLINK(1)"
    assert rows[0]["request_id"] == "req_ant_1" and rows[0]["amount"] == "40000"
    for path, params in [
        ("/api/budgets", {}),
        ("/api/worklist", {}),
        ("/api/holds/summary", {}),
        ("/api/operations", {}),
        ("/api/spend", {"budget": "acme"}),
        ("/api/attempt", {"key": "call-1"}),
    ]:
        done = web.get(path, params={**params, "format": "csv"})
        assert done.status_code == 200 and done.text.count("\n") >= 2, path


def test_resolving_from_the_page_writes_what_the_cli_writes(
    web: TestClient, filled: Ledger, pg_url: str
) -> None:
    html = web.get("/").text
    done = web.post(
        "/resolve",
        data={
            "attempt": "claude-1",
            "actual": "0.037usd",  # dollars, as a person types them; the CLI below: micro-USD
            "note": "invoice 7",
            "by": "alice",
            "token": TOKEN,
            "csrf": csrf_of(html, "claude-1"),
        },
        headers={"origin": ORIGIN},
        follow_redirects=False,
    )
    assert done.status_code == 303, done.text
    page = web.get(done.headers["location"]).text
    assert "claude-1: unknown -&gt; settled, charged $0.037" in page
    # the CLI's resolve of its twin writes the same rows
    filled.calls.reserve("acme-support", "claude-9", 40_000)
    filled.calls.mark_sending("claude-9")
    filled.calls.mark_unknown("claude-9", "read timeout")
    cli = CliRunner().invoke(
        main,
        [
            "resolve",
            "claude-9",
            "--actual",
            "37000",
            "--note",
            "invoice 7",
            "--by",
            "alice",
            "--ledger-url",
            pg_url,
        ],
    )
    assert cli.exit_code == 0, cli.output
    page_rows = journal_of(filled, "claude-1")[-2:]
    assert page_rows == journal_of(filled, "claude-9")[-2:]
    assert page_rows == [
        ("charge", -40_000, 37_000, "operator: invoice 7", "alice"),
        ("charge", -40_000, 37_000, "operator: invoice 7", "alice"),
    ]  # one per budget in the chain


def _forbidden(web: TestClient, filled: Ledger, data: dict[str, str], **headers: str) -> None:
    before = journal_rows(filled)
    got = web.post("/resolve", data=data, headers=headers, follow_redirects=False)
    assert got.status_code == 403, (data, headers, got.text)
    assert journal_rows(filled) == before
    assert filled.attempt("claude-1").state == "unknown"


def test_a_write_without_the_token_or_from_another_site_is_refused(
    web: TestClient, filled: Ledger
) -> None:
    good = {
        "attempt": "claude-1",
        "actual": "1000",
        "note": "x",
        "token": TOKEN,
        "csrf": csrf_of(web.get("/").text, "claude-1"),
    }
    _forbidden(web, filled, {**good, "token": ""}, origin=ORIGIN)
    _forbidden(web, filled, {k: v for k, v in good.items() if k != "token"}, origin=ORIGIN)
    _forbidden(web, filled, {**good, "token": TOKEN + "x"}, origin=ORIGIN)
    _forbidden(web, filled, {**good, "csrf": ""}, origin=ORIGIN)
    # a token made for another attempt's form
    _forbidden(web, filled, {**good, "csrf": csrf_of(web.get("/").text, "claude-2")})
    _forbidden(web, filled, good, origin="http://evil.example")
    _forbidden(web, filled, good, **{"sec-fetch-site": "cross-site"})
    # the JSON API: the token as a bearer, JSON only
    before = journal_rows(filled)
    body = {"attempt": "claude-1", "actual": 1000, "note": "x"}
    assert web.post("/api/resolve", json=body).status_code == 403
    assert (
        web.post("/api/resolve", json=body, headers={"authorization": "Bearer no"}).status_code
        == 403
    )
    as_form = web.post(
        "/api/resolve", data={**body, "token": TOKEN}, headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert as_form.status_code == 403  # a cross-site form cannot send JSON
    assert journal_rows(filled) == before
    ok = web.post("/api/resolve", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.json() == {
        "attempt": "claude-1",
        "from": "unknown",
        "state": "settled",
        "actual": 1000,
        "applied": True,
        "operation": None,
        "operation_status": None,
    }
    assert journal_rows(filled) == before + 2
    # another actual now conflicts, and writes nothing
    again = web.post(
        "/api/resolve", json={**body, "actual": 5}, headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert again.status_code == 409 and "already settled" in again.json()["error"]
    # a hold never sent is released, never charged (as the CLI refuses it)
    never = web.post(
        "/api/resolve",
        json={"attempt": "gpt-2", "actual": 10, "note": "x"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert never.status_code == 409
    assert never.json()["error"] == (
        "gpt-2 was never sent (reserved): it can only be released (--actual 0)"
    )
    assert journal_rows(filled) == before + 2


def test_without_a_token_the_page_is_read_only(filled: Ledger) -> None:
    with TestClient(create_app(filled, token=None)) as web:
        page = web.get("/").text
        assert "claude-1" in page and 'action="/resolve"' not in page
        assert "read-only" in page
        before = journal_rows(filled)
        for token in ("", "anything"):
            got = web.post(
                "/resolve",
                data={"attempt": "claude-1", "actual": "1", "note": "x", "token": token},
                headers={"origin": ORIGIN},
            )
            assert got.status_code == 403
        got = web.post(
            "/api/resolve",
            json={"attempt": "claude-1", "actual": 1, "note": "x"},
            headers={"authorization": "Bearer anything"},
        )
        assert got.status_code == 403
        assert journal_rows(filled) == before


def test_a_failed_operation_is_reopened_from_the_page(web: TestClient, filled: Ledger) -> None:
    html = web.get("/operations", params={"status": "failed"}).text
    found = re.search(
        r'name="operation" value="doc-2">\s*<input type="hidden" name="csrf" value="([^"]+)"', html
    )
    assert found is not None
    form = {"operation": "doc-2", "reason": "bug fixed in 1.2", "token": TOKEN, "csrf": found[1]}
    assert web.post("/reopen", data={**form, "token": "no"}).status_code == 403
    assert filled.operation("doc-2").status == "failed"
    done = web.post("/reopen", data=form, headers={"origin": ORIGIN}, follow_redirects=False)
    assert done.status_code == 303
    assert filled.operation("doc-2").status == "retryable"
    [event] = filled.operation_history("doc-2").events
    assert (event.kind, event.note) == ("reopen", "bug fixed in 1.2")
    # a second reopen is refused by the ledger, as the CLI's
    again = web.post("/reopen", data=form, headers={"origin": ORIGIN})
    assert again.status_code == 409 and "cannot be reopened" in again.text


def test_only_local_host_names_are_served(web: TestClient) -> None:
    assert web.get("/", headers={"host": "rebound.example"}).status_code == 400
    assert web.get("/healthz", headers={"host": "127.0.0.1:8090"}).status_code == 200


def test_the_cli_serves_it_on_loopback_read_only_without_a_token(
    filled: Ledger, pg_url: str
) -> None:
    """`budget-tasks dashboard` as an operator runs it: uvicorn on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "BUDGET_TASKS_DASHBOARD_TOKEN"}
    server = subprocess.Popen(
        [sys.executable, "-m", "budget_tasks.cli", "dashboard", "--ledger-url", pg_url,
         "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/budgets", timeout=5) as answer:
                    budgets = json.load(answer)
                break
            except OSError:
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.2)
        assert [b["budget"] for b in budgets] == ["acme", "acme-support", "research"]
        before = journal_rows(filled)
        refused = urllib.request.Request(
            f"{base}/api/resolve",
            data=b'{"attempt": "claude-1", "actual": 1, "note": "x"}',
            headers={"content-type": "application/json", "authorization": "Bearer guess"},
        )
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(refused, timeout=5)
        assert error.value.code == 403
        assert journal_rows(filled) == before
    finally:
        server.terminate()
        _, said = server.communicate(timeout=20)
    assert f"dashboard on http://127.0.0.1:{port}/ (read-only" in said
