"""The README as the front door: short, its links lead somewhere, and every command in
its code blocks exists as written (the CLI's commands and options parsed by the CLI
itself, make targets in the Makefile, `celery -A app budget` through Celery's own
entry point)."""

from __future__ import annotations

import re
import shlex
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest

from budget_tasks.cli import main
from budget_tasks.cli.celery_command import budget

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: What a person reads in about ten minutes.
MOST_LINES = 220
#: Programs the README runs that are not this project's (their own docs say the rest).
OTHERS = {"git", "python3", "pip", "python", "createdb", "export"}


def commands(text: str = README) -> list[list[str]]:
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def parse(group: click.Group, words: list[str]) -> list[str]:
    """Parse ``words`` as ``group`` would, down to the command, without running it:
    an unknown command or option, or a bad value, raises click's error. Returns the
    command's path."""
    ctx = group.make_context(group.name or "cli", list(words))
    path = [group.name or "cli"]
    while isinstance(ctx.command, click.Group):
        # what the group left for its command (click keeps the command's name apart)
        rest = [*ctx._protected_args, *ctx.args]
        name, command, rest = ctx.command.resolve_command(ctx, rest)
        assert command is not None and name is not None
        ctx = command.make_context(name, rest, parent=ctx)
        path.append(name)
    return path


def test_the_readme_is_read_in_ten_minutes() -> None:
    assert len(README.splitlines()) <= MOST_LINES


def test_the_readme_opens_with_the_two_commands() -> None:
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first is not None
    assert [line.split()[:2] for line in first.group(1).splitlines()] == [
        ["make", "demo"],
        ["make", "test"],
    ]


def test_every_link_in_the_readme_leads_to_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links its docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_every_command_in_the_readme_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", "sqlite:///unused.db")
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    seen = set()
    for words in commands():
        program, args = words[0], words[1:]
        if "=" in program:  # VAR=value command ...
            program, args = args[0], args[1:]
        if program == "make":
            assert set(args) <= targets, words
        elif program == "budget-tasks":
            seen.add(" ".join(parse(main, args)[1:]))
        elif program == "celery":
            assert args[:1] == ["-A"], words
            if args[2] == "budget":
                parse(budget, args[3:])
                seen.add("celery budget")
            else:
                assert args[2] in {"worker", "beat"}, words
        else:
            assert program in OTHERS or program.startswith("."), words
    # the CLI in brief names the commands people need first
    assert {"db upgrade", "db current", "budget create", "status", "audit"} <= seen
    assert "celery budget" in seen


def test_an_unknown_command_or_option_is_caught_by_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", "sqlite:///unused.db")
    for words in (["budget", "make", "x"], ["status", "--colour"], ["budget", "create", "x"]):
        with pytest.raises(click.UsageError):
            parse(main, words)
    assert parse(main, ["budget", "create", "x", "--cap", "50usd"])[1:] == ["budget", "create"]


def test_celery_finds_the_budget_sub_command() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="celery.commands")}
    assert found.get("budget") == "budget_tasks.cli.celery_command:budget"
    # the same commands as budget-tasks, one object each
    assert budget.commands is main.commands


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_cli_command_in_the_docs_parses(page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", "sqlite:///unused.db")
    text = (ROOT / "docs" / page).read_text()
    for words in commands(text):
        if words[0] == "budget-tasks" and "|" not in words:  # `list | show NAME`: a summary
            parse(main, words[1:])
        elif words[:2] == ["celery", "-A"] and words[3:4] == ["budget"]:
            parse(budget, words[4:])


def test_the_wheel_the_readme_installs_is_the_one_this_version_builds() -> None:
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    named = re.findall(r"budget_tasks-([0-9][^-]*)-py3-none-any\.whl", README)
    assert named and set(named) == {version}
