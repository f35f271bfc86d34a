"""What `budget-tasks demo` must print when every check held (shared by the tests that
run it: from the checkout against PostgreSQL and Redis, from an installed wheel on its
embedded defaults)."""

from __future__ import annotations

import re
from pathlib import Path

DEMO_CLAIMS = 16  # every "[ok]" line the scenario prints when an invariant held


def check_embedded_demo(out: str, home: Path) -> None:
    """The demo on embedded defaults: a kill, a timeout, reconciliation, both tenants'
    rows, every claim held, nothing left in the user's home."""
    assert "ledger    sqlite:///" in out and "broker    sqla+sqlite:///" in out
    assert re.search(r"SIGKILL to pool process \d+", out)
    # the SDK's timeout (its class may come back as a base class: a result backend
    # that pickles cannot rebuild openai's errors, which need their request)
    assert "OutcomeUnknown" in out and "Request timed out." in out
    assert "the attempt's record: ReadTimeout" in out
    assert "2 stale holds flagged" in out and "reconcile_unknown: 2 found" in out
    assert "[FAILED]" not in out
    assert out.count("[ok]") == DEMO_CLAIMS
    assert out.rstrip().endswith("all invariants held")
    for tenant in ("acme", "globex"):
        [line] = [x for x in out.splitlines() if x.split()[:1] == [tenant]]
        cap, jobs, done_jobs, denied, _, reserved, spent, held, overrun = map(int, line.split()[1:])
        assert jobs == done_jobs + denied and done_jobs > 0 and denied > 0
        assert 0 < spent <= cap < reserved  # holds are estimates; the spend fits the cap
        assert (held, overrun) == (0, 0)
    assert not (home / ".budget-tasks").exists() or not any((home / ".budget-tasks").iterdir())
