"""A task's options, as the delivery reads them (see BudgetTask)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeliveryOptions:
    """A task's options that the flow reads (see BudgetTask)."""

    task: str
    on_unknown: str = "hold"
    max_deliveries: int = 5
    lease_seconds: float = 600.0
    retry_when_budget_frees: float = 0.0
    rerun_billed: bool = False
    price_version: str | None = None
    #: a run's writes wait for its calls: a first delivery whose main call reserves
    #: nothing takes its lease with its first call's admission (not before ``run``),
    #: and each call's settlement waits for the run's next commit
    defer_writes: bool = True
    #: how long a call may wait in the worker process for its turn in its rate
    #: windows' line (seconds of wall time); a turn further off brings the message
    #: back then
    rate_wait_in_process: float = 30.0
    #: exceptions out of ``run`` by which a task asks to run again later (Celery's Retry)
    retry_types: tuple[type[BaseException], ...] = ()
