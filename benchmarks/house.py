"""The package's size and shape, as issue 42 measures them:

- package lines (``budget_tasks/**/*.py``, not counting the fake provider, its
  wire and billing modules, and the migrations);
- public names: the length of every ``__all__`` in the package, summed;
- one guarded SDK call (the Quick start's task: ``guarded_openai_client`` inside an
  eager BudgetTask, against the fake provider and an SQLite ledger) traced with
  ``sys.settrace``: how many of the library's modules it enters and how many calls
  into the library it makes (a first run; the warm-up run before it is not counted);
- the ledger's commits for that first run are measured by ``commit_count.py``.

    .venv/bin/python benchmarks/house.py [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "budget_tasks"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Not counted as the package's own lines: the stand-in provider and frozen history.
NOT_COUNTED = ("testing/fake_", "migrations/")


def package_lines() -> int:
    total = 0
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel.startswith(prefix) for prefix in NOT_COUNTED):
            continue
        total += len(path.read_text().splitlines())
    return total


def public_names() -> int:
    total = 0
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                value = node.value
                if isinstance(value, (ast.List, ast.Tuple)):
                    total += len(value.elts)
    return total


def traced_call() -> dict[str, int]:
    """Modules entered and calls made inside the library by one first run."""
    from celery import Celery

    from budget_tasks import BudgetTask, Ledger
    from budget_tasks.config import close_ledgers
    from budget_tasks.testing import FakeProvider

    home = Path(tempfile.mkdtemp(prefix="house-"))
    url = f"sqlite:///{home}/ledger.db"
    ledger = Ledger(url)
    ledger.create_schema()
    ledger.create_budget("acme", 50_000_000)
    ledger.dispose()
    fake = FakeProvider()
    fake.start()
    os.environ["OPENAI_BASE_URL"] = fake.openai_base_url
    os.environ["OPENAI_API_KEY"] = "sk-house"
    from budget_tasks.transport import guarded_openai_client

    app = Celery("house", broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True
    app.conf.task_store_eager_result = True
    app.conf.budget_ledger_url = url
    client = guarded_openai_client(timeout=30)

    class Summarize(BudgetTask):  # the Quick start's task
        name, budget = "house.summarize", "acme"

        def idempotency_key(self, doc_id: str) -> str:
            return f"summarize:{doc_id}"

        def estimate_cost(self, doc_id: str) -> int:
            return 0

        def run(self, doc_id: str) -> str:
            completion = client.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=256,
                messages=[{"role": "user", "content": f"Summarise {doc_id}"}],
            )
            return str(completion.choices[0].message.content)

    task = app.register_task(Summarize())
    task.apply(args=["warm-up"]).get()
    modules: set[str] = set()
    calls = 0
    prefix = str(PACKAGE)

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal calls
        if event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(prefix):
                calls += 1
                modules.add(filename)
        return None

    sys.settrace(tracer)
    try:
        task.apply(args=["doc-7"]).get()
    finally:
        sys.settrace(None)
    fake.stop()
    close_ledgers()
    return {"modules": len(modules), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = {"package_lines": package_lines(), "public_names": public_names()}
    figures.update(traced_call())
    if args.json:
        print(json.dumps(figures))
        return
    print(f"package lines (no fake provider, no migrations): {figures['package_lines']}")
    print(f"public names in every __all__: {figures['public_names']}")
    print(
        f"one guarded SDK call, first run: {figures['modules']} modules, "
        f"{figures['calls']} calls into the library"
    )


if __name__ == "__main__":
    main()
