"""``budget-tasks demo``: the Celery scenario (the main job, :mod:`.scenario`) and the
ledger walk-through (:mod:`.walkthrough`). The scenario runs the reference app, the
project's ``workers/`` (shipped as :mod:`budget_tasks.reference`)."""
