"""Drift while the world changes under it, under hypothesis: calls metered through the
guarded clients with two services' keys, some of them ending unknown (billed, then the
connection cut) and later settled by an operator with no tokens recorded; keys rotated
(a new key made, the old one deleted through OpenAI's admin API or archived or
disabled through Anthropic's); an OpenAI key's owner leaving its project (the key
works on, and the project's list leaves it out unless asked); calls sent past the
ledger with a plain SDK client, with a service's key or a script's own; minutes
passing. Against PostgreSQL, the fake provider over HTTP and the official SDKs, the
ledger and the fake on one clock moved by hand.

Whenever the check runs (by nothing, model, key or project, every difference counted:
no threshold), a line drifts exactly where traffic went past the ledger: in the group
of each key that sent it (the unlisted keys' group for a key deleted since), in every
measure compared, and nowhere else. What open and resolved calls allowed never hides a
leak: each leak is larger than all they could account for.

``BUDGET_TASKS_DRIFT_EXAMPLES`` sets how many examples each vendor runs (default 8) and
``BUDGET_TASKS_DRIFT_STEPS`` how many steps each (default 20);
``BUDGET_TASKS_DRIFT_SHRINK=0`` reports a failure as found, unshrunk (shrinking one
takes minutes: each step is real traffic). Each vendor's run prints how many checks
saw the rarer cases (run pytest with ``-s``)."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from datetime import UTC, datetime
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from budget_tasks.drift import (
    ALL,
    DEFAULT_PROJECT,
    UNLISTED,
    DriftLine,
    Threshold,
    model_family,
)
from budget_tasks.testing import FakeProvider

from ..conftest import empty_ledger_tables
from ..support.drift_world import MODELS, World

EXAMPLES = int(os.environ.get("BUDGET_TASKS_DRIFT_EXAMPLES", "8"))
STEPS = int(os.environ.get("BUDGET_TASKS_DRIFT_STEPS", "20"))
SHRINK = os.environ.get("BUDGET_TASKS_DRIFT_SHRINK", "1") != "0"
START = datetime(2026, 3, 10, 18, tzinfo=UTC)
EXACT = Threshold(relative=0.0, tokens=0, money=0)
#: A leak's size: more than every open and resolved call of a run could account for
#: (each allows a few dozen input tokens and 24 output tokens beyond what it used).
LEAK_INPUT, LEAK_OUTPUT = 12_000, 4_000
#: Each service's project (OpenAI) or workspace (Anthropic); a script's key is
#: registered on its first use, in the default one.
SERVICES = {"openai": {"svc-a": "proj_a", "svc-b": "proj_b"}}
SERVICES["anthropic"] = {"svc-a": "wrkspc_a", "svc-b": "wrkspc_b"}
SCRIPT = "script"


class DriftMachine(RuleBasedStateMachine):
    vendor: ClassVar[str]
    url: ClassVar[str]
    fake: ClassVar[FakeProvider]
    #: how many checks saw each of the rarer cases
    reached: ClassVar[Counter[str]]

    def __init__(self) -> None:
        super().__init__()
        empty_ledger_tables(self.url)
        self.fake.reset()
        self.world = World(self.url, self.fake, START)
        self.serial = itertools.count(1)
        #: each service's key in use, every key's id and project, the keys deleted
        self.current: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        self.projects: dict[str, str | None] = {}
        self.deleted: set[str] = set()
        #: the keys that sent traffic past the ledger, and those the ledger metered
        self.leaked: set[str] = set()
        self.used: set[str] = set()
        self.script = self._secret(SCRIPT)
        for service in SERVICES[self.vendor]:
            self._new_key(service)

    def teardown(self) -> None:
        """Each run ends with a check of every grouping that splits the traffic."""
        try:
            for by in (None, "api_key", "project"):
                self.check(by)
        finally:
            self.world.close()

    def _secret(self, owner: str) -> str:
        """A new key: its hint (the vendors' and the ledger's) is its own."""
        n = next(self.serial)
        head = "sk-proj-" if self.vendor == "openai" else "sk-ant-api03-"
        return f"{head}{owner}-{n:04d}-0123456789abcdef{n:04d}"

    def _new_key(self, service: str) -> str:
        secret = self._secret(service)
        project = SERVICES[self.vendor][service]
        self.ids[secret] = self.fake.add_key(secret, project=project, vendor=self.vendor)
        self.projects[secret] = project
        self.current[service] = secret
        return secret

    # -- the world --------------------------------------------------------------------

    @rule(
        service=st.sampled_from(sorted(SERVICES["openai"])),
        outcome=st.sampled_from(["answered", "answered", "unknown"]),
    )
    def metered(self, service: str, outcome: str) -> None:
        """A call through the guarded client: answered, or billed and then cut."""
        fault = "reset" if outcome == "unknown" else None
        state = self.world.metered(self.vendor, self.current[service], fault=fault)
        assert state == ("unknown" if fault else "settled")
        self.used.add(self.current[service])

    @rule(via=st.sampled_from([*sorted(SERVICES["openai"]), SCRIPT]))
    def past_the_ledger(self, via: str) -> None:
        """A call straight to the provider with a service's key, or a script's."""
        secret = self.script if via == SCRIPT else self.current[via]
        self.world.bypass(self.vendor, secret, input_tokens=LEAK_INPUT, output_tokens=LEAK_OUTPUT)
        if secret not in self.ids:  # the provider registered it on first use
            [key] = [k for k in self.fake.keys.of(self.vendor) if k.secret == secret]
            self.ids[secret], self.projects[secret] = key.id, key.project
        self.leaked.add(secret)

    @rule(service=st.sampled_from(sorted(SERVICES["openai"])), how=st.sampled_from(["", "off"]))
    def rotate(self, service: str, how: str) -> None:
        """A new key for the service, the old one taken out of use: deleted (OpenAI),
        archived or disabled (Anthropic: ``how`` "off")."""
        old = self.current[service]
        self._new_key(service)
        status = "inactive" if how == "off" else "archived"
        self.world.retire(self.vendor, self.ids[old], self.projects[old], status=status)
        if self.vendor == "openai":
            self.deleted.add(old)

    @rule(service=st.sampled_from(sorted(SERVICES["openai"])))
    def leak_then_rotate(self, service: str) -> None:
        """What a leak is found after: a service's key sends past the ledger, and is
        rotated away before the check."""
        self.past_the_ledger(service)
        self.rotate(service, "")

    @precondition(lambda self: self.vendor == "openai")
    @rule(service=st.sampled_from(sorted(SERVICES["openai"])))
    def owner_leaves(self, service: str) -> None:
        """The key's owner loses access to its project: the key works on."""
        secret = self.current[service]
        self.fake.add_key(
            secret, project=self.projects[secret], vendor=self.vendor, owner_access="inactive"
        )

    @rule()
    def operator_resolves(self) -> None:
        """An operator settles every unknown call at what the provider billed."""
        self.world.resolve_unknown()

    @rule(minutes=st.integers(1, 3))
    def time_passes(self, minutes: int) -> None:
        self.world.advance(minutes)

    # -- the check ----------------------------------------------------------------------

    def _group(self, by: str | None, secret: str) -> str:
        """Where the traffic of ``secret`` shows, grouped ``by``."""
        if by is None:
            return ALL
        if by == "model":
            return model_family(MODELS[self.vendor])
        if secret in self.deleted:
            return UNLISTED
        if by == "api_key":
            return self.ids[secret]
        return self.projects[secret] or DEFAULT_PROJECT

    @rule(by=st.sampled_from([None, "model", "api_key", "project"]))
    def check(self, by: str | None) -> None:
        """Drift is flagged exactly in the groups of the keys that sent past the
        ledger, in every measure compared."""
        report = self.world.check(self.vendor, since=START, by=by, threshold=EXACT)
        self._count(report.lines)
        assert not any(line.status == "pending" for line in report.lines)
        expected = {self._group(by, secret) for secret in self.leaked}
        for measure in {line.measure for line in report.lines}:
            drifted = {line.group for line in report.drifted if line.measure == measure}
            assert drifted == expected, (by, measure, report.lines, report.notes)

    def _count(self, lines: list[DriftLine]) -> None:
        retired = set(self.ids) - set(self.current.values()) - {self.script}
        seen = {
            "a leak through a key retired since": bool(self.leaked & retired),
            "metered traffic of a key retired since": bool(self.used & retired),
            "an open call": any(line.open for line in lines),
            "a call an operator resolved": any(line.untold for line in lines),
            "a leak beside an open or resolved call": bool(self.leaked)
            and any(line.open or line.untold for line in lines),
        }
        self.reached.update(name for name, happened in seen.items() if happened)


def _run(vendor: str, url: str, fake: FakeProvider) -> Counter[str]:
    class Machine(DriftMachine):
        pass

    Machine.vendor, Machine.url, Machine.fake = vendor, url, fake
    Machine.reached = Counter()
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
            phases=[phase for phase in Phase if phase != Phase.shrink or SHRINK],
        ),
    )
    return Machine.reached


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_drift_is_flagged_exactly_where_traffic_went_past_the_ledger(
    vendor: str, pg_url: str, fake_server: FakeProvider
) -> None:
    try:
        reached = _run(vendor, pg_url, fake_server)
    finally:
        fake_server.reset()
    print(f"\n{vendor}: checks that saw {dict(sorted(reached.items()))}")
