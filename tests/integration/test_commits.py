"""Two ledger commits per run of a task that makes one billable call: counted by
PostgreSQL itself (``pg_stat_database.xact_commit`` of a scratch database nothing else
uses) and the statements by the driver, through the benchmark that reports them
(``make bench``, section 6), with BudgetTasks calling the fake provider through the
official SDK: on the Quick start's path (``estimate_cost`` 0, the guarded client: the
lease is taken with the call's admission, the call settled with the run's end)."""

from __future__ import annotations

import pytest

from benchmarks import commit_count

from ..services import check_postgres

pytestmark = pytest.mark.postgres

TASKS = 50
#: Per batch (after the counters are flushed) the ledger's new pooled connection
#: commits its session settings, and psycopg prepares each statement it sends again
#: (the two function calls) once per connection: sent alone (autocommit), each
#: preparation is a transaction of its own. Four commits, spread over the batch.
SETUP = 4 / TASKS


def test_the_quick_starts_task_commits_twice_a_replay_and_a_denial_once() -> None:
    check_postgres()
    counts = commit_count.run(TASKS)
    assert counts.tasks == TASKS
    for kind, target in (("first run", 2), ("replay", 1), ("denial", 1)):
        assert target <= counts.commits[kind] <= target + SETUP + 1e-9, (kind, counts)
    # one function call each way: the run admitted with its call, the call settled with
    # the run's end (its answer stored); a replay reads the stored result
    assert counts.statements["first run"] == 2
    assert counts.statements["replay"] == 1
    # a denial: the function declines (a refusal is the statement path's to decide),
    # the statement path's transaction rolls back, then one statement records the
    # refusal; nothing else is written
    assert counts.rollbacks["denial"] == 2
    assert counts.rollbacks["first run"] == counts.rollbacks["replay"] == 0
    # the database runs on this host: its backends' CPU is read (in clock ticks of 10
    # ms: fifty replays, about 0.3 ms each, may read as 0), and a replay costs less
    assert counts.server_cpu_ms["first run"] > 0
    assert 0 <= counts.server_cpu_ms["replay"] < counts.server_cpu_ms["first run"]
