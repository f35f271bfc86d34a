"""``budget-tasks demo``: the Celery scenario (the main job, :mod:`.scenario`), the ledger
walk-through (:mod:`.walkthrough`) and the reference app they run (:mod:`.app`)."""
