"""The layers of DESIGN.md: the ledger never imports Celery; providers never import the
ledger; nothing inside the delivery points back at its flow. Checked on the source
(every import statement) and at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "budget_tasks"
#: The ledger's classes, one per caller, and its rule modules over the store (escrow
#: and the counters lie beneath the store: it admits and journals with them).
CALLERS = (".calls", ".upkeep", ".views", ".operator")
RULES = (
    ".holds", ".operations", ".budgets", ".reports", ".oversight", ".maintenance",
    ".audits", ".retention",
)  # fmt: skip


def imports_of(package: str) -> set[str]:
    found: set[str] = set()
    place = PACKAGE / package
    for path in [place] if place.suffix == ".py" else place.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ("." * node.level) + (node.module or "")
                found.add(base)
                # "from . import metrics" imports ".metrics"; "from .a import b", ".a.b"
                sep = "." if node.module else ""
                found.update(f"{base}{sep}{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        (
            "ledger",
            ("celery", "kombu", "starlette", "uvicorn", "jinja2", "..dashboard", "..delivery"),
        ),
        # the ledger by caller: the store knows no caller and no rule module, and the
        # rule modules (functions over the store) know no caller's class
        ("ledger/store.py", (*CALLERS, *RULES)),
        *[(f"ledger/{rule[1:]}.py", CALLERS) for rule in (*RULES, ".escrow", ".counters")],
        ("ledger/escrow.py", (".store", *RULES)),
        ("ledger/counters.py", (".store", *RULES)),
        # the dashboard is the CLI's, imported when its command runs: nothing else uses it
        ("resolution.py", (".dashboard", "starlette")),
        ("providers", ("..ledger", "...ledger", "budget_tasks.ledger", "celery", "..delivery")),
        ("pricing", ("..ledger", "..providers", "..delivery", "celery")),
        # the operation state machine is Celery-free; Celery's side is task.py
        ("delivery", ("celery", "kombu", "..metrics", "..tracing", "..task", "..transport")),
        # inside it, nothing points back up at the flow that drives it
        ("delivery/scope.py", (".flow", ".owed")),
        ("delivery/fates.py", (".flow", ".owed", ".scope")),
        ("delivery/owed.py", (".flow",)),
        ("delivery/keys.py", (".flow", ".owed", ".scope", ".fates")),
        # metrics and tracing are hooks sinks: nothing they observe imports them
        ("task.py", (".metrics", ".tracing", ".dashboard", "starlette")),
        ("beat.py", (".metrics", ".tracing", ".task", ".dashboard", "starlette")),
        ("cli", ("..metrics", "..tracing", "..task")),
        ("config.py", (".task", ".metrics", "celery")),
        ("hooks.py", (".metrics", ".tracing", ".task", ".ledger", "celery", "opentelemetry")),
        ("metrics.py", (".task", ".delivery")),
        ("tracing.py", (".task", ".delivery", ".beat", ".metrics", "celery")),
        # the guarded transport works wherever a run's scope is set: no Celery in it
        ("transport", ("celery", "kombu", "..task", "..metrics", "..tracing", "..beat")),
    ],
)
def test_layer_imports(package: str, forbidden: tuple[str, ...]) -> None:
    imports = imports_of(package)
    assert imports, "the check must see the package's imports"
    bad = sorted(i for i in imports if i.startswith(forbidden) or i.split(".")[0] in forbidden)
    assert bad == []


def test_importing_the_ledger_loads_no_celery() -> None:
    code = "import sys, budget_tasks.ledger; print('celery' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_loads_no_web_framework_until_the_dashboard_runs() -> None:
    """A bare install (no [dashboard] extra) runs every other command."""
    code = (
        "import sys, budget_tasks.cli; "
        "print(sorted(m for m in ('starlette', 'uvicorn', 'jinja2', "
        "'budget_tasks.dashboard') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
