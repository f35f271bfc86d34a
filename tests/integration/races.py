"""Deliveries run in their own OS processes, paused at a chosen point, so that a test
can force the interleaving of a race whose window is one round trip.

Each helper here runs in a spawned process (``multiprocessing`` "spawn"): it builds its
own ledger and SDK client, drives the Celery-free operation state machine
(``budget_tasks.delivery``) as a worker's BudgetTask does, and reports what it got.
"""

from __future__ import annotations

import traceback
from multiprocessing.synchronize import Event
from typing import Any

from budget_tasks import Ledger
from budget_tasks.delivery.flow import Delivery, OperationManager
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.delivery.scope import AttemptScope
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import openai_client
from tests.support.sdk_calls import openai_chat

PROMPT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 24,
    "messages": [{"role": "user", "content": "A race."}],
}
ESTIMATE = estimates.openai_chat(PROMPT).amount


def delivery(key: str, run: Any, lease_seconds: float = 600.0) -> Delivery:
    return Delivery(key=key, fingerprint="fp", budget="team", estimate=lambda: ESTIMATE, run=run)


def call(base_url: str, scope: AttemptScope, fault: str | None = None, timeout: float = 1.0) -> Any:
    client = openai_client(base_url=base_url, api_key="x", timeout=timeout)
    extra = {"extra_headers": {"x-fake-fault": fault}} if fault else {}
    return openai_chat(client, attempt=scope, **extra, **PROMPT).result


class _PauseAt:
    """A ledger whose ``method`` waits at a barrier: it tells ``reached``, then waits
    for ``go`` before it runs."""

    def __init__(self, ledger: Ledger, method: str, reached: Event, go: Event) -> None:
        self._ledger, self._method, self._reached, self._go = ledger, method, reached, go

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ledger, name)
        if name != self._method:
            return target

        def paused(*args: Any, **kwargs: Any) -> Any:
            self._reached.set()
            if not self._go.wait(60):
                raise TimeoutError("the test never let the paused write go")
            return target(*args, **kwargs)

        return paused


def _report(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return type(exc).__name__, f"{exc}\n{traceback.format_exc()}"


def deliver_pausing_at(
    url: str,
    base_url: str,
    key: str,
    method: str,
    on_unknown: str,
    reached: Event,
    go: Event,
) -> tuple[str, Any]:
    """One delivery of ``key`` whose ledger write ``method`` waits for the test."""
    ledger = Ledger(url)
    manager = OperationManager(
        _PauseAt(ledger.calls, method, reached, go),
        DeliveryOptions(task="race", on_unknown=on_unknown),
    )
    try:
        return _report(lambda: manager.deliver(delivery(key, lambda s: call(base_url, s))))
    finally:
        ledger.dispose()


def deliver_pausing_in_run(
    url: str, base_url: str, key: str, on_unknown: str, reached: Event, go: Event
) -> tuple[str, Any]:
    """One delivery of ``key`` whose run waits for the test before it calls the
    provider (the lease and the attempt's grant are taken; the call is not yet out)."""
    ledger = Ledger(url)
    manager = OperationManager(ledger.calls, DeliveryOptions(task="race", on_unknown=on_unknown))

    def run(scope: AttemptScope) -> Any:
        reached.set()
        if not go.wait(60):
            raise TimeoutError("the test never let the run go")
        return call(base_url, scope)

    try:
        return _report(lambda: manager.deliver(delivery(key, run)))
    finally:
        ledger.dispose()


AGENT_PROMPT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 24,
    "store": True,
    "messages": [{"role": "user", "content": "An agent's step."}],
}


def zero_estimate_agent(base_url: str) -> Any:
    """The Quick start's shape: estimate 0, the one call through the guarded client
    (a labelled attempt of its own, stored at the provider)."""
    from budget_tasks.delivery.scope import running
    from budget_tasks.transport import guarded_openai_client

    client = guarded_openai_client(base_url=base_url, api_key="x", timeout=5.0)

    def run(scope: AttemptScope) -> Any:
        with running(scope):
            completion = client.chat.completions.create(**AGENT_PROMPT)
        return completion.choices[0].message.content

    return run


def agent_delivery(key: str, base_url: str) -> Delivery:
    return Delivery(
        key=key,
        fingerprint="fp",
        budget="team",
        estimate=lambda: 0,
        run=zero_estimate_agent(base_url),
        payload={"args": [key], "kwargs": {}},
    )


def deliver_agent(url: str, base_url: str, key: str) -> tuple[str, Any]:
    """One delivery of the zero-estimate agent (the test may kill this process)."""
    ledger = Ledger(url)
    manager = OperationManager(ledger.calls, DeliveryOptions(task="agent"))
    try:
        return _report(lambda: manager.deliver(agent_delivery(key, base_url)))
    finally:
        ledger.dispose()
