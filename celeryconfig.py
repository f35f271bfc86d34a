"""Celery settings for the reference app (``celery -A workers.app worker``): the module
to copy beside your own app and load with ``app.config_from_object("celeryconfig")``.

Every setting comes from its environment variable. Without them, the embedded defaults
need no services: SQLite files under ``BUDGET_TASKS_HOME`` (default
``~/.budget-tasks``, created when the app is loaded, not by this module) for the
ledger, the broker (kombu's SQLAlchemy transport) and the result backend. Production
points the variables at PostgreSQL and Redis.

The library's own settings (``budget_*``) are listed below with their defaults;
``budget_tasks.configure(app)`` sets each from its ``BUDGET_TASKS_*`` variable over
what a module like this one says, in any app, so the worker, beat and the
``budget-tasks`` CLI read the same values.
"""

from __future__ import annotations

import os
from pathlib import Path

from budget_tasks.wiring import redis_broker

home = Path(os.environ.get("BUDGET_TASKS_HOME", Path.home() / ".budget-tasks"))

# Celery itself reads CELERY_BROKER_URL and CELERY_RESULT_BACKEND over these.
broker_url = os.environ.get("CELERY_BROKER_URL", f"sqla+sqlite:///{home / 'broker.db'}")
result_backend = os.environ.get("CELERY_RESULT_BACKEND", f"db+sqlite:///{home / 'results.db'}")
# BUDGET_TASKS_LEDGER_URL: PostgreSQL in production
budget_ledger_url = os.environ.get("BUDGET_TASKS_LEDGER_URL", f"sqlite:///{home / 'ledger.db'}")

# At-least-once delivery (task_acks_late, task_reject_on_worker_lost, prefetch 1) and
# the beat schedule come from budget_tasks.configure(app), in workers/app.py.

broker_transport_options: dict[str, object] = {}
if redis_broker(broker_url):
    # Only for Redis: kombu's SQLAlchemy transport hands its options to create_engine(),
    # which refuses these names.
    broker_transport_options = {
        # Redis redelivers an unacked message after this long, even while a worker
        # still runs it; keep it above the longest task's lease. The ledger makes a
        # redelivery replay, not resend, but a long timeout keeps replays rare.
        # BUDGET_TASKS_VISIBILITY_TIMEOUT sets it.
        "visibility_timeout": 3600,
        # How often a worker looks for unacked messages past their visibility timeout
        # (BUDGET_TASKS_RESTORE_INTERVAL).
        "unacked_restore_interval": 10,
        "unacked_restore_throttle": 1,
    }

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
timezone = "UTC"
enable_utc = True

# Prometheus metrics from the worker's main process (0: off); BUDGET_TASKS_METRICS_PORT
# and BUDGET_TASKS_METRICS_ADDR. With the prefork pool, also set
# PROMETHEUS_MULTIPROC_DIR to an empty directory in the worker's environment.
budget_metrics_port = 0
budget_metrics_addr = "127.0.0.1"

# The periodic ledger jobs (budget_tasks.beat, scheduled by configure(app)); run
# `celery -A workers.app beat`.
budget_stale_after = 900  # s: a hold this old is flagged (BUDGET_TASKS_STALE_AFTER)
# s past a call's timeout before beat asks the provider (BUDGET_TASKS_RECONCILE_MARGIN)
budget_reconcile_margin = 300
# requeue the work of a call the provider never received (BUDGET_TASKS_REQUEUE_NOT_FOUND=1)
budget_requeue_not_found = False
budget_retention_days = 7  # finished operations kept (BUDGET_TASKS_RETENTION_DAYS)
# One stored result or answer (what a redelivery replays) past this many bytes keeps only
# its digest; replaying it is refused (BUDGET_TASKS_MAX_STORED_BYTES).
budget_max_stored_bytes = 1 << 20
