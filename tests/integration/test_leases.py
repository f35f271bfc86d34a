"""Leases across PID namespaces (failure 4): two "containers" that share a hostname
but not a PID namespace, made with ``unshare --pid --fork --mount-proc``. A process
in one cannot tell whether a pid in the other runs, so a live run's lease there is
never taken over and its sending attempt never adopted as unknown before the lease
expires; within one namespace a run that is gone is still seen as gone at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from budget_tasks import Ledger

from ..services import missing

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys
from datetime import timedelta
from budget_tasks import Ledger
from budget_tasks.ledger.leases import owner_id
url, key = sys.argv[1:3]
ledger = Ledger(url)
start = ledger.calls.admit(
    key, fingerprint="f", owner=owner_id(), lease=timedelta(minutes=10), max_runs=5
)
assert start.decision.value == "run", start
ledger.calls.reserve("team", key + "#1", 100, operation_id=start.operation_id)
ledger.calls.mark_sending(key + "#1")
print("holding", flush=True)
sys.stdin.readline()  # a live run, mid-call, until the test lets it go
"""

CHECKER = """
import json, sys
from datetime import timedelta
from budget_tasks import Ledger
from budget_tasks.ledger.leases import owner_id
url, key = sys.argv[1:3]
ledger = Ledger(url)
adopted = ledger.upkeep.mark_orphans_unknown()
start = ledger.calls.admit(
    key, fingerprint="f", owner=owner_id(), lease=timedelta(minutes=10), max_runs=5
)
print(json.dumps({"adopted": adopted, "decision": start.decision.value}), flush=True)
"""


def _unshare() -> list[str]:
    if shutil.which("unshare") is None:
        missing("unshare", "not installed")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        missing("PID namespaces", probe.stderr.decode().strip() or "unshare refused")
    return ["unshare", "--pid", "--fork", "--mount-proc"]


@contextmanager
def holder(prefix: list[str], url: str, key: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", HOLDER, url, key],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def check(prefix: list[str], url: str, key: str) -> dict[str, object]:
    done = subprocess.run(
        [*prefix, sys.executable, "-c", CHECKER, url, key],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("holder_ns", "checker_ns"),
    [("own", "host"), ("host", "own"), ("own", "own")],
    ids=["held-in-a-namespace", "checked-from-a-namespace", "two-namespaces"],
)
def test_a_live_lease_in_another_pid_namespace_is_never_taken_over(
    pg_url: str, pg_ledger: Ledger, holder_ns: str, checker_ns: str
) -> None:
    ns = _unshare()
    prefix = {"own": ns, "host": []}
    real = Ledger(pg_url)
    real.create_budget("team", 1_000_000)
    key = f"job-{holder_ns}-{checker_ns}"
    with holder(prefix[holder_ns], pg_url, key):
        seen = check(prefix[checker_ns], pg_url, key)
        assert seen == {"adopted": [], "decision": "in_progress"}
        assert real.attempt(f"{key}#1").state == "sending"
        assert real.operation(key).runs == 1
    real.dispose()


def test_a_gone_run_is_taken_over_at_once_only_where_that_can_be_proved(
    pg_url: str, pg_ledger: Ledger
) -> None:
    ns = _unshare()
    real = Ledger(pg_url)
    real.create_budget("team", 1_000_000)
    # Killed in the host's namespace: the host sees its pid gone, at once.
    with holder([], pg_url, "gone-here"):
        pass  # killed on leaving the block, its lease not yet expired
    assert check([], pg_url, "gone-here") == {"adopted": ["gone-here#1"], "decision": "run"}
    assert real.attempt("gone-here#1").state == "unknown"
    # Killed inside a namespace of its own: from the host nothing proves it gone, so
    # its lease runs to its expiry (ten minutes) and nothing is adopted before.
    with holder(ns, pg_url, "gone-there"):
        pass
    assert check([], pg_url, "gone-there") == {"adopted": [], "decision": "in_progress"}
    assert real.attempt("gone-there#1").state == "sending"
    real.dispose()


HIDDEN_CHECKER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("leases", sys.argv[1])
leases = sys.modules["leases"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(leases)
pid, start = sys.argv[2:4]
me = leases.this_process()
owner = f"host:{pid}:tok@{me.boot}/{me.pidns}/{start}"
print(json.dumps({"sees": os.path.exists(f"/proc/{pid}"), "gone": leases.process_is_gone(owner)}))
"""


def test_a_live_owner_that_proc_hides_from_the_checker_is_never_taken_for_gone() -> None:
    """The checker runs as another user with /proc mounted ``hidepid=2``: the lease
    owner's /proc entry is hidden from it, though the process runs. Only the kernel's
    "no such process" proves it gone; a hidden entry used to be taken for a dead run,
    and its live lease taken over mid-call."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        missing("a hidepid /proc for another user", "needs root, unshare and setpriv")
    # The checker loads the leases module alone (stdlib only) from a place any user
    # may read, whatever the permissions of the checkout.
    place = Path(tempfile.mkdtemp(prefix="bt-leases-"))
    place.chmod(0o755)
    module = place / "leases.py"
    shutil.copy(ROOT / "budget_tasks" / "ledger" / "leases.py", module)
    module.chmod(0o644)
    as_nobody = [
        "unshare",
        "--mount",
        "sh",
        "-c",
        "mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 --regid=65534 "
        '--clear-groups "$@"',
        "sh",
        sys._base_executable,  # type: ignore[attr-defined]
        "-c",
        HIDDEN_CHECKER,
        str(module),
    ]

    def seen(pid: int, start: str) -> dict[str, bool]:
        done = subprocess.run(
            [*as_nobody, str(pid), start], capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            missing("a hidepid /proc for another user", done.stderr.strip())
        result: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    live = subprocess.Popen(["sleep", "60"])
    try:
        start = Path(f"/proc/{live.pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
        assert seen(live.pid, start) == {"sees": False, "gone": False}
    finally:
        live.kill()
        live.wait(10)
    assert seen(live.pid, start) == {"sees": False, "gone": True}  # now it is gone
    shutil.rmtree(place)
