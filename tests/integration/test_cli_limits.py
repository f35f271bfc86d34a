"""`budget-tasks limits`: the providers' rate limits set, listed and cleared from the
command line on a PostgreSQL ledger, as an operator would (a subprocess), and what a
window holds after known takes (in process, on the ledger's manual clock)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from budget_tasks import Ledger
from budget_tasks.cli import _common, main
from budget_tasks.errors import RateWindowFull
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger.records import RateAsk, RateClaim
from budget_tasks.testing import ManualClock

from .test_cli import as_json, cli, ok


def test_set_list_and_clear_from_the_command_line(pg_url: str, pg_ledger: Ledger) -> None:
    said = ok(
        pg_url, "limits", "set", "openai", "gpt-4o-mini", "--requests", "600", "--tokens", "60000"
    )
    assert said == "set openai gpt-4o-mini: requests 600 a minute, tokens 60,000 a minute\n"
    ok(pg_url, "limits", "set", "anthropic", "*", "--output-tokens", "8000")
    # a new window starts full (and a refill never passes the limit): exact on any clock
    assert as_json(pg_url, "limits", "list") == [
        {"provider": "anthropic", "scope": "*", "kind": "output_tokens", "per_minute": 8000,
         "available": 8000.0, "booked": 0},
        {"provider": "openai", "scope": "gpt-4o-mini", "kind": "requests", "per_minute": 600,
         "available": 600.0, "booked": 0},
        {"provider": "openai", "scope": "gpt-4o-mini", "kind": "tokens", "per_minute": 60000,
         "available": 60000.0, "booked": 0},
    ]  # fmt: skip
    assert ok(pg_url, "limits", "list").splitlines() == [
        "provider         scope           kind  limit / min  available  booked",
        "---------  -----------  -------------  -----------  ---------  ------",
        "anthropic            *  output_tokens        8,000      8,000       0",
        "openai     gpt-4o-mini       requests          600        600       0",
        "openai     gpt-4o-mini         tokens       60,000     60,000       0",
    ]
    # what the ledger holds is what the CLI said
    assert [(w.provider, w.scope, w.kind, w.per_minute) for w in pg_ledger.rates.windows()] == [
        ("anthropic", "*", "output_tokens", 8000),
        ("openai", "gpt-4o-mini", "requests", 600),
        ("openai", "gpt-4o-mini", "tokens", 60000),
    ]

    said = ok(pg_url, "limits", "clear", "openai", "gpt-4o-mini", "--kind", "tokens")
    assert said == "cleared 1 limit(s) of openai gpt-4o-mini tokens\n"
    assert ok(pg_url, "limits", "clear", "openai", "gpt-4o-mini", "--kind", "tokens") == (
        "cleared 0 limit(s) of openai gpt-4o-mini tokens\n"
    )
    assert as_json(pg_url, "limits", "clear", "openai", "gpt-4o-mini") == {
        "provider": "openai",
        "scope": "gpt-4o-mini",
        "kind": None,
        "cleared": 1,
    }
    assert [(w.provider, w.kind) for w in pg_ledger.rates.windows()] == [
        ("anthropic", "output_tokens")
    ]
    ok(pg_url, "limits", "clear", "anthropic", "*")
    assert as_json(pg_url, "limits", "list") == []
    assert ok(pg_url, "limits", "list").splitlines()[-1] == "no rate limits are set"


def test_a_changed_limit_keeps_what_the_window_holds_up_to_the_new_limit(
    pg_url: str, pg_ledger: Ledger
) -> None:
    ok(pg_url, "limits", "set", "openai", "team", "--tokens", "60000")
    ok(pg_url, "limits", "set", "openai", "team", "--tokens", "1000", "--requests", "5")
    assert [(w.kind, w.per_minute, w.available) for w in pg_ledger.rates.windows()] == [
        ("requests", 5, 5.0),
        ("tokens", 1000, 1000.0),  # cut to its new limit, not left at 60,000
    ]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--requests", "0"], "'--requests': 0 a minute would admit nothing: clear the limit"),
        (["--tokens", "-5"], "'--tokens': -5 is not from 1 to 10,000,000,000 a minute"),
        (["--tokens", "1.5"], "'--tokens': '1.5' is not a whole number a minute"),
        (["--input-tokens", "lots"], "'--input-tokens': 'lots' is not a whole number a minute"),
        (["--output-tokens", str(10**10 + 1)], "is not from 1 to 10,000,000,000 a minute"),
        # a good value beside a bad one: neither is set
        (["--requests", "10", "--tokens", "0"], "'--tokens': 0 a minute would admit nothing"),
        ([], "give at least one of --requests, --tokens, --input-tokens, --output-tokens"),
        (["--kind", "tokens"], "No such option '--kind'"),
    ],
)
def test_a_bad_limit_is_one_line_exit_2_and_sets_nothing(
    pg_url: str, pg_ledger: Ledger, args: list[str], says: str
) -> None:
    done = cli(pg_url, "limits", "set", "openai", "gpt-4o-mini", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert done.stdout == ""
    assert pg_ledger.rates.windows() == []


def test_a_bad_provider_scope_or_kind_is_one_line_exit_2(pg_url: str, pg_ledger: Ledger) -> None:
    for args, says in [
        (("set", "", "gpt-4o-mini", "--requests", "1"), "error: provider must not be empty"),
        (("set", "openai", "s" * 101, "--requests", "1"), "error: rate scope is 101 characters"),
        (("clear", "openai", "x", "--kind", "watts"), "'--kind': 'watts' is not one of"),
    ]:
        done = cli(pg_url, "limits", *args)
        assert done.returncode == 2, args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (args, lines)
    assert pg_ledger.rates.windows() == []


def test_a_provider_no_vendor_has_is_one_line_exit_2_and_sets_nothing(
    pg_url: str, pg_ledger: Ledger
) -> None:
    """A typo would hold nothing (only calls sent through a vendor of that name take
    from its windows): refused before anything is set, naming the flag a gateway needs."""
    done = cli(pg_url, "limits", "set", "opnai", "gpt-4o-mini", "--requests", "5", "--tokens", "9")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(
        "error: no provider named 'opnai' is known here (anthropic, openai): for a gateway's "
        "own name give --gateway; for a vendor your app registers, name the app with -A (see "
    ), line
    assert pg_ledger.rates.windows() == []
    # the rule is the provider's name, whatever else is given
    assert cli(pg_url, "limits", "set", "OpenAI", "*", "--requests", "5").returncode == 2
    assert pg_ledger.rates.windows() == []


def test_a_gateway_is_set_under_its_own_name_with_the_flag(pg_url: str, pg_ledger: Ledger) -> None:
    said = ok(pg_url, "limits", "set", "litellm", "*", "--requests", "300", "--gateway")
    assert said == "set litellm *: requests 300 a minute\n"
    done = cli(pg_url, "limits", "set", "openai", "gpt-4o-mini", "--tokens", "9000", "--gateway")
    assert done.returncode == 0 and done.stderr == ""  # a known vendor: the flag changes nothing
    assert [(w.provider, w.scope, w.kind, w.per_minute) for w in pg_ledger.rates.windows()] == [
        ("litellm", "*", "requests", 300),
        ("openai", "gpt-4o-mini", "tokens", 9000),
    ]
    # a limit set under a name no vendor has is cleared without the flag (a typo's, too)
    assert ok(pg_url, "limits", "clear", "litellm", "*") == "cleared 1 limit(s) of litellm *\n"
    assert "--gateway" in ok(pg_url, "limits", "set", "--help")


def test_a_vendor_the_app_registers_is_known_with_dash_a(
    pg_url: str, pg_ledger: Ledger, tmp_path: Path
) -> None:
    """A gateway registered as a vendor of its own in the app's module (as the worker
    imports it) is known to the CLI that names the app: no flag needed."""
    (tmp_path / "gateway_app.py").write_text(
        "from celery import Celery\n"
        "from budget_tasks.providers import OpenAI, register\n"
        "register(OpenAI('llm-gateway', hosts=['llm-gateway.internal']))\n"
        "app = Celery('gateway_app', set_as_current=False)\n"
    )
    env = {**os.environ, "BUDGET_TASKS_LEDGER_URL": pg_url}
    command = [sys.executable, "-m", "budget_tasks.cli"]
    args = ["limits", "set", "llm-gateway", "*", "--requests", "60"]
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    without = run([*command, *args])
    assert without.returncode == 2 and "'llm-gateway'" in without.stderr
    done = run([*command, "-A", "gateway_app", *args])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "set llm-gateway *: requests 60 a minute\n" and done.stderr == ""
    assert [(w.provider, w.per_minute) for w in pg_ledger.rates.windows()] == [("llm-gateway", 60)]


def test_list_shows_what_each_window_holds_after_known_takes_and_a_booking(
    pg_url: str, pg_ledger: Ledger, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the ledger's manual clock (nothing refills): 1,200 of 60,000 tokens taken,
    and a fourth call on 3 requests a minute booked ahead (the window owes it)."""
    monkeypatch.setattr(_common, "open_ledger", lambda url: pg_ledger)
    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", pg_url)
    runner = CliRunner()

    def run(*args: str) -> str:
        done = runner.invoke(main, list(args))
        assert done.exit_code == 0, done.output
        return done.output

    run("limits", "set", "openai", "gpt-4o-mini", "--requests", "3", "--tokens", "60000")
    assert pg_ledger.rates.take("openai", "gpt-4o-mini", RateAsk(requests=0, tokens=1_200)).granted
    pg_ledger.create_budget("team", 1_000_000)
    claim = RateClaim("openai", ("gpt-4o-mini",), RateAsk(requests=1))
    for n in range(3):  # three take the window's requests
        pg_ledger.calls.reserve("team", f"k{n}", 100, grant=CallFacts(rate=claim))
    with pytest.raises(RateWindowFull):  # the fourth is booked ahead
        pg_ledger.calls.reserve("team", "k3", 100, grant=CallFacts(rate=claim))
    listed = json.loads(run("limits", "list", "--json"))
    assert [(w["kind"], w["per_minute"], w["available"], w["booked"]) for w in listed] == [
        ("requests", 3, -1.0, 1),
        ("tokens", 60_000, 58_800.0, 0),
    ]
    assert run("limits", "list").splitlines()[2:] == [
        "openai    gpt-4o-mini  requests            3         -1       1",
        "openai    gpt-4o-mini    tokens       60,000     58,800       0",
    ]
    # a fifth of a second later: a refill of 3 a minute shows in thousandths
    clock.advance(seconds=0.2)
    assert run("limits", "list").splitlines()[2].split()[4] == "-0.99"


def test_a_tenants_weight_is_set_from_the_command_line_and_a_bad_one_sets_nothing(
    pg_url: str, pg_ledger: Ledger
) -> None:
    pg_ledger.create_budget("acme", 1_000)
    said = ok(pg_url, "limits", "weight", "acme", "3")
    assert said == "acme: weight 3 in the rate windows its calls share\n"
    assert [b.rate_weight for b in pg_ledger.budgets() if b.name == "acme"] == [3]
    for bad in ("0", "1001", "1.5", "heavy", "\uff11\uff10"):  # full-width 10
        done = cli(pg_url, "limits", "weight", "acme", bad)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and "is not a weight from 1 to 1000" in done.stderr
    unknown = cli(pg_url, "limits", "weight", "nobody", "2")
    assert unknown.returncode != 0 and "unknown budget 'nobody'" in unknown.stderr
    assert as_json(pg_url, "limits", "weight", "acme", "none") == {
        "budget": "acme",
        "rate_weight": None,
    }
    assert [b.rate_weight for b in pg_ledger.budgets() if b.name == "acme"] == [None]
