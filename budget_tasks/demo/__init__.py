"""``budget-tasks demo``: the Celery scenario (the main job) and the ledger walk-through."""

from .scenario import run as run_scenario
from .walkthrough import run as run_walkthrough

__all__ = ["run_scenario", "run_walkthrough"]
