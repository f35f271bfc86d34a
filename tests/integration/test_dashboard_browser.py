"""The dashboard in a real browser (Debian's headless Chromium): the page served by
uvicorn on 127.0.0.1 shows the budgets, their bars and the holds, and one unknown
outcome is resolved through its form, which adds exactly one journal entry."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the dashboard extra is not installed")
pytest.importorskip("websocket", reason="websocket-client is not installed")

import uvicorn

from budget_tasks import Ledger
from budget_tasks.dashboard import create_app
from budget_tasks.testing import ManualClock

from ..browser import Browser, chromium_path
from .dashboard_ledger import fill, journal_rows

TOKEN = "browser-token-51c2"
#: Where to copy the page's screenshot as well (docs/dashboard.png is made this way).
SCREENSHOT_ENV = "BUDGET_TASKS_DASHBOARD_SCREENSHOT"


@pytest.fixture
def served(pg_ledger: Ledger, clock: ManualClock) -> Iterator[str]:
    fill(pg_ledger, clock)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        create_app(pg_ledger, token=TOKEN), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    chromium_path()  # skip (or fail under CI) before anything starts
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    found = Browser(profile)
    yield found
    found.close()


def test_the_page_shows_budgets_bars_and_holds_and_resolves_one_unknown_outcome(
    browser: Browser, served: str, pg_ledger: Ledger, tmp_path: Path
) -> None:
    browser.open(f"{served}/")
    budgets = browser.evaluate(
        "[...document.querySelectorAll('tr.budget')].map(r => [r.dataset.budget,"
        " [...r.querySelectorAll('svg.bar rect')].map(x => [x.getAttribute('class'),"
        " Math.round(x.getBBox().width)])])"
    )
    assert budgets == [
        ["acme", [["spent", 6], ["held", 4], ["available", 90]]],
        ["acme-support", [["spent", 14], ["held", 10], ["available", 76]]],
        ["research", [["spent", 1], ["held", 15], ["available", 85]]],
    ]
    # the bars are drawn: each is as wide as its cell, in pixels
    assert browser.evaluate(
        "document.querySelector('tr.budget svg.bar').getBoundingClientRect().width"
    ) == pytest.approx(260, abs=1)
    worklist = browser.evaluate(
        "[...document.querySelectorAll('tr.work')].map(r => r.dataset.attempt)"
    )
    assert worklist == ["claude-1", "claude-2"]
    held = browser.evaluate(
        "[...document.querySelectorAll('#holds-summary tr')].slice(1)"
        ".map(r => [...r.cells].map(c => c.textContent.trim()))"
    )
    assert held == [
        ["unknown", "0", "3", "0", "0", "0"],
        ["reserved", "0", "1", "0", "0", "0"],
    ]
    shot = browser.screenshot(tmp_path / "dashboard.png")
    assert shot.stat().st_size > 10_000
    keep = os.environ.get(SCREENSHOT_ENV)
    if keep:
        shutil.copyfile(shot, keep)

    browser.open(f"{served}/holds")
    holds = browser.evaluate(
        "[...document.querySelectorAll('tr.hold')].map(r => [r.dataset.attempt,"
        " r.cells[2].textContent.trim(), r.cells[7].textContent.trim()])"
    )
    assert holds[0] == ["claude-1", "unknown", "req_ant_1"] and len(holds) == 4

    browser.open(f"{served}/budget?budget=acme-support")
    chart = browser.evaluate(
        "[document.querySelectorAll('svg.spend rect.bucket').length,"
        " document.querySelector('svg.spend line.cap').getBBox().width,"
        " document.querySelector('svg.spend polyline.total').points.length]"
    )
    # one bucket, the cap across the chart, the running total as a step (4 points)
    assert chart[0] == 1 and chart[1] > 600 and chart[2] == 4
    browser.screenshot(tmp_path / "spend.png")

    # resolve claude-2 (a budget without a parent: one journal entry) through its form,
    # its actual typed in dollars
    browser.open(f"{served}/")
    before = journal_rows(pg_ledger)
    form = "document.querySelector('tr.work[data-attempt=\"claude-2\"] form.resolve')"
    browser.evaluate(
        f"(() => {{ const f = {form};"
        " f.actual.value = '0.012usd'; f.note.value = 'invoice 42'; f.by.value = 'alice';"
        f" f.token.value = {json.dumps(TOKEN)}; f.requestSubmit(); }})()"
    )
    browser.wait_for("location.pathname === '/attempt' && document.readyState === 'complete'")
    assert browser.evaluate("document.getElementById('state').textContent") == "settled"
    assert "claude-2: unknown -> settled, charged $0.012" in browser.evaluate(
        "document.getElementById('done').textContent"
    )
    browser.screenshot(tmp_path / "resolved.png")
    assert journal_rows(pg_ledger) == before + 1
    entry = pg_ledger.views.attempt_journal("claude-2")[-1]
    assert (entry.kind, entry.spent_delta, entry.held_delta, entry.note, entry.actor) == (
        "charge",
        12_000,
        -15_000,
        "operator: invoice 42",
        "alice",
    )
    assert pg_ledger.attempt("claude-1").state == "unknown"  # the other waits still
