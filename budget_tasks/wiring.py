"""One line that wires a Celery app for BudgetTask, and the checks a worker makes at
start.

``configure(app)`` registers the beat jobs, merges their schedule into the app's, and
sets, as defaults the app's own configuration still overrides, the settings BudgetTask
relies on. Whether or not an app calls it, a worker that runs BudgetTasks warns at
start about what would silently weaken the guarantees (task.py connects the check).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from celery import Celery

from . import rate_limits
from .config import LEDGER_URL_SETTING, ledger_of

log = logging.getLogger("budget_tasks")

#: The periodic ledger jobs and how often they run (seconds).
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "budget-tasks-flag-stale-holds": {"task": "budget_tasks.flag_stale_holds", "schedule": 60.0},
    "budget-tasks-reconcile-unknown": {"task": "budget_tasks.reconcile_unknown", "schedule": 60.0},
    "budget-tasks-renew-periods": {"task": "budget_tasks.renew_periods", "schedule": 60.0},
    "budget-tasks-purge-expired-operations": {
        "task": "budget_tasks.purge_expired_operations",
        "schedule": 3600.0,
    },
    # does nothing until an admin key (OPENAI_ADMIN_KEY, ANTHROPIC_ADMIN_KEY) is set
    "budget-tasks-check-drift": {"task": "budget_tasks.check_drift", "schedule": 3600.0},
    # does nothing until budget_ledger_retention_days and budget_archive_dir are set
    "budget-tasks-retain-ledger": {"task": "budget_tasks.retain_ledger", "schedule": 86400.0},
}

#: What at-least-once delivery needs: a message acked only after its task ran, a killed
#: worker's message back in the queue, one message at a time per process.
DELIVERY_DEFAULTS: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
}


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _limits(text: str) -> dict[str, Any]:
    """``budget_rate_limits`` as JSON (provider -> scope -> kind -> per minute),
    checked whole before any worker sets it."""
    try:
        limits = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    try:
        rate_limits.limits_of(limits)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return dict(limits)


def _names(text: str) -> list[str]:
    """A comma-separated list of names (``litellm,portkey``)."""
    return [name.strip() for name in text.split(",") if name.strip()]


#: The environment variables that set the library's Celery settings in any app (the
#: CLI reads the same ones), with how each is read.
ENV_SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "BUDGET_TASKS_LEDGER_URL": (LEDGER_URL_SETTING, str),
    "BUDGET_TASKS_STALE_AFTER": ("budget_stale_after", float),
    "BUDGET_TASKS_RECONCILE_MARGIN": ("budget_reconcile_margin", float),
    "BUDGET_TASKS_REQUEUE_NOT_FOUND": ("budget_requeue_not_found", _flag),
    "BUDGET_TASKS_RETENTION_DAYS": ("budget_retention_days", float),
    "BUDGET_TASKS_LEDGER_RETENTION_DAYS": ("budget_ledger_retention_days", float),
    "BUDGET_TASKS_ARCHIVE_DIR": ("budget_archive_dir", str),
    "BUDGET_TASKS_MAX_STORED_BYTES": ("budget_max_stored_bytes", int),
    "BUDGET_TASKS_METRICS_PORT": ("budget_metrics_port", int),
    "BUDGET_TASKS_DRIFT_SINCE": ("budget_drift_since", float),
    "BUDGET_TASKS_DRIFT_SETTLE": ("budget_drift_settle", float),
    "BUDGET_TASKS_DRIFT_BY": ("budget_drift_by", str),
    "BUDGET_TASKS_METRICS_ADDR": ("budget_metrics_addr", str),
    "BUDGET_TASKS_RATE_LIMITS": ("budget_rate_limits", _limits),
    "BUDGET_TASKS_RATE_GATEWAYS": ("budget_rate_gateways", _names),
}
VISIBILITY_ENV = "BUDGET_TASKS_VISIBILITY_TIMEOUT"
#: The variables that set the Redis transport's options (seconds).
ENV_TRANSPORT = {
    VISIBILITY_ENV: "visibility_timeout",
    "BUDGET_TASKS_RESTORE_INTERVAL": "unacked_restore_interval",
}


def settings_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Celery settings the ``BUDGET_TASKS_*`` variables give; a value that does not
    parse raises ValueError naming its variable."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for name, (setting, parse) in ENV_SETTINGS.items():
        text = environ.get(name)
        if text is None or not text.strip():
            continue
        try:
            found[setting] = parse(text.strip())
        except ValueError as exc:
            raise ValueError(f"{name}={text!r} is not a valid value: {exc}") from exc
    return found


#: kombu's own default visibility timeout for Redis (seconds).
REDIS_VISIBILITY_DEFAULT = 3600.0
REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "sentinel://")


def redis_broker(url: object) -> bool:
    """Whether ``url`` names a Redis broker (whose transport options are Redis's own)."""
    return str(url or "").startswith(REDIS_SCHEMES)


def configure(app: Celery, *, ledger_url: str | None = None) -> Celery:
    """Wire ``app`` for BudgetTask: the beat jobs registered, their schedule merged into
    ``beat_schedule`` (entries of the same name the app sets win), and
    ``task_acks_late``, ``task_reject_on_worker_lost`` and ``worker_prefetch_multiplier=1``
    as defaults. Every ``BUDGET_TASKS_*`` variable the README lists sets its setting,
    over the app's own (the CLI reads them in that order too), so the worker, beat and
    the CLI agree; ``ledger_url`` sets ``budget_ledger_url`` over both. The worker
    serves metrics when ``budget_metrics_port`` is set, and draws OpenTelemetry spans
    when the ``otel`` extra is installed (see ``BUDGET_TASKS_OTEL``). Returns ``app``."""
    from . import (
        _sqla_broker,
        beat,  # noqa: F401  (registers the beat jobs as shared tasks)
        metrics,
        signals,  # noqa: F401  (its sink sends Celery signals: denied, replayed, ...)
    )

    defaults = dict(DELIVERY_DEFAULTS)
    from_env = settings_from_environment()
    if ledger_url is not None:
        from_env[LEDGER_URL_SETTING] = ledger_url  # given here: over the environment too

    def wire(sender: Celery, **_: Any) -> None:
        conf = sender.conf
        # Celery's add_defaults() would rank above the app's own config source, so
        # each default is set only where the app's configuration does not name it.
        for key, value in defaults.items():
            if not _set_by_app(conf, key):
                conf[key] = value
        for key, value in from_env.items():
            conf[key] = value
        _transport_from_environment(conf)
        # the embedded SQLite broker (the demo, the reference app's defaults) needs a
        # session per thread; Redis and RabbitMQ are left as they are
        _sqla_broker.install_for(conf.broker_url)
        schedule = dict(BEAT_SCHEDULE)
        schedule.update(conf.beat_schedule or {})
        conf.beat_schedule = schedule
        # the groups of models that share a quota: each process's (its calls' scopes)
        rate_limits.set_groups(conf.get(RATE_GROUPS_SETTING) or {})

    if app.configured:
        wire(app)
    else:
        app.on_after_configure.connect(wire, weak=False)
    metrics.install(app)
    _install_rate_limits(app)
    _install_tracing()
    return app


#: The limits the worker sets in the ledger as it starts, and the groups of models.
RATE_LIMITS_SETTING = "budget_rate_limits"
RATE_GROUPS_SETTING = "budget_rate_groups"
#: The providers ``budget_rate_limits`` may name that no vendor known to the worker has
#: (a gateway metered under a name of its own): as ``limits set --gateway``.
RATE_GATEWAYS_SETTING = "budget_rate_gateways"


def rate_gateways(value: Any) -> frozenset[str]:
    """``budget_rate_gateways``: a list of names, or one comma-separated string."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset(_names(value))
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise TypeError(f"{RATE_GATEWAYS_SETTING} lists provider names, not {value!r}")
    names = list(value)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"{RATE_GATEWAYS_SETTING} lists provider names, not {name!r}")
    return frozenset(names)


def unknown_providers(limits: Iterable[rate_limits.Limit], gateways: Iterable[str]) -> list[str]:
    """The providers ``limits`` name that no vendor of this process's registry has and
    ``gateways`` does not name either."""
    from .providers.registry import registry

    allowed = set(gateways)
    return sorted(
        {
            limit.provider
            for limit in limits
            if limit.provider not in allowed and registry.find(limit.provider) is None
        }
    )


def set_rate_limits(app: Celery) -> list[rate_limits.Limit]:
    """Set ``app``'s ``budget_rate_limits`` in its ledger, all or none: a provider no
    vendor known here has (a typo holds nothing: only calls sent through a vendor of
    that name take from its windows) is refused, with every limit, unless
    ``budget_rate_gateways`` names it. What was set."""
    from .providers.registry import registry

    config = app.conf.get(RATE_LIMITS_SETTING)
    if not config:
        return []
    limits = rate_limits.limits_of(config)
    unknown = unknown_providers(limits, rate_gateways(app.conf.get(RATE_GATEWAYS_SETTING)))
    if unknown:
        known = ", ".join(sorted(v.name for v in registry.vendors()))
        names = ", ".join(repr(name) for name in unknown)
        raise ValueError(
            f"{RATE_LIMITS_SETTING} names {names}, which no vendor known here has "
            f"({known}): no rate limit is set. Name a gateway's own name in "
            f"{RATE_GATEWAYS_SETTING} (env BUDGET_TASKS_RATE_GATEWAYS) too, or register "
            "its vendor before the worker starts"
        )
    return rate_limits.apply_limits(ledger_of(app).rates, config)


def _install_rate_limits(app: Celery) -> None:
    """Set the app's ``budget_rate_limits`` in the ledger as a worker starts (its
    main process, once): every worker of the fleet takes from those windows."""
    from celery.signals import worker_init

    if getattr(app, "_budget_tasks_rate_limits", False):
        return
    app._budget_tasks_rate_limits = True

    @worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _set(sender: Any = None, **_: Any) -> None:
        _set_at_start(app)


def _set_at_start(app: Celery) -> None:
    """:func:`set_rate_limits` as a worker starts: a configuration it refuses is one
    error in the log (and no limit set), not the worker's end."""
    try:
        limits = set_rate_limits(app)
    except (TypeError, ValueError) as exc:
        log.error("budget-tasks: %s", exc)
        return
    if limits:
        log.info("budget-tasks: %d rate limits set from %s", len(limits), RATE_LIMITS_SETTING)


#: ``1`` draws spans (the ``otel`` extra required), ``0`` does not; unset: drawn when
#: the extra is installed.
OTEL_ENV = "BUDGET_TASKS_OTEL"


def _install_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Add the tracing sink as ``BUDGET_TASKS_OTEL`` says (see :data:`OTEL_ENV`)."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(OTEL_ENV, "").strip()
    if wanted and not _flag(wanted):
        return False
    try:
        from . import tracing
    except ImportError as exc:
        if wanted:
            raise RuntimeError(
                f"{OTEL_ENV}={wanted} but OpenTelemetry is not installed: "
                "pip install 'budget-tasks[otel]'"
            ) from exc
        return False
    tracing.install()
    return True


def _transport_from_environment(conf: Any) -> None:
    if not redis_broker(conf.broker_url):
        # the options are Redis's: kombu's SQLAlchemy transport, for one, hands them
        # to create_engine(), which refuses them
        return
    options = dict(conf.broker_transport_options or {})
    for name, option in ENV_TRANSPORT.items():
        text = os.environ.get(name, "").strip()
        if text:
            try:
                options[option] = float(text)
            except ValueError as exc:
                raise ValueError(f"{name}={text!r} is not a number of seconds") from exc
    if options:
        conf.broker_transport_options = options


def _set_by_app(conf: Any, key: str) -> bool:
    """Whether the app's own configuration (its config source or explicit changes)
    names ``key``, as opposed to Celery's built-in defaults."""
    # Settings is a chain: the app's changes, then its config source(s), then
    # Celery's own defaults, always last.
    layers = [conf.changes, *conf.defaults[:-1]]
    return any(key in layer for layer in layers)


def startup_problems(app: Celery, base: type) -> list[str]:
    """What would weaken the guarantees of the app's tasks of class ``base`` (BudgetTask)
    in this worker, one sentence each."""
    budget_tasks: list[Any] = [t for t in app.tasks.values() if isinstance(t, base)]
    if not budget_tasks:
        return []
    problems = []
    missing = sorted({e["task"] for e in BEAT_SCHEDULE.values()} - set(app.tasks))
    if missing:
        problems.append(
            f"the beat jobs are not registered ({', '.join(missing)}): unknown outcomes are "
            "never reconciled and stale holds never flagged; call "
            "budget_tasks.configure(app) in the app module and run `celery beat`"
        )
    if redis_broker(app.conf.broker_url):
        options = app.conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", REDIS_VISIBILITY_DEFAULT))
        longest = max(budget_tasks, key=lambda t: t.lease_seconds)
        if visibility < longest.lease_seconds:
            # name the setting this worker took it from, not one the user never wrote
            where = (
                f"env {VISIBILITY_ENV}"
                if os.environ.get(VISIBILITY_ENV)
                else f"broker_transport_options['visibility_timeout'] (or env {VISIBILITY_ENV}"
                ", which budget_tasks.configure(app) reads)"
            )
            problems.append(
                f"the Redis visibility timeout ({visibility:g} s) is shorter than "
                f"{longest.name}'s lease ({longest.lease_seconds:g} s): Redis will redeliver "
                f"messages still running, each redelivery waits on the lease; raise {where} "
                "above the longest lease"
            )
    return problems


def warn_at_start(instance: Any, base: type) -> None:
    """Log each startup problem of a worker (``celeryd_after_setup``'s instance)."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    for problem in startup_problems(app, base):
        log.warning("budget-tasks: %s", problem)
