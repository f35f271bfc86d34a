"""The reference Celery app: ``celery -A workers.app worker`` (and ``beat``), configured
by ``celeryconfig.py`` from the environment."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from celery import Celery

from budget_tasks import configure

# celeryconfig.py sits beside workers/ at the project's top level; the wheel ships both
# under budget_tasks.reference. Imported by name, not held: a fresh load of the app
# (the demo, the tests) reads the environment again.
_top = __package__.rpartition(".")[0] if __package__ else ""
settings = importlib.import_module(f"{_top}.celeryconfig" if _top else "celeryconfig")
app = Celery("workers", include=[f"{__package__}.tasks"])
app.config_from_object(settings)
# the beat jobs and their schedule, at-least-once delivery, every BUDGET_TASKS_*
# variable, the metrics server when BUDGET_TASKS_METRICS_PORT is set, and the embedded
# SQLite broker's session per thread when that is the broker
configure(app)

if not all(
    os.environ.get(name)
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BUDGET_TASKS_LEDGER_URL")
):
    # the embedded defaults are SQLite files in this directory
    # ... readable by this user only: they hold prompts, answers and spend
    Path(settings.home).mkdir(mode=0o700, parents=True, exist_ok=True)

__all__ = ["app"]
