"""The chaos suite's task, loaded by its workers with ``celery worker -I``.

``chaos.call(job, kill=None, fault=None)`` makes one billable chat completion through
the official openai SDK, as the example tasks do. ``kill`` names a point of the task
where the pool child SIGKILLs itself, on the first delivery only: the first delivery
that reaches that point creates a marker file in ``$CHAOS_MARKER_DIR`` (O_EXCL) and
dies; later deliveries find the marker and go on. ``fault`` goes to the fake
provider in the ``x-fake-fault`` header of the request (e.g. ``hang=3``).

Kill points, in the order the task meets them:

``before_reserve``  nothing written yet (in estimate_cost, which admission needs)
``granted``         the admission committed (lease, hold and grant in one
                    transaction), back in the task, before ``run``
``sending``         granted, the request not yet sent (top of run)
``after_response``  the provider answered, nothing settled (end of run)
``after_settle``    settled and the result stored, the message not yet acked
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from budget_tasks import BudgetTask, Ledger
from budget_tasks.config import ledger_of
from budget_tasks.ledger import CallLedger
from budget_tasks.providers import estimates
from tests.integration.worker_tasks import client
from tests.support.sdk_calls import openai_chat
from workers.app import app
from workers.tasks import BUDGET

KILL_POINTS = ("before_reserve", "granted", "sending", "after_response", "after_settle")
MARKER_DIR_ENV = "CHAOS_MARKER_DIR"


def chaos_request(job: str) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "max_completion_tokens": 32,
        # the tier named: the bound is priced at it, not at the dearest a project may use
        "service_tier": "default",
        "messages": [{"role": "user", "content": f"Classify ticket {job}."}],
    }


def estimate(job: str) -> int:
    return estimates.openai_chat(chaos_request(job)).amount


def marker(job: str, point: str, directory: Path | None = None) -> Path:
    return (directory or Path(os.environ[MARKER_DIR_ENV])) / f"{job}.{point}"


def die_once(job: str, kill: str | None, point: str) -> None:
    """SIGKILL this process if ``point`` is the job's kill point and it is the first
    delivery to get here."""
    if kill != point:
        return
    try:
        os.close(os.open(marker(job, point), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # a redelivery: it died here once already
    os.kill(os.getpid(), signal.SIGKILL)


class _DieOnceGrantedCalls:
    """The task's calls ledger, with a kill point right after an admission that
    granted the main attempt's send committed."""

    def __init__(self, calls: CallLedger, job: str, kill: str | None) -> None:
        self._calls, self._job, self._kill = calls, job, kill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._calls, name)

    def admit(self, key: str, **kwargs: Any) -> Any:
        start = self._calls.admit(key, **kwargs)
        if start.call is not None and start.call.reservation is not None:
            die_once(self._job, self._kill, "granted")
        return start


class _DieOnceGranted:
    """The task's ledger, its calls face with the kill point above."""

    def __init__(self, ledger: Ledger, job: str, kill: str | None) -> None:
        self._ledger = ledger
        self.calls = _DieOnceGrantedCalls(ledger.calls, job, kill)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)


class ChaosTask(BudgetTask):
    """A BudgetTask with the kill points that need a seam in the flow."""

    @property
    def ledger(self) -> Any:
        job, kill = self._job_and_kill()
        return _DieOnceGranted(ledger_of(self.app), job, kill)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        job, kill = self._job_and_kill(args, kwargs)
        die_once(job, kill, "after_settle")
        return result

    def _job_and_kill(self, args: Any = None, kwargs: Any = None) -> tuple[str, str | None]:
        args = self.request.args if args is None else args
        kwargs = (self.request.kwargs if kwargs is None else kwargs) or {}
        job = args[0] if args else kwargs.get("job", "")
        kill = args[1] if len(args) > 1 else kwargs.get("kill")
        return str(job), kill


def _estimate(job: str, kill: str | None = None, fault: str | None = None) -> int:
    die_once(job, kill, "before_reserve")
    return estimate(job)


@app.task(
    base=ChaosTask,
    bind=True,
    budget=BUDGET,
    name="chaos.call",
    idempotency_key=lambda job, kill=None, fault=None: f"chaos:{job}",
    estimate_cost=_estimate,
)
def call(self: ChaosTask, job: str, kill: str | None = None, fault: str | None = None) -> Any:
    die_once(job, kill, "sending")
    headers = {"x-fake-fault": fault} if fault else None
    sent = openai_chat(client(), attempt=self.attempt, extra_headers=headers, **chaos_request(job))
    die_once(job, kill, "after_response")
    return {"job": job, "cost": sent.cost, "request_id": sent.request_id}
