"""The reference Celery app: ``celery -A budget_tasks.demo.app worker`` (and ``beat``),
configured by :mod:`budget_tasks.demo.settings` from the environment."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from celery import Celery

from budget_tasks import configure, metrics
from budget_tasks.demo import broker

broker.install()  # the embedded broker's channel: a session per thread (see broker.py)

# by name, not `from . import`: the settings are read from the environment each time
# the app is loaded afresh (the demo and the tests do)
settings = importlib.import_module("budget_tasks.demo.settings")
app = Celery("budget_tasks.demo", include=["budget_tasks.demo.tasks"])
app.config_from_object(settings)
configure(app)  # the beat jobs and their schedule, at-least-once delivery settings
metrics.install(app)  # serves /metrics when budget_metrics_port is set

if not all(
    os.environ.get(name)
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL")
):
    # the embedded defaults are SQLite files in this directory
    Path(settings._home).mkdir(parents=True, exist_ok=True)

__all__ = ["app"]
