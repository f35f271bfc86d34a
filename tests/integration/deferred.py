"""Deliveries whose lease waits for their first call (``estimate_cost`` 0, the Quick
start's task), run in spawned OS processes by ``test_deferred_lease.py``.

Each run has code before its one call through the guarded client (it tells the test
it got there, then waits to be let go), and may die after the answer came back and
before its run's end, the window a deferred settlement leaves open.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.synchronize import Event
from typing import Any

from budget_tasks import Ledger
from budget_tasks.delivery.flow import Delivery, OperationManager
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.delivery.scope import AttemptScope, running
from budget_tasks.transport import guarded_openai_client

PROMPT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 24,
    "messages": [{"role": "user", "content": "A deferred lease."}],
}


def run_of(base_url: str, reached: Event | None, go: Event | None, die: bool) -> Any:
    """The task's code: wait at the barrier, make the call, return its answer (or die
    once the answer is in hand)."""

    def run(scope: AttemptScope) -> Any:
        with running(scope):
            if reached is not None and go is not None:
                reached.set()
                if not go.wait(60):
                    raise TimeoutError("the test never let the run go")
            client = guarded_openai_client(base_url=base_url, api_key="x", timeout=5.0)
            completion = client.chat.completions.create(**PROMPT)  # type: ignore[call-overload]
            if die:
                os._exit(9)  # killed between the answer and the run's end
            return completion.choices[0].message.content

    return run


def deliver(
    url: str,
    base_url: str,
    key: str,
    reached: Event | None = None,
    go: Event | None = None,
    *,
    die: bool = False,
    defer_writes: bool = True,
    lease_seconds: float = 600.0,
) -> tuple[str, Any]:
    """One delivery of ``key``: ``("ok", answer)`` or the error's name and text."""
    ledger = Ledger(url)
    options = DeliveryOptions(
        task="deferred", defer_writes=defer_writes, lease_seconds=lease_seconds
    )
    manager = OperationManager(ledger.calls, options)
    delivery = Delivery(
        key=key,
        fingerprint="fp",
        budget="team",
        estimate=lambda: 0,
        run=run_of(base_url, reached, go, die),
    )
    try:
        return "ok", manager.deliver(delivery)
    except Exception as exc:
        return type(exc).__name__, f"{exc}\n{traceback.format_exc()}"
    finally:
        ledger.dispose()
