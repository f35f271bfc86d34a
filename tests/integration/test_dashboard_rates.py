"""The dashboard's "Rate limits" section and its endpoint over HTTP (Starlette's
TestClient) on a PostgreSQL ledger: each window's limit, what it holds after known
takes (on the ledger's manual clock), the calls booked ahead, read live."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient

from budget_tasks import Ledger
from budget_tasks.dashboard import create_app
from budget_tasks.errors import RateWindowFull
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger.records import RateAsk, RateClaim
from budget_tasks.testing import ManualClock

MINI = RateClaim("openai", ("gpt-4o-mini",), RateAsk(requests=1))


@pytest.fixture
def rated(pg_ledger: Ledger) -> Ledger:
    """60,000 tokens a minute with 1,200 taken; 3 requests a minute taken by three
    calls and a fourth booked ahead (the window owes it); Anthropic's output untouched."""
    rates = pg_ledger.rates
    rates.set_limit("openai", "gpt-4o-mini", "requests", 3)
    rates.set_limit("openai", "gpt-4o-mini", "tokens", 60_000)
    rates.set_limit("anthropic", "*", "output_tokens", 8_000)
    assert rates.take("openai", "gpt-4o-mini", RateAsk(requests=0, tokens=1_200)).granted
    pg_ledger.create_budget("team", 1_000_000)
    for n in range(3):
        pg_ledger.calls.reserve("team", f"k{n}", 100, grant=CallFacts(rate=MINI))
    with pytest.raises(RateWindowFull):
        pg_ledger.calls.reserve("team", "k3", 100, grant=CallFacts(rate=MINI))
    return pg_ledger


@pytest.fixture
def web(rated: Ledger) -> Iterator[TestClient]:
    with TestClient(create_app(rated)) as client:
        yield client


def section(html: str) -> str:
    found = re.search(r'<section id="rates">.*?</section>', html, re.S)
    assert found is not None, "no rate limits section"
    return found.group(0)


def rows(html: str) -> list[tuple[str, ...]]:
    """Each window's row as its cells' text."""
    out = []
    for cells in re.findall(r'<tr class="rate" [^>]*>(.*?)</tr>', section(html), re.S):
        texts = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td.*?</td>", cells)]
        out.append(tuple(texts))
    return out


def test_the_endpoint_lists_each_window_with_what_it_holds_and_owes(web: TestClient) -> None:
    assert web.get("/api/rates").json() == [
        {
            "provider": "anthropic",
            "scope": "*",
            "kind": "output_tokens",
            "per_minute": 8_000,
            "available": 8_000.0,
            "booked": 0,
        },
        {
            "provider": "openai",
            "scope": "gpt-4o-mini",
            "kind": "requests",
            "per_minute": 3,
            "available": -1.0,  # owed to the call booked ahead
            "booked": 1,
        },
        {
            "provider": "openai",
            "scope": "gpt-4o-mini",
            "kind": "tokens",
            "per_minute": 60_000,
            "available": 58_800.0,
            "booked": 0,
        },
    ]


def test_the_page_shows_each_window_and_marks_one_that_owes(
    web: TestClient, rated: Ledger, clock: ManualClock
) -> None:
    html = web.get("/").text
    assert "Rate limits" in section(html)
    assert rows(html) == [
        ("anthropic", "*", "output_tokens", "8,000", "8,000", "0"),
        ("openai", "gpt-4o-mini", "requests", "3", "-1", "1"),
        ("openai", "gpt-4o-mini", "tokens", "60,000", "58,800", "0"),
    ]
    # each row names its window, for a script or a browser test to find it
    named = r'<tr class="rate" data-provider="(\w+)" data-scope="([^"]+)" data-kind="(\w+)">'
    assert re.findall(named, html) == [
        ("anthropic", "*", "output_tokens"),
        ("openai", "gpt-4o-mini", "requests"),
        ("openai", "gpt-4o-mini", "tokens"),
    ]
    # only the window below 0 is marked
    assert re.findall(r'<td class="n warn">([^<]*)</td>', section(html)) == ["-1"]
    # read at each request: 0.3 s refill 300 tokens (1,000 a second) and 0.015 requests
    clock.advance(seconds=0.3)
    later = [(r[2], r[4]) for r in rows(web.get("/").text)]
    assert later == [("output_tokens", "8,000"), ("requests", "-0.985"), ("tokens", "59,100")]
    rated.rates.clear_limit("openai", "gpt-4o-mini")
    assert [r[2] for r in rows(web.get("/").text)] == ["output_tokens"]


def test_no_windows_say_so(pg_ledger: Ledger) -> None:
    with TestClient(create_app(pg_ledger)) as web:
        assert web.get("/api/rates").json() == []
        page = section(web.get("/").text)
    assert rows(page) == [] and "No rate limits are set" in page


def test_the_csv_quotes_a_scope_a_spreadsheet_would_run_and_the_page_escapes_markup(
    web: TestClient, rated: Ledger
) -> None:
    rated.rates.set_limit("openai", "=HYPERLINK(1)", "requests", 10)
    rated.rates.set_limit("openai", "<b>team</b>", "tokens", 5)
    got = web.get("/api/rates", params={"format": "csv"})
    assert got.headers["content-type"].startswith("text/csv")
    assert 'filename="rate-limits.csv"' in got.headers["content-disposition"]
    table = list(csv.DictReader(io.StringIO(got.text)))
    assert list(table[0]) == ["provider", "scope", "kind", "per_minute", "available", "booked"]
    # (the database's collation orders the scopes)
    assert sorted((r["scope"], r["kind"], r["available"], r["booked"]) for r in table) == [
        ("'=HYPERLINK(1)", "requests", "10.0", "0"),
        ("*", "output_tokens", "8000.0", "0"),
        ("<b>team</b>", "tokens", "5.0", "0"),
        ("gpt-4o-mini", "requests", "-1.0", "1"),
        ("gpt-4o-mini", "tokens", "58800.0", "0"),
    ]
    page = section(web.get("/").text)
    assert "<b>team</b>" not in page and "&lt;b&gt;team&lt;/b&gt;" in page
