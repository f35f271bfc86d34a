"""Where a BudgetTask's time goes, per task, on the Quick start's path: the ledger and
the Python around it apart, beside a plain task making the same call in the same run.

    .venv/bin/python benchmarks/task_profile.py [--tasks 300] [--rounds 3]

Both tasks run in eager mode in this process against the fake provider (in a thread
of its own) and, for the BudgetTask, a PostgreSQL ledger in a scratch database: the
plain task calls the official SDK (retries off); the BudgetTask is the Quick start's
(``estimate_cost`` 0, the SDK's own call through the guarded client). Per task, the
medians of the rounds:

- wall time and this thread's CPU, plain and BudgetTask, and the difference;
- of the BudgetTask's: the time inside the ledger's methods (wall: building and
  sending statements and waiting for PostgreSQL; CPU: this process's share of it),
  and the rest of budget-tasks' own Python outside them (the flow, the transport,
  pricing), as this thread's CPU;
- PostgreSQL's own CPU per task (its backends' /proc entries).

The ledger is timed around every public method of ``CallLedger`` (the one object a
delivery writes through); nested calls are counted once. The database is vacuumed
between rounds (autovacuum is off on these machines).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

from benchmarks.commit_count import _backend_cpu  # noqa: E402
from benchmarks.ledger_bench import scratch_database  # noqa: E402
from budget_tasks import BudgetTask, Ledger  # noqa: E402
from budget_tasks.config import close_ledgers  # noqa: E402
from budget_tasks.ledger import CallLedger  # noqa: E402
from budget_tasks.providers.registry import openai_client  # noqa: E402
from budget_tasks.testing import FakeProvider  # noqa: E402
from budget_tasks.transport import guarded_openai_client  # noqa: E402

REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "ping"}],
}


class _LedgerClock:
    """Wall and thread CPU spent inside CallLedger's public methods (outermost only)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self._depth = 0

    def install(self) -> dict[str, Any]:
        """Time every public method of CallLedger; the originals, for :meth:`remove`."""
        originals = {}
        for name in dir(CallLedger):
            if name.startswith("_"):
                continue
            method = getattr(CallLedger, name)
            if callable(method):
                originals[name] = method
                setattr(CallLedger, name, self._timed(method))
        return originals

    @staticmethod
    def remove(originals: dict[str, Any]) -> None:
        for name, method in originals.items():
            setattr(CallLedger, name, method)

    def _timed(self, method: Any) -> Any:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
                self._depth -= 1

        return timed


@dataclass
class Round:
    """One round's figures per task (ms)."""

    plain_wall: float
    plain_cpu: float
    budget_wall: float
    budget_cpu: float
    ledger_wall: float
    ledger_cpu: float
    server_cpu: float


def _timed(run: Any, n: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    for i in range(n):
        run(i)
    return (time.perf_counter() - wall) * 1e3 / n, (time.thread_time() - cpu) * 1e3 / n


def run(tasks: int = 300, rounds: int = 3) -> list[Round]:
    with scratch_database() as url:
        try:
            with FakeProvider() as fake:
                return _rounds(url, url.rsplit("/", 1)[1], fake, tasks, rounds)
        finally:
            close_ledgers()


def _rounds(url: str, database: str, fake: FakeProvider, tasks: int, rounds: int) -> list[Round]:
    setup = Ledger(url)
    setup.create_schema()
    setup.create_budget("plenty", 10**12)
    setup.dispose()
    app = Celery("task-profile", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=url)
    plain_client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=10.0)
    guarded = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=10.0)

    @app.task(name="profile.plain")
    def plain(key: str) -> str:
        completion = plain_client.chat.completions.create(**REQUEST)
        return str(completion.choices[0].message.content)

    @app.task(
        base=BudgetTask,
        bind=True,
        name="profile.budgeted",
        budget="plenty",
        idempotency_key=lambda key: key,
        estimate_cost=lambda key: 0,
    )
    def budgeted(self: BudgetTask, key: str) -> str:
        completion = guarded.chat.completions.create(**REQUEST)
        return str(completion.choices[0].message.content)

    clock = _LedgerClock()
    originals = clock.install()
    try:
        return _measured(url, database, clock, tasks, rounds, plain, budgeted)
    finally:
        clock.remove(originals)


def _measured(
    url: str,
    database: str,
    clock: _LedgerClock,
    tasks: int,
    rounds: int,
    plain: Any,
    budgeted: Any,
) -> list[Round]:
    out = []
    for r in range(-1, rounds):  # round -1 warms up (connections, clock, chains)
        n = 20 if r < 0 else tasks
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        tag = uuid.uuid4().hex[:8]
        plain_wall, plain_cpu = _timed(lambda i, t=tag: plain.delay(f"{t}-{i}").get(), n)
        clock.wall = clock.cpu = 0.0
        server = _backend_cpu(database)
        budget_wall, budget_cpu = _timed(lambda i, t=tag: budgeted.delay(f"{t}-{i}").get(), n)
        server = (_backend_cpu(database) - server) * 1e3 / n
        if r >= 0:
            out.append(
                Round(
                    plain_wall,
                    plain_cpu,
                    budget_wall,
                    budget_cpu,
                    clock.wall * 1e3 / n,
                    clock.cpu * 1e3 / n,
                    server,
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    found = run(args.tasks, args.rounds)

    def med(field: str) -> float:
        return statistics.median(getattr(r, field) for r in found)

    pw, pc, bw, bc = med("plain_wall"), med("plain_cpu"), med("budget_wall"), med("budget_cpu")
    lw, lc = med("ledger_wall"), med("ledger_cpu")
    print(f"per task, ms (medians of {args.rounds} rounds of {args.tasks})")
    print(f"{'':>34} {'wall':>7} {'CPU':>7}")
    print(f"{'plain task':>34} {pw:>7.2f} {pc:>7.2f}")
    print(f"{'BudgetTask':>34} {bw:>7.2f} {bc:>7.2f}")
    print(f"{'  added':>34} {bw - pw:>7.2f} {bc - pc:>7.2f}")
    print(f"{'  inside the ledger':>34} {lw:>7.2f} {lc:>7.2f}")
    print(f"{'  of which waiting on PostgreSQL':>34} {lw - lc:>7.2f}")
    print(f"{'  budget-tasks Python outside it':>34} {'':>7} {bc - pc - lc:>7.2f}")
    print(f"{'PostgreSQL backend CPU':>34} {'':>7} {med('server_cpu'):>7.2f}")
    print(f"plain / BudgetTask wall: {pw / bw:.2f}")


if __name__ == "__main__":
    main()
