"""One large answer (50 MB by default) through a BudgetTask's guarded client, against the
same call through the plain SDK: the process's peak memory and the largest row the
ledger stores, each measured in a fresh process, in the same run.

    .venv/bin/python benchmarks/large_answer.py [--megabytes 50]

Three processes: the plain SDK call (the baseline: what the answer itself costs), the
same call as a labelled call of a BudgetTask on a SQLite ledger with the default size
cap (1 MiB: only the answer's digest is stored), and the same with the cap raised past
the answer (it is stored whole, as every answer was before the cap). The provider is
tests/hostile_gateway.py (``huge=BYTES``), over HTTP on the loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sqlite3, sys, uuid
sys.path.insert(0, {root!r})
from tests.hostile_gateway import HostileGateway
mode, size, db = sys.argv[1], int(sys.argv[2]), sys.argv[3]
gateway = HostileGateway().start()
request = dict(
    model="gpt-4o-mini", max_completion_tokens=16,
    messages=[{{"role": "user", "content": "a long one"}}],
    extra_headers={{"x-hostile": f"huge={{size}}"}},
)
if mode == "plain":
    import openai
    client = openai.OpenAI(base_url=gateway.openai_base_url, api_key="x", max_retries=0)
    got = len(client.chat.completions.create(**request).choices[0].message.content)
    row = 0
else:
    from celery import Celery
    from budget_tasks import BudgetTask
    from budget_tasks.config import ledger_of
    from budget_tasks.transport import guarded_openai_client
    cap = 1 << 20 if mode == "capped" else size * 4
    app = Celery("large", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True,
                    budget_ledger_url=f"sqlite:///{{db}}", budget_max_stored_bytes=cap)
    client = guarded_openai_client(base_url=gateway.openai_base_url, api_key="x")
    @app.task(base=BudgetTask, bind=True, name="large.ask", budget="team",
              estimate_cost=lambda: 0)
    def ask(self):
        return len(client.chat.completions.create(**request).choices[0].message.content)
    ledger_of(app).create_budget("team", 10**12)
    got = ask.delay().get()
    with sqlite3.connect(db) as conn:
        row = max(conn.execute(
            "SELECT max(length(result)) FROM side_effects UNION ALL "
            "SELECT max(length(result)) FROM operations").fetchall())[0] or 0
gateway.stop()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"mode": mode, "answer": got, "peak": peak, "row": row}}))
"""


def run(mode: str, size: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD.format(root=str(ROOT)),
                mode,
                str(size),
                os.path.join(folder, "ledger.db"),
            ],
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
            timeout=600,
        )
        if done.returncode:
            raise RuntimeError(f"{mode}: {done.stderr[-3000:]}")
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=50)
    args = parser.parse_args(argv)
    size = args.megabytes * 1_000_000
    plain, capped, whole = (run(mode, size) for mode in ("plain", "capped", "whole"))
    mb = 1e6
    print(f"a {args.megabytes} MB answer, peak RSS and the largest stored row:")
    print(f"  plain SDK (baseline)      peak {plain['peak'] / mb:7.1f} MB")
    for name, figures in (("capped (1 MiB)", capped), ("stored whole", whole)):
        print(
            f"  BudgetTask, {name:14s} peak {figures['peak'] / mb:7.1f} MB "
            f"({figures['peak'] / plain['peak']:.2f}x the baseline), "
            f"row {figures['row']:,} bytes"
        )
    assert plain["answer"] == capped["answer"] == whole["answer"] == size
    return 0


if __name__ == "__main__":
    sys.exit(main())
