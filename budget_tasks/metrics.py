"""Prometheus metrics for workers and beat.

Counters are kept by the processes that do the work (admissions, denials, replays,
unknown outcomes, overruns, the actual/estimate ratio, stale holds, reconciliations);
with Celery's prefork pool, set ``PROMETHEUS_MULTIPROC_DIR`` in the worker's
environment (an empty directory) so that the children's counts add up. Balances are
read from the ledger when scraped (held, spent, cap, available, oldest hold), so they
are exact whatever process or host moved them.

Expose them from a worker with ``install(app)`` and the setting ``budget_metrics_port``
(env ``BUDGET_TASKS_METRICS_PORT``; 0, the default, is off).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import ledger_of
from .hooks import (
    DENIAL_REASONS,
    RATE_LIMITED_BY,
    RECONCILE_OUTCOMES,
    UNTRUSTED_BY,
    Hooks,
    add_sink,
)

log = logging.getLogger("budget_tasks.metrics")

ADMISSIONS = Counter(
    "budget_tasks_admissions_total", "Reservations admitted, by budget", ["budget"]
)
DENIALS = Counter(
    "budget_tasks_denials_total",
    "Reservations refused, by the budget that refused and why",
    ["budget", "reason"],
)
REPLAYS = Counter(
    "budget_tasks_replays_total", "Deliveries answered from a stored result", ["task"]
)
UNKNOWN_OUTCOMES = Counter(
    "budget_tasks_unknown_outcomes_total", "Attempts whose outcome became unknown", ["task"]
)
OVERRUNS = Counter(
    "budget_tasks_overruns_total", "Settlements above their reservation, by budget", ["budget"]
)
ACTUAL_TO_ESTIMATE = Histogram(
    "budget_tasks_actual_to_estimate_ratio",
    "Settled charge divided by the reserved estimate (above 1 is an overrun)",
    ["budget"],
    buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0, 5.0),
)
STALE_HOLDS = Counter(
    "budget_tasks_stale_holds_total",
    "Holds flagged as stale (sending/unknown too long)",
    ["budget"],
)
RECONCILIATIONS = Counter(
    "budget_tasks_reconciliations_total", "Provider lookups of unknown attempts", ["outcome"]
)
UNTRUSTED_ANSWERS = Counter(
    "budget_tasks_untrusted_answers_total",
    "Answers whose usage was past what their request allowed: not charged, held unknown",
    ["budget", "by"],
)
RATE_LIMITED = Counter(
    "budget_tasks_rate_limited_total",
    "Calls held back by a rate limit, by provider, scope and who held them: the ledger "
    "(a window full, the call booked ahead) or the provider (a 429)",
    ["provider", "scope", "by"],
)
RATE_WAIT = Histogram(
    "budget_tasks_rate_wait_seconds",
    "How long a call held back by a rate limit was told to wait (a 429 without a retry-after: 0)",
    ["provider", "by"],
    # a booking waits at most an hour (what a window may owe); a 429's wait is seconds
    buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0),
)

PROVIDER_DRIFT = Gauge(
    "budget_tasks_provider_drift",
    "The provider's report less the ledger over the last drift check's final windows "
    "(tokens, or micro-USD for cost), by provider, grouping, group and measure",
    ["provider", "by", "group", "measure"],
    multiprocess_mode="mostrecent",
)

#: The drift gauge's label sets each provider's last check set, by provider and grouping.
_DRIFT_SHOWN: dict[tuple[str, str], set[tuple[str, str, str, str]]] = {}
_DRIFT_LOCK = threading.Lock()


class PrometheusHooks(Hooks):
    """The hooks sink that keeps the counters above."""

    def admitted(self, *, budget: str, attempt: str, amount: int) -> None:
        # a reservation of money: a task's main attempt of 0 (its calls each reserve
        # their own) would count every task twice
        if amount > 0:
            ADMISSIONS.labels(budget).inc()

    def denied(self, *, budget: str, reason: str, amount: int) -> None:
        DENIALS.labels(budget, reason).inc()

    def replayed(self, *, task: str, operation: str) -> None:
        REPLAYS.labels(task).inc()

    def unknown(self, *, task: str, attempt: str) -> None:
        UNKNOWN_OUTCOMES.labels(task).inc()

    def settled(self, *, budget: str, attempt: str, amount: int, actual: int, by: str) -> None:
        if amount > 0:
            ACTUAL_TO_ESTIMATE.labels(budget).observe(actual / amount)
        if actual > amount:
            OVERRUNS.labels(budget).inc()

    def stale(self, *, hold: Any) -> None:
        STALE_HOLDS.labels(hold.budget).inc()

    def reconciled(self, *, attempt: str, outcome: str) -> None:
        RECONCILIATIONS.labels(outcome).inc()

    def untrusted(self, *, budget: str, attempt: str, reason: str, by: str) -> None:
        UNTRUSTED_ANSWERS.labels(budget, by).inc()

    def rate_limited(self, *, provider: str, scope: str, kind: str, wait: float, by: str) -> None:
        RATE_LIMITED.labels(provider, scope, by).inc()
        RATE_WAIT.labels(provider, by).observe(wait)

    def drift_checked(self, *, report: Any) -> None:
        by = report.by or "all"
        now = {
            (report.provider, by, group, measure): difference
            for (group, measure), difference in report.differences().items()
        }
        with _DRIFT_LOCK:
            # a group the last check saw and this one did not is gone, not still off
            for labels in _DRIFT_SHOWN.get((report.provider, by), set()) - now.keys():
                PROVIDER_DRIFT.remove(*labels)
            _DRIFT_SHOWN[(report.provider, by)] = set(now)
            for labels, difference in now.items():
                PROVIDER_DRIFT.labels(*labels).set(difference)


#: The one Prometheus sink of this process: importing this module starts counting.
SINK = add_sink(PrometheusHooks())
for _outcome in RECONCILE_OUTCOMES:
    RECONCILIATIONS.labels(_outcome)  # 0, not "no data", before the first lookup

#: The budgets whose labelled counters this process has made (at 0).
_LABELLED: set[str] = set()


def label_budgets(budgets: Iterable[str]) -> None:
    """Make each budget's labelled counters at 0, so that a healthy install's panels
    (overruns, denials, untrusted answers) read 0, not "no data"."""
    for budget in budgets:
        if budget in _LABELLED:
            continue
        for counter in (ADMISSIONS, OVERRUNS, STALE_HOLDS, ACTUAL_TO_ESTIMATE):
            counter.labels(budget)
        for reason in DENIAL_REASONS:
            DENIALS.labels(budget, reason)
        for by in UNTRUSTED_BY:
            UNTRUSTED_ANSWERS.labels(budget, by)
        _LABELLED.add(budget)


#: The (provider, scope) pairs whose rate-limit series this process has made (at 0).
_RATE_LABELLED: set[tuple[str, str]] = set()


def label_rates(windows: Iterable[Any]) -> None:
    """Make each window's provider and scope's rate-limit series at 0, so that a
    limit never reached reads 0, not "no data"."""
    for window in windows:
        if (window.provider, window.scope) in _RATE_LABELLED:
            continue
        for by in RATE_LIMITED_BY:
            RATE_LIMITED.labels(window.provider, window.scope, by)
            RATE_WAIT.labels(window.provider, by)
        _RATE_LABELLED.add((window.provider, window.scope))


class LedgerCollector(Collector):
    """Balances, hold ages and rate windows read from the ledger at each scrape."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        gauges = {
            name: GaugeMetricFamily(f"budget_tasks_{name}", text, labels=["budget"])
            for name, text in (
                ("cap", "The current period's cap, in minor units"),
                (
                    "spent",
                    "Spent in the current period, the budgets below it included, in minor units",
                ),
                (
                    "held",
                    "Held by open attempts in the current period, the budgets below it included",
                ),
                ("available", "cap - spent - held in the current period"),
                (
                    "usable",
                    "What one admission could take now: available, no more than the "
                    "parents can give; 0 under a freeze",
                ),
                (
                    "granted",
                    "Held unused as grants by the escrowed budgets below in the current period "
                    "(part of available), in minor units",
                ),
                ("drawn", "Drawn as grants from the ancestors in the current period (escrow)"),
                ("oldest_hold_seconds", "Age of the oldest open hold"),
                (
                    "overrun",
                    "Charged above reservations in the current period, the budgets below it "
                    "included, by every settler (tasks, reconciliation, operators), in minor units",
                ),
            )
        }
        # One set-based query for every budget: a scrape costs the same at 10 or 10,000.
        rows = self.ledger.report()
        label_budgets(row.budget for row in rows)
        for row in rows:
            for name in (
                "cap",
                "spent",
                "held",
                "available",
                "usable",
                "overrun",
                "granted",
                "drawn",
            ):
                gauges[name].add_metric([row.budget], getattr(row, name))
            age = 0.0 if row.oldest_hold is None else row.oldest_hold.total_seconds()
            gauges["oldest_hold_seconds"].add_metric([row.budget], age)
        yield from gauges.values()
        yield from self._rate_windows()

    def _rate_windows(self) -> Iterator[Metric]:
        labels = ["provider", "scope", "kind"]
        limit = GaugeMetricFamily(
            "budget_tasks_rate_window_limit", "A rate window's limit a minute", labels=labels
        )
        available = GaugeMetricFamily(
            "budget_tasks_rate_window_available",
            "What a rate window holds now (below 0: owed to the calls booked ahead)",
            labels=labels,
        )
        booked = GaugeMetricFamily(
            "budget_tasks_rate_window_booked",
            "Calls booked ahead on a rate window, waiting for their turn",
            labels=labels,
        )
        windows = _windows_of(self.ledger)
        label_rates(windows)
        for w in windows:
            at = [w.provider, w.scope, w.kind]
            limit.add_metric(at, w.per_minute)
            available.add_metric(at, w.available)
            booked.add_metric(at, w.booked)
        yield from (limit, available, booked)


def _windows_of(ledger: Any) -> list[Any]:
    """The ledger's rate windows (none for a stand-in ledger that only reports balances)."""
    rates = getattr(ledger, "rates", None)
    return [] if rates is None else list(rates.windows())


def _collector_of_written_files() -> Any:
    """prometheus_client's collector of every process's files, passing over a file a
    new process has made but not sized yet: it holds nothing, and reading it fails the
    whole scrape (prometheus/client_python#1199; with a child per task, every fork)."""
    import glob

    from prometheus_client import multiprocess

    class Collector(multiprocess.MultiProcessCollector):
        def collect(self) -> Any:
            files = glob.glob(os.path.join(self._path, "*.db"))
            return self.merge([f for f in files if _has_data(f)], accumulate=True)  # type: ignore[no-untyped-call]

    return Collector


def _has_data(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0  # once sized, a file never shrinks
    except OSError:  # gone meanwhile (mark_process_dead)
        return False


def registry_for(ledger: Any) -> CollectorRegistry:
    """What a worker exposes: every process's counters, and the ledger's balances."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _collector_of_written_files()(registry)
    else:
        for collector in (
            ADMISSIONS,
            DENIALS,
            REPLAYS,
            UNKNOWN_OUTCOMES,
            OVERRUNS,
            ACTUAL_TO_ESTIMATE,
            STALE_HOLDS,
            RECONCILIATIONS,
            UNTRUSTED_ANSWERS,
            RATE_LIMITED,
            RATE_WAIT,
            PROVIDER_DRIFT,
        ):
            registry.register(collector)
    registry.register(LedgerCollector(ledger))
    try:  # the budgets' counters at 0 from the first scrape (each scrape adds new ones)
        label_budgets(row.budget for row in ledger.report())
        label_rates(_windows_of(ledger))
    except Exception as exc:  # the ledger down at start: the first scrapes make them
        log.warning("budget-tasks metrics: budgets and rate limits not labelled at start: %s", exc)
    return registry


def install(app: Any) -> None:
    """Count this process's events (the Prometheus hooks sink), serve the metrics from
    the worker's main process when ``budget_metrics_port`` is set, and let the pool's
    children report into the shared directory."""
    from celery.signals import worker_init, worker_process_shutdown

    if getattr(app, "_budget_tasks_metrics", False):
        return  # configure(app) installs it; an app may call install() itself as well
    app._budget_tasks_metrics = True

    @worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _serve(sender: Any = None, **_: Any) -> None:
        port = int(app.conf.get("budget_metrics_port") or 0)
        if not port:
            return
        addr = str(app.conf.get("budget_metrics_addr") or "127.0.0.1")
        start_http_server(port, addr=addr, registry=registry_for(ledger_of(app)))
        log.info("budget-tasks metrics on http://%s:%d/metrics", addr, port)

    @worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _gone(pid: int | None = None, **_: Any) -> None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]
