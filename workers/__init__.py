"""The reference Celery app: ``celery -A workers worker``, configured by celeryconfig.py."""

from __future__ import annotations

from celery import Celery

app = Celery("workers", include=["workers.tasks", "budget_tasks.beat"])
app.config_from_object("celeryconfig")

__all__ = ["app"]
