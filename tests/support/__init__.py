"""The project's own test harness: real ``celery worker`` processes (the demo's
launcher), a fault-injecting TCP proxy, process races. Not shipped in the wheel."""

from budget_tasks.demo.processes import Worker, race, wait_for, worker_env

from .proxy import FaultProxy

__all__ = ["FaultProxy", "Worker", "race", "wait_for", "worker_env"]
