"""The main job: real Celery workers spending two tenants' budgets through one ledger.

On embedded defaults it needs no services: a SQLite ledger, kombu's SQLAlchemy
transport on SQLite as the broker, the fake provider in a thread, and a real
``celery worker`` process (prefork pool) running the reference app's
``workers.summarize`` (the project's ``workers/``, shipped as
:mod:`budget_tasks.reference`), which calls the provider through the official openai SDK.
``ledger_url`` and ``broker_url`` run the same scenario against PostgreSQL and Redis.

The scenario, each step checked against the ledger and against what the provider saw:
a worker killed mid-call and the redelivery that does not resend; a provider timeout
whose hold stays; concurrent admission of two tenants' jobs against caps that do not
fit them all; duplicate enqueues that replay; the beat jobs flagging and reconciling
the unknown outcomes; a final table and the invariants; then the ledger against the
provider's own usage and cost reports, before and after a call that went past it.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from ..delivery.keys import step_key
from ..ledger import Ledger
from ..providers import estimates
from ..testing import FakeProvider
from .checks import Checks, budget_rows, render_table
from .processes import Worker, wait_for, worker_env

Echo = Callable[[str], None]

APP, TASKS, SETTINGS = (
    "budget_tasks.reference.workers.app",
    "budget_tasks.reference.workers.tasks",
    "budget_tasks.reference.celeryconfig",
)
PROVIDER_TIMEOUT = 2  # seconds: the SDK gives up on the stalled call after this
STALE_AFTER = 1  # seconds: the demo's beat flags holds this old (production: 900)
KILL_DELAY = 4  # the provider answers the killed call after this long (billing it)
HANG = 4  # the stalled call is billed at once and answered after this long

TENANT_JOBS = {"acme": 24, "globex": 16}
#: cap in estimates: the jobs' estimates do not all fit, nor do their actual costs
CAP_IN_ESTIMATES = {"acme": 2, "globex": 2}


@dataclass
class Job:
    tenant: str
    budget: str
    document_id: str
    text: str
    result: Any = None
    state: str = "PENDING"
    error: str | None = None

    @property
    def key(self) -> str:
        return f"summarize:{self.document_id}"

    @property
    def call_key(self) -> str:
        """The attempt of the job's one SDK call, through the guarded client."""
        return step_key(self.key, "openai.chat", 1)


@dataclass
class Run:
    """What the scenario set up: where things are, and the handles on them."""

    home: Path
    ledger: Ledger
    fake: FakeProvider
    app: Any
    summarize: Any
    worker: Worker
    budgets: dict[str, str]
    run_id: str
    jobs: list[Job] = field(default_factory=list)
    #: when the scenario began (the drift check reads the reports from then)
    started: datetime = field(default_factory=lambda: datetime.now(UTC))


def document(tenant: str, index: int) -> str:
    lines = [
        f"{tenant.title()} quarterly report, section {index}.",
        "Revenue grew in every region; support tickets fell after the new release.",
        "The board asks for a plan to cut cloud costs without slowing the roadmap.",
        "Hiring stays flat until the next review.",
    ]
    return " ".join(lines[: 1 + index % len(lines)])


def run(
    ledger_url: str | None = None,
    broker_url: str | None = None,
    *,
    concurrency: int = 4,
    echo: Echo = click.echo,
) -> bool:
    """Run the scenario; True if every invariant it checks held."""
    with (
        tempfile.TemporaryDirectory(prefix="budget-tasks-demo-") as tmp,
        _setup(Path(tmp), ledger_url, broker_url, concurrency, echo) as scenario,
    ):
        try:
            return _play(scenario, echo)
        except TimeoutError as exc:
            raise click.ClickException(str(exc)) from exc


@contextmanager
def _setup(
    home: Path, ledger_url: str | None, broker_url: str | None, concurrency: int, echo: Echo
) -> Iterator[Run]:
    ledger_url = ledger_url or f"sqlite:///{home / 'ledger.db'}"
    broker_url = broker_url or f"sqla+sqlite:///{home / 'broker.db'}"
    redis_broker = broker_url.startswith(("redis://", "rediss://"))
    backend_url = broker_url if redis_broker else f"db+sqlite:///{home / 'results.db'}"
    ledger = Ledger(ledger_url)
    ledger.create_schema()
    run_id = uuid.uuid4().hex[:6]
    existing = {b.name for b in ledger.budgets()}
    # a ledger used before (PostgreSQL) keeps its budgets: this run gets its own
    budgets = {t: t if t not in existing else f"{t}-{run_id}" for t in TENANT_JOBS}

    fake = FakeProvider().start()
    env = worker_env(
        broker=broker_url,
        backend=backend_url,
        ledger=ledger_url,
        home=home,
        provider=fake.openai_base_url,
        BUDGET_TASKS_PROVIDER_TIMEOUT=str(PROVIDER_TIMEOUT),
        BUDGET_TASKS_STALE_AFTER=str(STALE_AFTER),
        BUDGET_TASKS_RECONCILE_MARGIN="0",
    )
    # This process is the producer, with the same app and settings as the worker: the
    # reference app reads them from the environment when it is imported.
    os.environ.update(env)
    for module in (APP, TASKS, SETTINGS):
        sys.modules.pop(module, None)
    app = importlib.import_module(APP).app
    summarize = importlib.import_module(TASKS).summarize

    echo("budget-tasks demo: Celery workers spend two tenants' budgets through one ledger")
    echo(f"  ledger    {_redact(ledger_url)}")
    echo(f"  broker    {_redact(broker_url)}  (acks_late, prefetch 1)")
    echo(f"  provider  fake OpenAI API at {fake.url}, called with the official openai SDK")
    started = time.monotonic()
    worker = Worker(env, f"demo-{run_id}", home, concurrency, include="", app=APP, cwd=home)
    try:
        worker.wait_ready()
        echo(
            f"  worker    celery -A {APP} worker, prefork pool of {concurrency}"
            f" (ready in {time.monotonic() - started:.1f}s)"
        )
        yield Run(home, ledger, fake, app, summarize, worker, budgets, run_id)
    except BaseException:
        echo(f"\nworker log ({worker.log_path}):\n{worker.log_path.read_text()[-3000:]}")
        raise
    finally:
        # every job has finished; kombu's SQLite transport can take long to shut down
        worker.stop(timeout=5)
        fake.stop()
        app.close()
        ledger.dispose()


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest and ":" in rest.split("@", 1)[0]:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        return f"{scheme}{sep}{user}:***@{rest.split('@', 1)[1]}"
    return url


def _play(run: Run, echo: Echo) -> bool:
    checks = Checks(echo)
    ledger, fake = run.ledger, run.fake
    # the most a summary's call may cost: what the guarded client reserves for it
    tasks = importlib.import_module(TASKS)
    estimate = estimates.openai_chat(tasks.summary_request(document("acme", 3))).amount
    for tenant, budget in run.budgets.items():
        cap = CAP_IN_ESTIMATES[tenant] * estimate + estimate // 2
        ledger.create_budget(budget, cap, tenant=tenant)
    echo(
        f"\nbudgets: {', '.join(f'{b} cap {ledger.budget(b).cap}' for b in run.budgets.values())}"
        f" micro-USD; a summary reserves up to {estimate} before it is sent"
    )

    # 1. A worker killed mid-call --------------------------------------------------
    echo("\n1. a worker process is killed while its request is at the provider")
    killed = _job(run, "acme", f"acme-{run.run_id}-killed", 0)
    fake.plan(f"delay={KILL_DELAY}", path="/chat/completions")
    handle = _send(run, killed)
    wait_for(lambda: _requests(fake, ledger, killed.key), what="the request to reach the provider")
    pid = _running_pid(ledger, killed.key)
    os.kill(pid, signal.SIGKILL)
    echo(f"   SIGKILL to pool process {pid}; Celery requeues the message (acks_late)")
    _collect(run, [(killed, handle)], "   waiting for the redelivery", echo)
    attempt = ledger.attempt(killed.call_key)
    echo(f"   redelivery: {killed.error}")
    checks.expect(
        "the redelivery did not resend: one request reached the provider",
        len(_requests(fake, ledger, killed.key)) == 1,
    )
    checks.expect(
        f"the killed call's hold of {attempt.amount} is kept (attempt '{attempt.state}')",
        attempt.state == "unknown" and ledger.balance(killed.budget).held == attempt.amount,
    )

    # 2. A provider timeout ----------------------------------------------------------
    echo(f"\n2. the provider bills a call, then stalls past the {PROVIDER_TIMEOUT}s SDK timeout")
    slow = _job(run, "globex", f"globex-{run.run_id}-slow", 1)
    fake.plan(f"hang={HANG}", path="/chat/completions")
    _collect(run, [(slow, _send(run, slow))], "   waiting for the timeout", echo)
    timed_out = ledger.attempt(slow.call_key)
    echo(f"   task failed: {slow.error}")
    # What the worker raised, as the ledger recorded it: a result backend that cannot
    # rebuild an SDK error (openai's need their request) hands back a base class.
    echo(f"   the attempt's record: {timed_out.note}")
    checks.expect(
        f"the timeout released nothing: hold of {timed_out.amount} kept, no SDK retry",
        timed_out.state == "unknown"
        and ledger.balance(slow.budget).held == timed_out.amount
        and len(_requests(fake, ledger, slow.key)) == 1,
    )

    # 3. Concurrent admission --------------------------------------------------------
    total = sum(TENANT_JOBS.values())
    echo(f"\n3. {total} jobs for two tenants are enqueued at once, {TENANT_JOBS}")
    load: list[Job] = []
    for index in range(max(TENANT_JOBS.values())):
        for tenant, count in TENANT_JOBS.items():
            if index < count:
                load.append(_job(run, tenant, f"{tenant}-{run.run_id}-{index:02d}", index))
    _collect(run, [(job, _send(run, job)) for job in load], "   running", echo)
    for tenant in TENANT_JOBS:
        mine = [j for j in load if j.tenant == tenant]
        done = sum(j.state == "SUCCESS" for j in mine)
        denied = sum(j.state == "DENIED" for j in mine)
        echo(f"   {tenant}: {done} summarised, {denied} denied (BudgetExceeded)")
    checks.expect(
        "every job either ran or was denied before any request",
        all(j.state in ("SUCCESS", "DENIED") for j in load)
        and all(not _requests(fake, ledger, j.key) for j in load if j.state == "DENIED"),
    )
    checks.expect(
        "both caps bound: each tenant had jobs denied",
        all(any(j.tenant == t and j.state == "DENIED" for j in load) for t in TENANT_JOBS),
    )

    # 4. Duplicate enqueues ----------------------------------------------------------
    again = [j for j in load if j.state == "SUCCESS"][:6]
    echo(f"\n4. {len(again)} finished jobs are enqueued again (same business keys)")
    before = len(fake.served())
    copies = [Job(j.tenant, j.budget, j.document_id, j.text) for j in again]
    _collect(run, [(c, _send(run, c)) for c in copies], "   running", echo)
    checks.expect(
        "each replayed its stored summary; no new request reached the provider",
        all(c.result == j.result for c, j in zip(copies, again, strict=True))
        and len(fake.served()) == before,
    )

    # 5. Beat: flag, then reconcile ------------------------------------------------
    echo("\n5. the beat jobs run (here sent by the demo; in production by celery beat)")
    unknown = [attempt.key, timed_out.key]
    # Production reconciles minutes later; here, wait until the provider has finished
    # (and billed) both calls, as it will have by then.
    wait_for(
        lambda: all(fake.billed_for(k, ledger) for k in unknown), what="the provider to finish"
    )
    flagged = run.app.send_task("budget_tasks.flag_stale_holds").get(timeout=60)
    echo(f"   budget_tasks.flag_stale_holds: {flagged} stale holds flagged for an operator")
    found = _reconcile(run, unknown, echo)
    for key in unknown:
        a = ledger.attempt(key)
        echo(
            f"   {key}: held {a.amount}, provider billed {fake.billed_for(key, ledger)}, {a.state}"
        )
    checks.expect(
        "the unknown holds were flagged, then settled at what the provider billed",
        flagged >= 2
        and found
        and all(
            ledger.attempt(k).state == "settled"
            and ledger.attempt(k).actual == fake.billed_for(k, ledger)
            for k in unknown
        ),
    )
    # Found calls leave their operations retryable (with BUDGET_TASKS_REQUEUE_NOT_FOUND=1
    # beat enqueues them itself): each run again takes its call's reconciled answer.
    resent = [Job(j.tenant, j.budget, j.document_id, j.text) for j in (killed, slow)]
    _collect(
        run,
        [(job, _send(run, job)) for job in resent],
        "   the killed and the timed-out jobs, enqueued again",
        echo,
    )
    checks.expect(
        "both now replay their reconciled answers, still one request each",
        all(j.state == "SUCCESS" for j in resent)
        and all(len(_requests(fake, ledger, j.key)) == 1 for j in resent),
    )

    # 6. The books ------------------------------------------------------------------
    rows = budget_rows(ledger, run.budgets, run.jobs)
    echo("\n" + render_table(rows))
    billed = sum(
        fake.billed_for(a.key, ledger)
        for b in run.budgets.values()
        for a in ledger.attempts(budget=b)
    )
    spent = sum(r.spent for r in rows)
    echo(f"   provider billed {billed}; ledger spent {spent}")
    checks.invariants(ledger, fake, run.budgets, rows, billed)
    _drift(run, checks, echo)
    echo("\nall invariants held" if checks.ok else "\nSOME INVARIANTS FAILED")
    return checks.ok


def _drift(run: Run, checks: Checks, echo: Echo) -> None:
    """The ledger against the provider's own usage and cost reports, read with an
    admin key; then a call straight to the provider (a plain SDK client: past the
    ledger), and the drift it makes."""
    import openai

    from ..drift import Threshold, check_drift
    from ..providers import registry
    from ..providers.base import sdk_client

    echo("\n7. the provider's own usage and cost reports, read with an admin key")
    vendor = registry.vendor("openai")
    admin = sdk_client(
        vendor, base_url=run.fake.openai_base_url, api_key="sk-admin-demo", timeout=10.0
    )
    exact = Threshold(relative=0.0, tokens=0, money=0)

    def check() -> Any:
        # The fake's reports are complete at once; a real provider's lag, and a day's
        # costs are final 12 hours after the day is over: checked as of two days on
        # (one day on, a run in the first 12 hours of a UTC day found today's pending)
        return check_drift(
            run.ledger,
            vendor,
            since=run.started,
            bucket="1m",
            by="model",
            settle=timedelta(0),
            threshold=exact,
            admin=admin,
            now=datetime.now(UTC) + timedelta(days=2),
        )

    clean = check()
    for measure in ("input_tokens", "output_tokens", "cost"):
        ledger, provider = clean.totals(measure)
        echo(f"   {measure.replace('_', ' ')}: ledger {ledger}, provider's report {provider}")
    checks.expect(
        "the ledger agrees with the provider's reports, to the token and the micro-dollar",
        clean.lines != [] and clean.drifted == [],
    )
    plain = openai.OpenAI(
        base_url=run.fake.openai_base_url, api_key="sk-demo-bypass", max_retries=0
    )
    answer = plain.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=64,
        messages=[{"role": "user", "content": "A call nobody reserved for."}],
    )
    plain.close()
    usage = answer.usage
    assert usage is not None  # the fake, as the API, reports a completion's usage
    past = [s for s in run.fake.served() if s.method == "POST" and not s.idempotency_key]
    echo(
        f"   a plain SDK client calls the provider directly: {usage.total_tokens} "
        f"tokens, billed {sum(s.billed for s in past)}"
    )
    drifted = check().drifted
    for line in drifted:
        echo(
            f"   drift: {line.group} {line.measure.replace('_', ' ')}: ledger {line.ledger}, "
            f"provider {line.provider} ({line.difference:+d})"
        )
    found = {line.measure: line.difference for line in drifted}
    checks.expect(
        "the drift is that call: its tokens and its cost, nothing else",
        found
        == {
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "cost": sum(s.billed for s in past),
        },
    )


def _job(run: Run, tenant: str, document_id: str, index: int) -> Job:
    job = Job(tenant, run.budgets[tenant], document_id, document(tenant, index))
    run.jobs.append(job)
    return job


def _send(run: Run, job: Job) -> Any:
    if job not in run.jobs:
        run.jobs.append(job)
    return run.summarize.apply_async(
        args=[job.document_id, job.text], kwargs={"tenant": job.budget}
    )


def _requests(fake: FakeProvider, ledger: Ledger, key: str) -> list[Any]:
    """The requests of operation ``key``'s calls (sent under provider keys)."""
    return [
        s
        for s in fake.served_as(ledger)
        if s.method == "POST" and (s.idempotency_key or "").startswith(key + ":")
    ]


def _running_pid(ledger: Ledger, key: str) -> int:
    """The pool process running ``key``: its lease names it (``host:pid:token``)."""
    owner = wait_for(lambda: ledger.operation(key).lease_owner, what="the lease")
    return int(str(owner).split(":")[1])


def _collect(
    run: Run, pending: list[tuple[Job, Any]], label: str, echo: Echo, timeout: float = 180.0
) -> None:
    """Wait for every job's result, with a progress bar; record each outcome."""
    from ..errors import BudgetExceeded

    deadline = time.monotonic() + timeout
    left = list(pending)
    # the bar only on a terminal; a log gets the one line printed at the end
    hidden = not sys.stdout.isatty()
    with click.progressbar(length=len(pending), label=label, width=30, hidden=hidden) as bar:
        while left and time.monotonic() < deadline:
            still = []
            for job, handle in left:
                if not handle.ready():
                    still.append((job, handle))
                    continue
                if handle.successful():
                    job.state, job.result = "SUCCESS", handle.result
                else:
                    error = handle.result
                    job.state = "DENIED" if isinstance(error, BudgetExceeded) else "FAILED"
                    job.error = f"{type(error).__name__}: {error}"
                bar.update(1)
            left = still
            if left:
                time.sleep(0.1)
    if left:
        raise click.ClickException(f"{len(left)} jobs did not finish in {timeout:.0f}s")
    elapsed = timeout - (deadline - time.monotonic())
    echo(f"{label}: {len(pending)} finished in {elapsed:.1f}s")


def _reconcile(run: Run, keys: list[str], echo: Echo, timeout: float = 60.0) -> bool:
    """Send reconcile_unknown as beat would, until every key is resolved (a lookup that
    finds the call still running answers 'pending' and backs off)."""
    deadline = time.monotonic() + timeout
    totals: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = run.app.send_task("budget_tasks.reconcile_unknown").get(timeout=60)
        for name, n in counts.items():
            totals[name] = totals.get(name, 0) + n
        if all(run.ledger.attempt(k).state != "unknown" for k in keys):
            run.ledger.dispose()
            shown = ", ".join(f"{n} {name}" for name, n in totals.items() if n)
            echo(f"   budget_tasks.reconcile_unknown: {shown}")
            return True
        time.sleep(1.0)
    return False
