"""``python -m budget_tasks.testing``: the fake provider (as ``budget-tasks
fake-provider``), with the same options as ``python -m budget_tasks.testing.fake_provider``."""

from .fake_provider import main

main()
