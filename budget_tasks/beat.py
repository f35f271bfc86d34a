"""Periodic ledger jobs for Celery beat: flag stale holds, reconcile unknown outcomes
with the provider, open budget periods (and the journal's partitions ahead), purge old
payloads, archive settled months, and compare the ledger with the providers' own usage
and cost reports (drift, hourly, where an admin key is set).

Nothing here releases money because time passed: a hold whose outcome is unknown is
flagged (and alerted through :data:`stale_hold`), and only a provider's answer, or an
operator, resolves it. Every job is safe to run twice at once: claims are made by
the database (conditional UPDATEs, SKIP LOCKED, unique constraints), not in Python.

``budget_tasks.configure(app)`` registers and schedules them; tune them with the settings
``budget_stale_after`` (seconds, default 900), ``budget_reconcile_margin`` (seconds
past the client timeout before "not found" counts, default 300),
``budget_requeue_not_found`` (default False), ``budget_retention_days`` (default 7), and
``budget_ledger_retention_days`` with ``budget_archive_dir`` (PostgreSQL; unset: every
row is kept), and for drift ``budget_drift_since`` (seconds, default 2 days),
``budget_drift_by`` (``model``, ``api_key``, ``project`` or empty; default ``model``),
``budget_drift_bucket`` (``1m``, ``1h`` or ``1d``: the token windows; default ``1h``),
``budget_drift_settle`` (seconds, default 3600), ``budget_drift_cost_settle`` (seconds,
default 43200), ``budget_drift_relative``,
``budget_drift_min_tokens`` and ``budget_drift_min_cost`` (micro-USD).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from datetime import datetime, timedelta
from functools import cache
from typing import Any, TypeVar

from celery import shared_task

from . import signals
from ._trust import doubt
from .config import ledger_of
from .drift import (
    DEFAULT_COST_SETTLE,
    DEFAULT_SETTLE,
    DEFAULT_THRESHOLD,
    Threshold,
    check_drift,
)
from .errors import BudgetTasksError
from .hooks import RECONCILE_OUTCOMES, hooks
from .ledger import Attempt, Hold, Ledger
from .ledger.records import NO_TIMEOUT_MS, UNTRUSTED_LOOKUP, Answered, Purged, Resolved, Retained
from .ledger.states import nothing_sent_under
from .providers import Found, Lookup, LookupFacts, NotFound, Unknowable, Vendor, registry
from .providers.clients import DEFAULT_MARGIN, settle_after

log = logging.getLogger("budget_tasks.beat")

#: Sent once per hold when it is flagged stale, with ``hold=`` (a Hold), by the signals
#: sink (:mod:`budget_tasks.signals`, where the others are). Connect an alert to it:
#: ``@stale_hold.connect def page(sender, hold, **kw): ...``
stale_hold = signals.stale_hold


Clients = Callable[[str], Any]
Requeue = Callable[[str, str, dict[str, Any]], None]


def flag_stale_holds(ledger: Ledger, older_than: timedelta) -> list[Hold]:
    """Flag holds in sending/unknown older than ``older_than``, each once; log, count
    and announce them. Nothing is released."""
    flagged = ledger.upkeep.flag_stale(older_than)
    for hold in flagged:
        log.warning(
            "stale hold: budget=%s attempt=%s state=%s amount=%d request_id=%s age=%s",
            hold.budget,
            hold.key,
            hold.state,
            hold.amount,
            hold.request_id,
            hold.age,
        )
        hooks.stale(hold=hold)  # the signals sink sends stale_hold
    return flagged


def _settle_after(attempt: Attempt, client: Any, margin: timedelta) -> timedelta | None:
    """How long after its send the provider may still be working on ``attempt``: the
    timeout it was sent with (else the lookup client's) plus ``margin``; None when it
    was sent with no finite timeout, or none is known (it may run for ever: never "not
    found")."""
    if attempt.timeout_ms == NO_TIMEOUT_MS:
        return None
    if attempt.timeout_ms is not None:
        return timedelta(milliseconds=attempt.timeout_ms) + margin
    try:
        return settle_after(client, margin)
    except ValueError:
        return None


def look_up(
    attempt: Attempt,
    clients: Clients,
    margin: timedelta = DEFAULT_MARGIN,
    now: datetime | None = None,
    provider_key: str | None = None,
) -> Lookup:
    """Ask the provider about one attempt, through the vendor its recorded lookup names
    (``now``: the ledger's time, which the attempt's age is measured by;
    ``provider_key``: what the call was sent as, when it is not the attempt key)."""
    if attempt.lookup is None or attempt.model is None:
        return Unknowable("the attempt never recorded which call it was")
    if attempt.lookup == "none":
        return Unknowable("the call was sent without storing it: the provider cannot find it")
    if attempt.lookup == UNTRUSTED_LOOKUP:
        return Unknowable(
            "its answer reported usage past what its request allowed: an operator resolves it"
        )
    vendor = registry.for_lookup(attempt.lookup)
    if vendor is None:
        return Unknowable(f"no vendor has a lookup named {attempt.lookup!r}")
    sent_at = attempt.sending_at or attempt.created_at
    facts = LookupFacts(
        lookup=attempt.lookup,
        model=attempt.model,
        key=attempt.key,
        provider_key=provider_key or attempt.key,
        response_id=attempt.response_id,
        sent_at=sent_at,
        settle_after=_settle_after(attempt, _Lazy(clients, vendor.name), margin),
        now=now,
        request=attempt.request_digest,
    )
    return vendor.look_up(facts, clients, None)


class _Lazy:
    """A vendor's lookup client, built only if its timeout is asked for."""

    def __init__(self, clients: Clients, name: str) -> None:
        self._clients, self._name = clients, name

    @property
    def timeout(self) -> Any:
        client = self._clients(self._name)
        return None if client is None else getattr(client, "timeout", None)


def reconcile_unknown(
    ledger: Ledger,
    clients: Clients,
    *,
    margin: timedelta = DEFAULT_MARGIN,
    limit: int = 50,
    requeue: Requeue | None = None,
) -> dict[str, int]:
    """First adopt what runs that are gone left behind (attempts left sending become
    unknown, holds never sent are released). Then look up unknown attempts that are due
    (each backs off between lookups):

    - Found settles the provider's charge (never below the usage its run recorded) and
      keeps its answer; an operation that no live run holds, whose latest attempt this
      is, adopts the answer (a later delivery replays it); one whose found call was a
      labelled call of its run becomes retryable (enqueued again with ``requeue``: its
      delivery replays the call and does the rest);
    - NotFound, once past the time the provider could still be working on the call,
      releases the hold (settles it at the recorded usage, if its run recorded any) and
      makes such an operation retryable (enqueued again with ``requeue``);
    - Pending and Unknowable leave the hold as it is.

    An attempt that moved meanwhile (an operator, a late run) keeps what they wrote:
    one failure never stops the others."""
    counts = dict.fromkeys(RECONCILE_OUTCOMES, 0)
    for key in ledger.upkeep.mark_orphans_unknown():
        log.warning("attempt %s was left sending by a run that is gone: now unknown", key)
    for attempt in ledger.upkeep.claim_unknown(limit=limit):
        try:
            name = _reconcile_one(ledger, attempt, clients, margin, requeue)
        except (BudgetTasksError, ValueError) as exc:
            log.warning("reconciling %s: it moved meanwhile or was refused: %s", attempt.key, exc)
            name = "failed"
        except Exception as exc:  # a broken lookup must not stop the others
            log.exception("lookup of %s failed: %s", attempt.key, exc)
            name = "failed"
        counts[name] += 1
        hooks.reconciled(attempt=attempt.key, outcome=name)
    return counts


def _told_settled(attempt: Attempt, actual: int) -> None:
    hooks.settled(
        budget=attempt.budget,
        attempt=attempt.key,
        amount=attempt.amount,
        actual=actual,
        by="reconcile",
    )


def _reconcile_one(
    ledger: Ledger, attempt: Attempt, clients: Clients, margin: timedelta, requeue: Requeue | None
) -> str:
    recorded = attempt.recorded_actual or 0
    if nothing_sent_under(attempt.operation_key, attempt.label, attempt.amount, recorded):
        # marked unknown before this rule: no provider could know of it
        ledger.upkeep.resolve_attempt(
            attempt.key,
            0,
            note="a main attempt of 0: nothing sent under it",
            by="reconcile",
            expected="unknown",
        )
        hooks.released(budget=attempt.budget, attempt=attempt.key, amount=0, by="reconcile")
        return "not_found"
    outcome = look_up(
        attempt, clients, margin, ledger.upkeep.now(), ledger.upkeep.provider_key(attempt.key)
    )
    if isinstance(outcome, Found):
        why = doubt(outcome.usage, outcome.actual, attempt.bound)
        if why is not None:
            # What a provider (or a gateway) claims past what the request allowed is
            # never charged: the hold stays for an operator, and no later lookup asks.
            if not ledger.upkeep.distrust(attempt.key, why):
                return _moved(attempt.key, ledger.attempt(attempt.key).state)
            hooks.untrusted(budget=attempt.budget, attempt=attempt.key, reason=why, by="reconcile")
            log.warning("reconciling %s: found, but not charged: %s", attempt.key, why)
            return "untrusted"
        actual = max(outcome.actual, recorded)
        done = ledger.upkeep.resolve_attempt(
            attempt.key,
            actual,
            note="found at the provider",
            by="reconcile",
            answer=outcome.result,
            expected="unknown",
            answered=Answered(
                input_tokens=outcome.usage.input_total, output_tokens=outcome.usage.output_tokens
            ),
        )
        if not done.applied:
            return _moved(done.key, done.state)
        _told_settled(attempt, actual)
        # A labelled call found leaves the rest of its run to do: its operation is
        # retryable, and its next delivery replays what was found.
        _requeue_if_retryable(ledger, done, requeue)
        log.info(
            "reconciled %s: found at the provider, charged %d%s",
            attempt.key,
            actual,
            f"; operation {done.operation_status}" if done.operation_status else "",
        )
        return "found"
    if isinstance(outcome, NotFound):
        done = ledger.upkeep.resolve_attempt(
            attempt.key,
            recorded,  # a recorded actual is proof of billing: settled, never released
            note=f"not found at the provider: {outcome.reason}",
            by="reconcile",
            expected="unknown",
        )
        if not done.applied:
            return _moved(done.key, done.state)
        if recorded:
            _told_settled(attempt, recorded)
        else:
            hooks.released(
                budget=attempt.budget, attempt=attempt.key, amount=attempt.amount, by="reconcile"
            )
        _requeue_if_retryable(ledger, done, requeue)
        log.info("reconciled %s: not found%s", attempt.key, _because(outcome.reason))
        return "not_found"
    name = "pending" if not isinstance(outcome, Unknowable) else "unknowable"
    if name == "unknowable" and recorded:
        # The provider keeps no record, but the run recorded what the call reported:
        # that is proof of billing, and the charge.
        done = ledger.upkeep.resolve_attempt(
            attempt.key,
            recorded,
            note=f"the usage its run recorded ({outcome.reason})",
            by="reconcile",
            expected="unknown",
        )
        if not done.applied:
            return _moved(done.key, done.state)
        _told_settled(attempt, recorded)
    log.info("reconciled %s: %s%s", attempt.key, name, _because(outcome.reason))
    return name


def _moved(key: str, state: str) -> str:
    """An attempt another writer resolved between this run's claim and its write (a
    late run, an operator, another beat's reconciliation whose claim this one's
    outlived): nothing was written, so nothing is told as settled or released."""
    log.warning(
        "reconciling %s: it moved meanwhile (now %s): another writer resolved it",
        key,
        state,
    )
    return "failed"


def _requeue_if_retryable(ledger: Ledger, done: Resolved, requeue: Requeue | None) -> None:
    """Enqueue again an operation this resolution made retryable (no live run holds
    it; its attempts ended): no message may be left to bring it back."""
    if (
        requeue is None
        or done.operation is None
        or not done.operation_changed
        or done.operation_status != "retryable"
    ):
        return
    operation = ledger.operation(done.operation)
    if operation.task and operation.payload is not None:
        requeue(operation.task, operation.key, operation.payload)


def _because(reason: str) -> str:
    return f" ({reason})" if reason else ""


#: An escrowed budget that has not drawn for this long gives back what it holds unused.
GRANT_IDLE = timedelta(minutes=5)


def renew_periods(ledger: Ledger) -> int:
    """Open the current period of every periodic budget with its renewal policy (run
    it often: a rollover computes its carry when the new period opens), give back what
    escrowed budgets drew and leave unused (their period ended, or they are idle), and
    make the journal's month partitions ahead of need (PostgreSQL)."""
    made = ledger.upkeep.make_partitions()
    if made:
        log.info("made journal partitions %s", ", ".join(made))
    ledger.upkeep.return_grants(GRANT_IDLE)
    opened = 0
    for budget in ledger.budgets():
        if budget.period != "none":
            ledger.upkeep.open_period(budget.name)
            opened += 1
    return opened


def purge_expired_operations(ledger: Ledger, retention: timedelta) -> Purged:
    """Remove user content older than ``retention`` (see ``Ledger.purge_operations``);
    the money (attempts, the journal) stays."""
    purged = ledger.upkeep.purge_operations(retention)
    if purged.total:
        log.info("purged past %s: %s", retention, purged)
    return purged


def retain_ledger(ledger: Ledger, keep: timedelta, archive_to: str) -> Retained:
    """Archive the months past ``keep`` that are settled, into ``archive_to`` (see
    ``Upkeep.retain``); a month that is not is said in the log, and kept."""
    done = ledger.upkeep.retain(keep, archive_to=archive_to)
    for name, reasons in done.blocked.items():
        log.warning("kept %s past the retention window: %s", name, "; ".join(reasons))
    if done.archived or done.attempts or done.operations:
        log.info("retention: %s", done)
    return done


# -- the Celery tasks beat schedules ---------------------------------------------------

T = TypeVar("T")


#: The vendors whose drift this process said is off (no admin key): said once.
_DRIFT_OFF_SAID: set[str] = set()


def check_provider_drift(
    ledger: Ledger,
    vendors: Iterable[Vendor],
    admin_of: Callable[[Vendor], Any],
    *,
    since: timedelta,
    by: str | None = "model",
    bucket: str = "1h",
    settle: timedelta = DEFAULT_SETTLE,
    cost_settle: timedelta = DEFAULT_COST_SETTLE,
    threshold: Threshold | None = None,
) -> dict[str, int]:
    """Compare the ledger with each vendor's usage and cost reports over the last
    ``since`` (see :mod:`budget_tasks.drift`), told to the hooks (the
    ``budget_tasks_provider_drift`` gauge, the ``drift`` signal). A vendor without an
    admin key is off, said once; one whose report fails is logged, the others go on."""
    counts = {"checked": 0, "drifted": 0, "off": 0, "failed": 0}
    for vendor in vendors:
        if not vendor.admin_key_env:
            continue  # it has no reports to read
        admin = admin_of(vendor)
        if admin is None:
            if vendor.name not in _DRIFT_OFF_SAID:
                _DRIFT_OFF_SAID.add(vendor.name)
                log.warning(
                    "drift is off for %s: no admin key in %s", vendor.name, vendor.admin_key_env
                )
            counts["off"] += 1
            continue
        try:
            report = check_drift(
                ledger,
                vendor,
                since=ledger.views.now() - since,
                by=by,
                bucket=bucket,
                settle=settle,
                cost_settle=cost_settle,
                threshold=threshold,
                admin=admin,
            )
        except Exception:
            log.exception("drift check of %s failed", vendor.name)
            counts["failed"] += 1
            continue
        hooks.drift_checked(report=report)
        counts["checked"] += 1
        counts["drifted"] += len(report.drifted)
        for line in report.drifted:
            log.warning(
                "drift: %s %s %s at %s: ledger %d, provider %d (%+d)",
                vendor.name,
                line.group,
                line.measure,
                line.start.isoformat(),
                line.ledger,
                line.provider,
                line.difference,
            )
    return counts


def _counts(done: Any) -> dict[str, int]:
    """What a job's result (a dict, or a dataclass such as Purged) counts, by name: its
    numbers, and how many its collections hold (Retained's months)."""
    items = dict(done) if isinstance(done, Mapping) else asdict(done)
    return {
        k: v if isinstance(v, int) else len(v)
        for k, v in items.items()
        if isinstance(v, int | tuple | list | dict) and not isinstance(v, bool)
    }


def _job(name: str, run: Callable[[], T]) -> T:
    """Run the beat job ``name``, told to the hooks (tracing draws it) with its counts."""
    hooks.beat_started(job=name)
    try:
        done = run()
    except BaseException as exc:
        hooks.beat_ended(job=name, counts={}, error=type(exc).__name__)
        raise
    hooks.beat_ended(job=name, counts=_counts(done))
    return done


@cache
def _client(kind: str) -> Any:
    """The lookup client of the vendor named ``kind``, from the environment."""
    timeout = float(os.environ.get("BUDGET_TASKS_PROVIDER_TIMEOUT", "60"))
    return registry.vendor(kind).client(timeout)


def _ledger(task: Any) -> Ledger:
    return ledger_of(task.app)


@shared_task(bind=True, name="budget_tasks.flag_stale_holds", ignore_result=False)  # type: ignore[untyped-decorator]
def flag_stale_holds_task(self: Any) -> int:
    age = timedelta(seconds=float(self.app.conf.get("budget_stale_after", 900)))

    def flag() -> dict[str, int]:
        ledger = _ledger(self)
        flagged = len(flag_stale_holds(ledger, age))
        # what calls booked on the rate windows and never came back for, an hour on
        return {"flagged": flagged, "bookings_dropped": ledger.upkeep.drop_abandoned_bookings()}

    return _job("flag_stale_holds", flag)["flagged"]


@shared_task(bind=True, name="budget_tasks.reconcile_unknown", ignore_result=False)  # type: ignore[untyped-decorator]
def reconcile_unknown_task(self: Any) -> dict[str, int]:
    margin = timedelta(seconds=float(self.app.conf.get("budget_reconcile_margin", 300)))
    requeue = None
    if self.app.conf.get("budget_requeue_not_found", False):

        def requeue(task: str, key: str, payload: dict[str, Any]) -> None:
            self.app.send_task(
                task, args=payload.get("args", []), kwargs=payload.get("kwargs", {}), task_id=key
            )

    return _job(
        "reconcile_unknown",
        lambda: reconcile_unknown(_ledger(self), _client, margin=margin, requeue=requeue),
    )


@shared_task(bind=True, name="budget_tasks.renew_periods", ignore_result=False)  # type: ignore[untyped-decorator]
def renew_periods_task(self: Any) -> int:
    opened = _job("renew_periods", lambda: {"opened": renew_periods(_ledger(self))})
    return opened["opened"]


@shared_task(bind=True, name="budget_tasks.purge_expired_operations", ignore_result=False)  # type: ignore[untyped-decorator]
def purge_expired_operations_task(self: Any) -> dict[str, int]:
    days = float(self.app.conf.get("budget_retention_days", 7))
    purged = _job(
        "purge_expired_operations",
        lambda: purge_expired_operations(_ledger(self), timedelta(days=days)),
    )
    return asdict(purged)


@cache
def _admin(name: str) -> Any:
    """The report-reading client of the vendor named ``name``, from the environment
    (None: no admin key)."""
    timeout = float(os.environ.get("BUDGET_TASKS_PROVIDER_TIMEOUT", "60"))
    return registry.vendor(name).admin_client(timeout)


@shared_task(bind=True, name="budget_tasks.check_drift", ignore_result=False)  # type: ignore[untyped-decorator]
def check_drift_task(self: Any) -> dict[str, int]:
    conf = self.app.conf
    threshold = Threshold(
        float(conf.get("budget_drift_relative", DEFAULT_THRESHOLD.relative)),
        int(conf.get("budget_drift_min_tokens", DEFAULT_THRESHOLD.tokens)),
        int(conf.get("budget_drift_min_cost", DEFAULT_THRESHOLD.money)),
    )
    since = timedelta(seconds=float(conf.get("budget_drift_since", 2 * 86400)))
    settle = timedelta(
        seconds=float(conf.get("budget_drift_settle", DEFAULT_SETTLE.total_seconds()))
    )
    cost_settle = timedelta(
        seconds=float(conf.get("budget_drift_cost_settle", DEFAULT_COST_SETTLE.total_seconds()))
    )
    by = conf.get("budget_drift_by", "model") or None
    bucket = conf.get("budget_drift_bucket", "1h")
    return _job(
        "check_drift",
        lambda: check_provider_drift(
            _ledger(self),
            registry.vendors(),
            lambda vendor: _admin(vendor.name),
            since=since,
            by=by,
            bucket=bucket,
            settle=settle,
            cost_settle=cost_settle,
            threshold=threshold,
        ),
    )


@shared_task(bind=True, name="budget_tasks.retain_ledger", ignore_result=False)  # type: ignore[untyped-decorator]
def retain_ledger_task(self: Any) -> dict[str, Any]:
    days = self.app.conf.get("budget_ledger_retention_days")
    archive_to = self.app.conf.get("budget_archive_dir")
    if days is None:
        return {"skipped": "budget_ledger_retention_days is not set: every row is kept"}
    if not archive_to:
        log.error("budget_ledger_retention_days is set without budget_archive_dir: kept all")
        return {"skipped": "budget_archive_dir is not set"}
    keep = timedelta(days=float(days))
    return asdict(
        _job("retain_ledger", lambda: retain_ledger(_ledger(self), keep, str(archive_to)))
    )
