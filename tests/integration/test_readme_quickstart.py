"""The README's quick start, run as written: the code block is taken from README.md and
executed against the fake provider (official openai SDK over HTTP) and a SQLite
ledger (the environment variable the README exports), with Celery in eager mode.
tests/acceptance runs the whole section from an installed wheel, with real processes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from budget_tasks import Ledger
from budget_tasks.config import close_ledgers
from budget_tasks.testing import FakeProvider

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under the quick start heading"
    return match.group(1)


def test_the_quick_start_block_reserves_settles_and_replays(
    tmp_path: Path, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = quick_start_code()
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    monkeypatch.setenv("BUDGET_TASKS_LEDGER_URL", ledger_url)
    monkeypatch.setenv("OPENAI_BASE_URL", fake.openai_base_url)  # read by the SDK
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    ledger = Ledger(ledger_url)
    ledger.create_schema()
    ledger.create_budget("acme", 50_000_000)
    namespace: dict[str, Any] = {"__name__": "readme_quickstart"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    app, summarize = namespace["app"], namespace["summarize"]
    app.conf.task_always_eager = True
    try:
        first = summarize.delay("doc-7", "The board met and approved the budget.").get()
        again = summarize.delay("doc-7", "The board met and approved the budget.").get()
        assert isinstance(first, str) and first and again == first  # replayed
        [served] = [s for s in fake.served_as(ledger) if s.method == "POST"]
        assert served.idempotency_key == "summarize:doc-7:openai.chat:1"  # the SDK's call
        [attempt] = [a for a in ledger.attempts() if a.key == served.idempotency_key]
        assert attempt.state == "settled" and attempt.actual == served.billed
        assert attempt.actual < attempt.amount  # the estimate was an upper bound
        assert ledger.balance("acme").spent == served.billed and ledger.audit() == []
    finally:
        close_ledgers()
        app.close()
        ledger.dispose()
