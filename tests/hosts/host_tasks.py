"""The hosts suite's task, loaded by each host's workers with ``celery worker -I``
(and, with ``HOSTS_CLOCK_SKEW`` set, a host clock that is wrong by that many seconds).
Scenario 5 also runs ``celery -A tests.hosts.host_tasks beat`` on two hosts, with the
beat jobs' schedule and the ledger's clock sped up alike (see ``SIM_CLOCK_ENV``).

``hosts.call(job, fault=None)`` makes one billable chat completion through the official
openai SDK, as the chaos task does, with a short lease (so that a test waits seconds,
not the default ten minutes, for the lease of a host that died) and a short wait
before a delivery that found another run's live lease tries again.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from celery.schedules import schedule
from celery.signals import task_postrun, task_prerun

import budget_tasks.config as ledger_config
import budget_tasks.ledger.store as ledger_base
from budget_tasks import BudgetTask, Ledger
from budget_tasks.providers import estimates
from budget_tasks.wiring import BEAT_SCHEDULE
from tests.chaos.worker_tasks import chaos_request
from tests.integration.worker_tasks import client
from tests.support.sdk_calls import openai_chat
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

#: Scenario 5's ledger time, ``START,RATE,FILE``: the ledger's clock stands at START
#: (ISO 8601) until FILE holds a real epoch second, from which it runs RATE times as
#: fast as the real clock. Every process of every host reads this machine's one real
#: clock, so all of them agree on the ledger's time, as hosts that follow the
#: database's clock do; the test starts the hour once every host is up.
SIM_CLOCK_ENV = "HOSTS_SIM_CLOCK"
#: Scenario 5's beat: the real seconds between two runs of each job beat runs every
#: minute (the job's own schedule divided by the clock's rate).
BEAT_EVERY_ENV = "HOSTS_BEAT_EVERY"
#: Scenario 5: a file each run of a beat job is written to (host, pid, start, end,
#: result), to show what ran where and when.
BEAT_TRACE_ENV = "HOSTS_BEAT_TRACE"
#: The beat jobs that run every minute, and so race every minute under two beats.
EVERY_MINUTE = (
    "budget-tasks-flag-stale-holds",
    "budget-tasks-reconcile-unknown",
    "budget-tasks-renew-periods",
)


def sim_clock(spec: str) -> Any:
    start_text, rate_text, path = spec.split(",", 2)
    start, rate = datetime.fromisoformat(start_text), float(rate_text)
    began: list[float] = []

    def now() -> datetime:
        if not began:
            try:
                began.append(float(Path(path).read_text()))
            except FileNotFoundError:
                return start
        return start + timedelta(seconds=(time.time() - began[0]) * rate)

    return now


if os.environ.get(SIM_CLOCK_ENV):
    # every ledger the worker opens (config.ledger_for makes them) keeps this clock
    ledger_config.Ledger = functools.partial(  # type: ignore[misc]
        Ledger, clock=sim_clock(os.environ[SIM_CLOCK_ENV])
    )


class OnTheClock(schedule):  # type: ignore[misc]
    """Due at every multiple of ``run_every`` of the wall clock, as a crontab entry is
    due at every minute: two beats with this schedule fire together, as two beats with
    a crontab do (an interval counts from each beat's own start instead)."""

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        every = self.seconds
        now = time.time()
        last = self.maybe_make_aware(last_run_at).timestamp()
        return now // every > last // every, every - now % every


if os.environ.get(BEAT_EVERY_ENV):
    _every = float(os.environ[BEAT_EVERY_ENV])
    # only what runs every minute: the hourly and daily jobs would not race in an hour
    app.conf.beat_schedule = {
        name: {**BEAT_SCHEDULE[name], "schedule": OnTheClock(_every)} for name in EVERY_MINUTE
    }

if os.environ.get(BEAT_TRACE_ENV):
    _trace_path = os.environ[BEAT_TRACE_ENV]
    _started: dict[str, float] = {}

    def _beat_job_started(task_id: str, task: Any, **_: Any) -> None:
        if task.name.startswith("budget_tasks."):
            _started[task_id] = time.time()

    def _beat_job_ended(task_id: str, task: Any, retval: Any = None, **_: Any) -> None:
        start = _started.pop(task_id, None)
        if start is None:
            return
        line = {
            "job": task.name,
            "id": task_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": start,
            "end": time.time(),
            "result": retval if isinstance(retval, int | dict) else repr(retval),
        }
        # one write of one line, appended: the runs of every host's processes interleave
        with open(_trace_path, "a") as trace:
            trace.write(json.dumps(line) + "\n")

    task_prerun.connect(_beat_job_started, weak=False)
    task_postrun.connect(_beat_job_ended, weak=False)


class HostTask(BudgetTask):
    lease_seconds = LEASE_SECONDS
    in_progress_countdown = 0.5


def _one_call(task: HostTask, job: str, fault: str | None, store: bool = True) -> Any:
    headers = {"x-fake-fault": fault} if fault else None
    sent = openai_chat(
        client(),
        attempt=task.attempt,
        extra_headers=headers,
        store_for_lookup=store,
        **chaos_request(job),
    )
    return {"job": job, "cost": sent.cost, "request_id": sent.request_id}


class LongLeaseTask(HostTask):
    """A lease longer than the call: a run that does not outlive its lease."""

    lease_seconds = 4 * LEASE_SECONDS


class HourTask(HostTask):
    """Scenario 5's task: its lease is counted on the sped-up ledger clock, where the
    run's real second is minutes long."""

    lease_seconds = 3600.0


def _register(name: str, base: type[HostTask], store: bool = True) -> Any:
    def run(self: HostTask, job: str, fault: str | None = None) -> Any:
        return _one_call(self, job, fault, store)

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
call_for_an_hour = _register("hosts.call_for_an_hour", HourTask)
#: Not stored at the provider: nothing can find it again, its hold waits for an operator
call_unstored = _register("hosts.call_unstored", HourTask, store=False)
