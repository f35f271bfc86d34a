"""``python -m budget_tasks.cli``."""

from . import run

run()
