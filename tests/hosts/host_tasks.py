"""The hosts suite's task, loaded by each host's workers with ``celery worker -I``
(and, with ``HOSTS_CLOCK_SKEW`` set, a host clock that is wrong by that many seconds).

``hosts.call(job, fault=None)`` makes one billable chat completion through the official
openai SDK, as the chaos task does, with a short lease (so that a test waits seconds,
not the default ten minutes, for the lease of a host that died) and a short wait
before a delivery that found another run's live lease tries again.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import budget_tasks.ledger.base as ledger_base
from budget_tasks import BudgetTask
from budget_tasks.providers import estimates, openai_chat
from tests.chaos.worker_tasks import chaos_request
from tests.integration.worker_tasks import client
from workers.app import app
from workers.tasks import BUDGET

LEASE_SECONDS = 6.0
#: This host's clock, off by this many seconds (scenario 4): the clock the ledger reads
#: as "this host's" is replaced in the worker, as a host whose clock is wrong.
SKEW_ENV = "HOSTS_CLOCK_SKEW"

if os.environ.get(SKEW_ENV):
    _skew = timedelta(seconds=float(os.environ[SKEW_ENV]))

    def _skewed_now() -> datetime:
        return datetime.now(UTC) + _skew

    ledger_base._utcnow = _skewed_now  # type: ignore[attr-defined]


class HostTask(BudgetTask):
    lease_seconds = LEASE_SECONDS
    in_progress_countdown = 0.5


def _one_call(task: HostTask, job: str, fault: str | None) -> Any:
    headers = {"x-fake-fault": fault} if fault else None
    sent = openai_chat(client(), attempt=task.attempt, extra_headers=headers, **chaos_request(job))
    return {"job": job, "cost": sent.cost, "request_id": sent.request_id}


class LongLeaseTask(HostTask):
    """A lease longer than the call: a run that does not outlive its lease."""

    lease_seconds = 4 * LEASE_SECONDS


def _register(name: str, base: type[HostTask]) -> Any:
    def run(self: HostTask, job: str, fault: str | None = None) -> Any:
        return _one_call(self, job, fault)

    return app.task(
        base=base,
        bind=True,
        budget=BUDGET,
        name=name,
        idempotency_key=lambda job, fault=None: f"hosts:{job}",
        estimate_cost=lambda job, fault=None: estimates.openai_chat(chaos_request(job)).amount,
    )(run)


call = _register("hosts.call", HostTask)
call_long_lease = _register("hosts.call_long_lease", LongLeaseTask)
