"""How many transactions the ledger commits, and how many statements it sends, per
BudgetTask: a first run, a replay of a finished key, a denial. Commits are counted by
PostgreSQL (``pg_stat_database.xact_commit`` of a scratch database that nothing else
uses), statements by the driver (a psycopg cursor class that counts ``execute``
calls), not by the library counting itself.

    .venv/bin/python benchmarks/commit_count.py [--tasks 20]

The tasks run in eager mode in this process (the same operation manager a worker
runs), each making one call through the official openai SDK to the fake provider
on the Quick start's path (``estimate_cost`` 0 and the guarded client, which reserves
each call's own bound). A backend flushes its statistics when it exits, so the
ledger's connections are closed before each reading; a warm-up run (connections, the
database clock) is flushed before the first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402
from sqlalchemy import event  # noqa: E402

from benchmarks.ledger_bench import ADMIN_URL, scratch_database  # noqa: E402
from budget_tasks import BudgetExceeded, BudgetTask, Ledger  # noqa: E402
from budget_tasks.config import close_ledgers, ledger_of  # noqa: E402
from budget_tasks.testing import FakeProvider  # noqa: E402
from budget_tasks.transport import guarded_openai_client  # noqa: E402

#: Issue 15's targets: commits per first run, per replay, per denial.
TARGETS = {"first run": 2, "replay": 1, "denial": 1}
MODEL = "gpt-4o-mini"


@dataclass(frozen=True)
class Counts:
    """Transactions and statements per task, by kind of delivery."""

    commits: dict[str, float]
    rollbacks: dict[str, float]
    tasks: int
    statements: dict[str, float]
    #: PostgreSQL's own CPU per task (ms), from its backends' /proc entries: NaN where
    #: the database is not on this host
    server_cpu_ms: dict[str, float] = field(default_factory=dict)


_TICKS = os.sysconf("SC_CLK_TCK")


def _backend_cpu(database: str) -> float:
    """CPU seconds the database's backends have used (the pool's connections, opened
    when the batch began); NaN if they are not processes of this host."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        pids = [
            int(row[0])
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            ).fetchall()
        ]
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / _TICKS


class _CountingCursor(psycopg.Cursor[Any]):
    """A psycopg cursor that counts the statements it sends."""

    sent = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        _CountingCursor.sent += 1
        return super().execute(*args, **kwargs)


def _count_statements(engine: Any) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.cursor_factory = _CountingCursor


def _stat(database: str) -> tuple[int, int]:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
            (database,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _flushed(database: str, app: Celery | None = None) -> tuple[int, int]:
    """The counters once every ledger connection of this process has exited. The
    ledger itself is kept (its cached budget chain, periods and clock offset, as in a
    worker that has run a while): only its pooled connections are closed."""
    if app is None:
        close_ledgers()
    else:
        ledger_of(app).engine.dispose()
    time.sleep(0.5)  # backends write their statistics as they exit
    return _stat(database)


def run(tasks: int = 100) -> Counts:
    with scratch_database() as url:
        try:
            with FakeProvider() as fake:
                return _count(url, url.rsplit("/", 1)[1], fake, tasks)
        finally:
            close_ledgers()


def _count(url: str, database: str, fake: FakeProvider, tasks: int) -> Counts:
    setup = Ledger(url)
    setup.create_schema()
    setup.create_budget("plenty", 10**12)
    setup.create_budget("none", 1)
    setup.dispose()
    app = Celery("commit-count", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=url)

    def request(text: str) -> dict[str, Any]:
        return {
            "model": MODEL,
            "max_completion_tokens": 16,
            "messages": [{"role": "user", "content": text}],
        }

    guarded = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=10.0)

    @app.task(
        base=BudgetTask,
        bind=True,
        name="commits.summarize",
        budget=lambda budget, key: budget,
        idempotency_key=lambda budget, key: key,
        estimate_cost=lambda budget, key: 0,
    )
    def summarize(self: BudgetTask, budget: str, key: str) -> str:
        completion = guarded.chat.completions.create(**request(key))
        return str(completion.choices[0].message.content)

    def each(kind: str, budget: str, keys: list[str]) -> Callable[[], None]:
        def go() -> None:
            for key in keys:
                try:
                    summarize.delay(budget, key).get()
                except BudgetExceeded:
                    if kind != "denial":
                        raise

        return go

    keys = [f"k{n}" for n in range(tasks)]
    # the budgets' chains, their periods, the database clock: read once per process
    each("first run", "plenty", ["warm-up"])()
    each("denial", "none", ["warm-up-denial"])()
    commits: dict[str, float] = {}
    rollbacks: dict[str, float] = {}
    statements: dict[str, float] = {}
    server_cpu: dict[str, float] = {}
    _count_statements(ledger_of(app).engine)
    for kind, budget, batch in (
        ("first run", "plenty", keys),
        ("replay", "plenty", keys),
        ("denial", "none", [f"d{n}" for n in range(tasks)]),
    ):
        before = _flushed(database, app)
        sent = _CountingCursor.sent
        each(kind, budget, batch)()
        statements[kind] = (_CountingCursor.sent - sent) / len(batch)
        server_cpu[kind] = 1000.0 * _backend_cpu(database) / len(batch)
        after = _flushed(database, app)
        commits[kind] = (after[0] - before[0]) / len(batch)
        rollbacks[kind] = (after[1] - before[1]) / len(batch)
    return Counts(commits, rollbacks, tasks, statements, server_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100)
    args = parser.parse_args()
    counts = run(args.tasks)
    for kind, value in counts.commits.items():
        print(
            f"{kind:10} {value:5.2f} commits per task (target {TARGETS[kind]}), "
            f"{counts.rollbacks[kind]:.2f} rollbacks, {counts.statements[kind]:.1f} statements, "
            f"{counts.server_cpu_ms[kind]:.2f} ms of PostgreSQL CPU"
        )


if __name__ == "__main__":
    main()
