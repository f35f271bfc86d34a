"""Helpers for testing code that uses budget-tasks (and for budget-tasks' own tests)."""

from .clock import ManualClock
from .fake_provider import FakeProvider
from .processes import race
from .proxy import FaultProxy
from .worker import Worker, wait_for, worker_env

__all__ = ["FakeProvider", "FaultProxy", "ManualClock", "Worker", "race", "wait_for", "worker_env"]
