"""budget-tasks' own test harness: real ``celery worker`` processes, a fault-injecting
TCP proxy, process races. The project's tests, benchmarks and demo use it; it is not
part of the API for users' test suites (that is :mod:`budget_tasks.testing`) and may
change without notice."""

from .processes import race
from .proxy import FaultProxy
from .worker import Worker, wait_for, worker_env

__all__ = ["FaultProxy", "Worker", "race", "wait_for", "worker_env"]
