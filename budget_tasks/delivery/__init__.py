"""One delivery of an operation, as a state machine on the ledger (no Celery here).

- :mod:`.scope`: what the code inside a task sees (its main attempt, its labelled
  calls, which run is in progress);
- :mod:`.calls`: the one path every call is opened by, the main call (call 0) and each
  labelled one: admitted, decided after what an earlier run left, granted, replayed;
- :mod:`.fates`: what an error means for a hold;
- :mod:`.owed`: writes kept back through a ledger outage;
- :mod:`.told`: what the deliveries tell the hooks, each event said in one place;
- :mod:`.keys`: attempt keys; :mod:`.options`: a task's options;
- :mod:`.flow`: the state machine that drives them (:class:`OperationManager`).
"""
