"""A ledger and the fake provider on one clock moved by hand, for drift tests.

Calls are metered through the guarded clients, each its own operation run by the
delivery flow as a task's run is; calls past the ledger go through a plain SDK client;
keys are deleted (OpenAI) or archived (Anthropic) through the vendors' admin APIs with
the official SDKs; an operator resolves an unknown outcome as ``budget-tasks resolve``
does. The ledger records each call at the clock's time and the fake serves it then, so
a test sends in any minute it chooses, and the drift check reads the reports over HTTP
with an admin key."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import anthropic
import openai

from budget_tasks import Ledger
from budget_tasks.delivery.flow import Delivery, OperationManager
from budget_tasks.delivery.options import DeliveryOptions
from budget_tasks.delivery.scope import running
from budget_tasks.drift import DriftReport, Threshold, check_drift
from budget_tasks.providers import registry
from budget_tasks.providers.base import sdk_client
from budget_tasks.resolution import resolve_outcome
from budget_tasks.testing import FakeProvider, ManualClock
from budget_tasks.transport import guarded_anthropic_client, guarded_openai_client

OPENAI_ADMIN = "sk-admin-drift-world-0123456789abcdef"
ANTHROPIC_ADMIN = "sk-ant-admin01-drift-world-0123456789abcdef"
MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-haiku-4-5"}
ASK = "How far did the ledger drift?"


def prompt(tokens: int) -> str:
    """A message the fake counts as ``tokens`` input tokens in a request of its own
    (``ceil(bytes / 4) + 4`` for the text, 3 for the request)."""
    if tokens < 8:
        raise ValueError("a request counts at least 8 input tokens")
    return "x" * (4 * (tokens - 7))


class World:
    """The ledger at ``url`` and ``fake``, both on one manual clock from ``start``."""

    def __init__(self, url: str, fake: FakeProvider, start: datetime) -> None:
        self.clock = ManualClock(start)
        self.fake = fake
        fake.clock = lambda: self.clock().timestamp()
        self.ledger = Ledger(url, clock=self.clock)
        self.ledger.create_budget("team", 10**12)
        self._guarded: dict[tuple[str, str], Any] = {}

    def close(self) -> None:
        self.ledger.dispose()
        for client in self._guarded.values():
            client.close()

    def advance(self, minutes: int = 1) -> None:
        self.clock.advance(minutes=minutes)

    def _client(self, vendor: str, key: str) -> Any:
        client = self._guarded.get((vendor, key))
        if client is None:
            make = guarded_openai_client if vendor == "openai" else guarded_anthropic_client
            base = self.fake.openai_base_url if vendor == "openai" else self.fake.url
            client = self._guarded[(vendor, key)] = make(base_url=base, api_key=key, timeout=5.0)
        return client

    def metered(
        self, vendor: str, key: str, *, max_tokens: int = 24, fault: str | None = None
    ) -> str:
        """One call through the guarded client of ``key``, run as a task's run; its
        attempt's state after (``fault="reset"``: billed, then the connection cut, so
        its outcome is unknown)."""
        client = self._client(vendor, key)
        headers = {"x-fake-fault": fault} if fault else {}
        ask = [{"role": "user", "content": ASK}]

        def call() -> Any:
            if vendor == "openai":
                return client.chat.completions.create(
                    model=MODELS[vendor],
                    max_completion_tokens=max_tokens,
                    messages=ask,
                    extra_headers=headers,
                )
            return client.messages.create(
                model=MODELS[vendor], max_tokens=max_tokens, messages=ask, extra_headers=headers
            )

        operation = f"drift:{uuid.uuid4().hex[:12]}"
        self._deliver(operation, call, fault is not None)
        [attempt] = [a for a in self.ledger.attempts() if a.key.startswith(operation)]
        return str(attempt.state)

    def _deliver(self, operation: str, call: Callable[[], Any], failing: bool) -> None:
        def run(scope: Any) -> None:
            with running(scope):
                call()  # its answer is not the operation's result

        manager = OperationManager(self.ledger.calls, DeliveryOptions(task="drift"))
        delivery = Delivery(
            key=operation, fingerprint=operation, budget="team", estimate=lambda: 0, run=run
        )
        try:
            manager.deliver(delivery)
        except Exception:
            if not failing:
                raise

    def bypass(self, vendor: str, key: str, *, input_tokens: int, output_tokens: int = 16) -> None:
        """A call past the ledger, through a plain SDK client with ``key``, that the
        fake counts as ``input_tokens`` and ``output_tokens``."""
        ask = [{"role": "user", "content": prompt(input_tokens)}]
        headers = {"x-fake-output-tokens": str(output_tokens)}
        if vendor == "openai":
            with openai.OpenAI(
                base_url=self.fake.openai_base_url, api_key=key, max_retries=0
            ) as plain:
                answer = plain.chat.completions.create(
                    model=MODELS[vendor],
                    max_completion_tokens=output_tokens,
                    messages=ask,
                    extra_headers=headers,
                )
                used = answer.usage
                assert used is not None
                counted = (used.prompt_tokens, used.completion_tokens)
        else:
            with anthropic.Anthropic(base_url=self.fake.url, api_key=key, max_retries=0) as plain:
                message = plain.messages.create(
                    model=MODELS[vendor],
                    max_tokens=output_tokens,
                    messages=ask,
                    extra_headers=headers,
                )
                counted = (message.usage.input_tokens, message.usage.output_tokens)
        assert counted == (input_tokens, output_tokens), counted

    def admin(self, vendor: str) -> Any:
        """The SDK client that reads ``vendor``'s reports and lists its keys."""
        if vendor == "openai":
            return sdk_client(
                registry.vendor("openai"),
                base_url=self.fake.openai_base_url,
                api_key=OPENAI_ADMIN,
                timeout=10.0,
            )
        return sdk_client(
            registry.vendor("anthropic"),
            base_url=self.fake.url,
            api_key=ANTHROPIC_ADMIN,
            timeout=10.0,
        )

    def retire(
        self, vendor: str, key_id: str, project: str | None, *, status: str = "archived"
    ) -> None:
        """Take a key out of use through the vendor's admin API: OpenAI deletes it (gone
        from every list); Anthropic sets its ``status``, archived or inactive (its API
        deletes none)."""
        if vendor == "openai":
            with openai.OpenAI(
                api_key=OPENAI_ADMIN,
                admin_api_key=OPENAI_ADMIN,
                base_url=self.fake.openai_base_url,
                max_retries=0,
            ) as admin:
                assert admin.admin.organization.projects.api_keys.delete(
                    key_id, project_id=str(project)
                ).deleted
            return
        with anthropic.Anthropic(
            api_key=ANTHROPIC_ADMIN, base_url=self.fake.url, max_retries=0
        ) as admin:
            changed = admin.organization.api_keys.update(key_id, status=status)
            assert changed.status == status

    def resolve_unknown(self) -> int:
        """An operator settles every unknown attempt at what the provider billed for it
        (as read in its console): no tokens are recorded. How many it settled."""
        billed = {s.idempotency_key: s.billed for s in self.fake.served() if s.idempotency_key}
        unknown = [a for a in self.ledger.attempts() if a.state == "unknown"]
        for attempt in unknown:
            actual = billed[self.ledger.provider_key(attempt.key)]
            done = resolve_outcome(self.ledger, attempt.key, actual, "billed, per the console")
            assert done.after.state == "settled"
        return len(unknown)

    def check(
        self,
        vendor: str,
        *,
        since: datetime,
        by: str | None = None,
        threshold: Threshold | None = None,
        bucket: str = "1m",
    ) -> DriftReport:
        """A drift check from ``since`` to the end of the clock's day, made a day after
        it: every window final, the day's costs too."""
        until = self.clock().replace(hour=0, minute=0, second=0, microsecond=0)
        until += timedelta(days=1)
        return check_drift(
            self.ledger,
            registry.vendor(vendor),
            since=since,
            until=until,
            by=by,
            bucket=bucket,
            threshold=threshold,
            admin=self.admin(vendor),
            now=until + timedelta(days=1),
        )
