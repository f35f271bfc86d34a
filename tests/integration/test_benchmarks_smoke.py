"""The benchmark runner (``python -m benchmarks``, what ``make bench`` runs) works end to
end in its --quick mode: every section ran and every figure has a positive ratio. No
timing is asserted: the sizes are tiny and the machine is shared."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..services import check_postgres, check_redis, redis_db

ROOT = Path(__file__).resolve().parents[2]
REDIS_DB = redis_db("benchmarks smoke")

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def test_quick_run_reports_every_section(tmp_path: Path) -> None:
    check_postgres()
    check_redis()
    report, figures = tmp_path / "RESULTS.md", tmp_path / "results.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            f"--output={report}",
            f"--json={figures}",
            f"--redis-db={REDIS_DB}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    text = report.read_text()
    numbered = [f"## {n}. " for n in range(1, 14)]
    for heading in ("## Summary", *numbered, "## Sizes"):
        assert re.search(f"^{re.escape(heading)}", text, re.MULTILINE), heading
    assert "--quick" in text  # the exact command that made it
    for needle in ("CPU: ", "PostgreSQL ", "Redis ", "Python "):
        assert needle in text

    data = json.loads(figures.read_text())
    assert data["problems"] == []
    assert {f["section"] for f in data["figures"]} == set(range(1, 14))
    # section 2 twice: the call answered at once, and every call held 250 ms at the fake
    overhead = [f["what"] for f in data["figures"] if f["section"] == 2]
    assert len(overhead) == 4, overhead
    assert sum("answered at once" in what for what in overhead) == 2, overhead
    assert sum("taking 250 ms" in what for what in overhead) == 2, overhead
    assert "calls the fake held 250 ms" in text
    for figure in data["figures"]:
        for name in ("baseline", "value", "ratio"):
            assert math.isfinite(figure[name]) and figure[name] > 0, figure
        assert f"| {figure['ratio']:.2f} |" in text


def test_the_large_answer_benchmark_runs_and_the_cap_keeps_the_row_small() -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/large_answer.py", "--megabytes", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    capped = re.search(r"capped \(1 MiB\) peak .* row ([\d,]+) bytes", run.stdout)
    whole = re.search(r"stored whole +peak .* row ([\d,]+) bytes", run.stdout)
    assert capped and whole, run.stdout
    assert int(capped.group(1).replace(",", "")) < 1_000
    assert int(whole.group(1).replace(",", "")) > 3_000_000


def test_the_task_profile_splits_a_budgettasks_time_and_leaves_the_ledger_as_it_was() -> None:
    """``benchmarks/task_profile.py`` (not part of ``make bench``) in a tiny run: the
    BudgetTask's time inside the ledger was measured and is part of its own, and the
    ledger's methods are themselves again afterwards."""
    check_postgres()
    from benchmarks import task_profile
    from budget_tasks.ledger import CallLedger

    before = {name: getattr(CallLedger, name) for name in ("admit", "finish_operation")}
    [found] = task_profile.run(tasks=5, rounds=1)
    assert 0 < found.ledger_wall < found.budget_wall
    assert 0 <= found.ledger_cpu <= found.budget_cpu
    assert found.plain_wall > 0 and found.server_cpu >= 0
    assert {name: getattr(CallLedger, name) for name in before} == before
