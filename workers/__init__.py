"""The reference Celery app: ``celery -A workers worker``, configured by celeryconfig.py."""

from __future__ import annotations

from celery import Celery

from budget_tasks import metrics

app = Celery("workers", include=["workers.tasks", "budget_tasks.beat"])
app.config_from_object("celeryconfig")
metrics.install(app)  # serves /metrics when budget_metrics_port is set

__all__ = ["app"]
