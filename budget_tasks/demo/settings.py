"""Celery settings for the reference app (``celery -A budget_tasks.demo.app worker``).

Every setting reads its environment variable and falls back to an embedded default
that needs no services: SQLite files under ``BUDGET_TASKS_HOME`` (default
``~/.budget-tasks``, created when the app is loaded, not by this module) for the
ledger, the broker (kombu's SQLAlchemy transport) and the result backend. Production
sets the variables to PostgreSQL and Redis.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _number(name: str, default: int, kind: type[int] | type[float] = int) -> Any:
    """A number from the environment; a bad value names its variable."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number") from None


_home = Path(os.environ.get("BUDGET_TASKS_HOME", Path.home() / ".budget-tasks"))

broker_url = os.environ.get("CELERY_BROKER_URL", f"sqla+sqlite:///{_home / 'broker.db'}")
result_backend = os.environ.get("CELERY_RESULT_BACKEND", f"db+sqlite:///{_home / 'results.db'}")
budget_ledger_url = os.environ.get("BUDGET_TASKS_LEDGER_URL", f"sqlite:///{_home / 'ledger.db'}")

# At-least-once delivery (task_acks_late, task_reject_on_worker_lost, prefetch 1) and
# the beat schedule come from budget_tasks.configure(app), in app.py.

# Redis redelivers an unacked message after this long, even while a worker still runs
# it; keep it well above the longest job. The ledger makes a redelivery replay, not
# resend, but a long visibility timeout keeps replays rare.
broker_transport_options: dict[str, object] = {}
if broker_url.startswith(("redis://", "rediss://", "redis+socket://", "sentinel://")):
    # Only for Redis: kombu's SQLAlchemy transport hands its options to create_engine(),
    # which refuses these names.
    broker_transport_options = {
        "visibility_timeout": _number("BUDGET_TASKS_VISIBILITY_TIMEOUT", 3600),
        # How often a worker looks for unacked messages past their visibility timeout.
        "unacked_restore_interval": _number("BUDGET_TASKS_RESTORE_INTERVAL", 10),
        "unacked_restore_throttle": 1,
    }

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
timezone = "UTC"
enable_utc = True

# Prometheus metrics from the worker's main process (0: off). With the prefork pool,
# also set PROMETHEUS_MULTIPROC_DIR to an empty directory in the worker's environment.
budget_metrics_port = _number("BUDGET_TASKS_METRICS_PORT", 0)
budget_metrics_addr = os.environ.get("BUDGET_TASKS_METRICS_ADDR", "127.0.0.1")

# The periodic ledger jobs (budget_tasks.beat, scheduled by budget_tasks.configure):
# run `celery -A budget_tasks.demo.app beat`.
budget_stale_after = _number("BUDGET_TASKS_STALE_AFTER", 900)
budget_reconcile_margin = _number("BUDGET_TASKS_RECONCILE_MARGIN", 300)
budget_requeue_not_found = os.environ.get("BUDGET_TASKS_REQUEUE_NOT_FOUND", "") == "1"
budget_retention_days = _number("BUDGET_TASKS_RETENTION_DAYS", 7, float)
