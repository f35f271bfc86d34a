"""How a drift check judges its lines, from the sums of each window (no services):
pending, ok, open, shifted, untold, drift, and the totals that add up a small leak;
what open and untold attempts account for, each measure apart; the relative threshold;
how keys and projects are named from the ledger's hints; the gauge a check sets,
cleared of the groups it no longer sees; gateways left out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY

from budget_tasks.drift import (
    UNLISTED,
    DriftLine,
    DriftReport,
    Threshold,
    _Groups,
    _lines,
    _Sums,
)
from budget_tasks.ledger.usage import UsageRow
from budget_tasks.metrics import PrometheusHooks
from budget_tasks.providers import Anthropic, OpenAI
from budget_tasks.providers.reports import KeyInfo, hint_of

T0 = datetime(2026, 12, 1, 10, tzinfo=UTC)
HOUR = timedelta(hours=1)
LATER = T0 + 10 * HOUR
STRICT = Threshold(relative=0.0, tokens=0, money=0)


def judged(
    table: dict[tuple[datetime, str], _Sums],
    threshold: Threshold = STRICT,
    settled_by: datetime = LATER,
) -> dict[tuple[datetime, str, bool], DriftLine]:
    lines = _lines("input_tokens", table, HOUR, settled_by, threshold)
    return {(line.start, line.group, line.total): line for line in lines}


def test_a_window_not_settled_is_pending_whatever_it_shows() -> None:
    lines = judged({(T0, "m"): _Sums(ledger=0, provider=500)}, settled_by=T0 + HOUR / 2)
    assert lines[(T0, "m", False)].status == "pending"


def test_agreement_within_a_threshold_is_ok_and_one_past_both_is_drift() -> None:
    loose = Threshold(relative=0.1, tokens=10, money=0)
    table = {
        (T0, "equal"): _Sums(ledger=100, provider=100),
        # exactly at the thresholds: 10 tokens, 10% of 100
        (T0, "at"): _Sums(ledger=90, provider=100),
        (T0, "past"): _Sums(ledger=89, provider=100),
        # past the absolute but within the relative one: not drift
        (T0, "share"): _Sums(ledger=980, provider=1_000),
    }
    lines = judged(table, loose)
    assert lines[(T0, "equal", False)].status == "ok"
    assert lines[(T0, "at", False)].status == "ok"
    assert lines[(T0, "past", False)].status == "drift"
    assert lines[(T0, "share", False)].status == "ok"


def test_what_open_attempts_can_account_for_is_open_and_no_more() -> None:
    table = {
        (T0, "within"): _Sums(ledger=100, provider=150, open=1, open_bound=50),
        (T0, "beyond"): _Sums(ledger=100, provider=151, open=1, open_bound=50),
        # the ledger counting more is never explained by open attempts
        (T0, "under"): _Sums(ledger=150, provider=100, open=1, open_bound=50),
    }
    lines = judged(table)
    assert lines[(T0, "within", False)].status == "open"
    assert lines[(T0, "beyond", False)].status == "drift"
    assert lines[(T0, "under", False)].status == "drift"


def test_neighbouring_windows_that_cancel_are_shifted_and_others_are_not() -> None:
    table = {
        (T0, "m"): _Sums(ledger=40, provider=0),
        (T0 + HOUR, "m"): _Sums(ledger=0, provider=40),
        # not neighbours: an hour between them
        (T0, "gap"): _Sums(ledger=40, provider=0),
        (T0 + 2 * HOUR, "gap"): _Sums(ledger=0, provider=40),
        # neighbours that do not cancel
        (T0, "more"): _Sums(ledger=40, provider=0),
        (T0 + HOUR, "more"): _Sums(ledger=0, provider=41),
    }
    lines = judged(table)
    assert lines[(T0, "m", False)].status == lines[(T0 + HOUR, "m", False)].status == "shifted"
    assert lines[(T0, "gap", False)].status == "drift"
    assert lines[(T0, "more", False)].status == "drift"


def test_untold_attempts_account_for_no_more_than_their_requests_allowed() -> None:
    """Settled attempts with no tokens recorded: the provider counting more, within
    the tokens their requests allowed, is untold; beyond it, drift; one that recorded
    no bound allows any number."""
    table = {
        (T0, "within"): _Sums(ledger=100, provider=400, untold=1, untold_bound=300),
        (T0, "beyond"): _Sums(ledger=100, provider=401, untold=1, untold_bound=300),
        (T0, "no bound"): _Sums(ledger=0, provider=10_000, untold=1, unbounded=1),
        # the ledger counting more is never explained by attempts it counts as none
        (T0, "under"): _Sums(ledger=400, provider=100, untold=1, untold_bound=300),
    }
    lines = judged(table)
    assert lines[(T0, "within", False)].status == "untold"
    assert lines[(T0, "beyond", False)].status == "drift"
    assert lines[(T0, "no bound", False)].status == "untold"
    assert lines[(T0, "under", False)].status == "drift"
    assert lines[(T0, "within", False)].untold_bound == 300


def test_what_attempts_account_for_is_set_aside_before_the_thresholds() -> None:
    """An open call allowed 200 tokens and used 50: a leak of 250 beside it is within
    an absolute threshold of 100 once the open call's whole bound is set aside (100
    left), and one of 300 is not (150 left)."""
    threshold = Threshold(relative=0.0, tokens=100, money=0)
    table = {
        (T0, "small"): _Sums(ledger=1_000, provider=1_300, open=1, open_bound=200),
        (T0, "large"): _Sums(ledger=1_000, provider=1_350, open=1, open_bound=200),
    }
    lines = judged(table, threshold)
    assert lines[(T0, "small", False)].status == "open"
    assert lines[(T0, "large", False)].status == "drift"


def test_an_attempt_with_no_bound_accounts_for_its_own_window_and_no_other() -> None:
    """A window whose untold attempt recorded no bound cannot be told; the leak of the
    windows beside it still adds up in the total."""
    threshold = Threshold(relative=0.0, tokens=1_000, money=0)
    table = {
        (T0, "m"): _Sums(ledger=0, provider=900),
        (T0 + HOUR, "m"): _Sums(ledger=0, provider=900),
        (T0 + 2 * HOUR, "m"): _Sums(ledger=0, provider=5_000, untold=1, unbounded=1),
    }
    lines = judged(table, threshold)
    assert lines[(T0 + 2 * HOUR, "m", False)].status == "untold"
    total = lines[(T0, "m", True)]
    assert (total.provider, total.untold, total.status) == (6_800, 1, "drift")


def test_the_relative_threshold_is_taken_of_the_larger_figure() -> None:
    """10% of the larger figure, far from the absolute threshold: 100 apart at 900 and
    1,000 is within it (10% of 900 would not be), whichever side counts more; 101 apart
    is past it."""
    loose = Threshold(relative=0.1, tokens=10, money=0)
    table = {
        (T0, "provider more"): _Sums(ledger=900, provider=1_000),
        (T0, "ledger more"): _Sums(ledger=1_000, provider=900),
        (T0, "past"): _Sums(ledger=899, provider=1_000),
    }
    lines = judged(table, loose)
    assert lines[(T0, "provider more", False)].status == "ok"
    assert lines[(T0, "ledger more", False)].status == "ok"
    assert lines[(T0, "past", False)].status == "drift"


def test_a_leak_too_small_for_any_window_adds_up_in_the_total() -> None:
    threshold = Threshold(relative=0.0, tokens=100, money=0)
    table = {(T0 + n * HOUR, "key_b"): _Sums(ledger=0, provider=90) for n in range(5)}
    table[(T0 + 9 * HOUR, "key_b")] = _Sums(ledger=0, provider=90)  # not settled yet
    lines = judged(table, threshold, settled_by=T0 + 5 * HOUR)
    windows = [line for line in lines.values() if not line.total and line.status != "pending"]
    assert len(windows) == 5 and {line.status for line in windows} == {"ok"}
    [total] = [line for line in lines.values() if line.total]
    assert (total.start, total.end) == (T0, T0 + 5 * HOUR)  # the final windows only
    assert (total.provider, total.status) == (450, "drift")
    # a group of one window has no total of its own (it would say the window twice)
    assert not any(line.total for line in judged({(T0, "one"): _Sums(provider=500)}).values())


def _report(groups: dict[str, int]) -> DriftReport:
    lines = [
        DriftLine("input_tokens", T0, T0 + HOUR, group, 0, difference, 0, 0, "drift")
        for group, difference in groups.items()
    ]
    return DriftReport("openai", T0, T0 + HOUR, "api_key", "1h", lines)


def _gauge(group: str) -> float | None:
    labels = {"provider": "openai", "by": "api_key", "group": group, "measure": "input_tokens"}
    return REGISTRY.get_sample_value("budget_tasks_provider_drift", labels)


def test_the_gauge_shows_the_last_check_and_forgets_the_groups_it_no_longer_saw() -> None:
    sink = PrometheusHooks()
    sink.drift_checked(report=_report({"key_gauge_a": 30, "key_gauge_b": 70}))
    assert (_gauge("key_gauge_a"), _gauge("key_gauge_b")) == (30.0, 70.0)
    sink.drift_checked(report=_report({"key_gauge_a": 5}))
    assert (_gauge("key_gauge_a"), _gauge("key_gauge_b")) == (5.0, None)


def test_a_gateway_reads_no_organisation_reports_unless_given_its_own_admin_key() -> None:
    assert OpenAI().admin_key_env == "OPENAI_ADMIN_KEY"
    assert Anthropic().admin_key_env == "ANTHROPIC_ADMIN_KEY"
    gateway = OpenAI("gateway", hosts=["llm-gw.internal"])
    assert gateway.admin_key_env == "" and gateway.admin_client(5.0) is None
    assert Anthropic("bedrock-proxy").admin_key_env == ""
    own = OpenAI("gateway", admin_key_env="GATEWAY_ADMIN_KEY")
    assert own.admin_key_env == "GATEWAY_ADMIN_KEY"


def _sent(secret: str) -> UsageRow:
    """A ledger row of one call sent with ``secret`` (the ledger keeps its hint)."""
    return UsageRow(T0, "gpt-4o-mini", hint_of(secret), 1, 0, 10, 5, 100, 0)


LISTED = [
    KeyInfo("key_a", "sk-pro...AAA1", "proj_a"),
    # two keys whose hints the ledger's hint of either matches: one group
    KeyInfo("key_b", "sk-pro...BBB2", "proj_b"),
    KeyInfo("key_c", "sk-pro...BBB2", "proj_c"),
]
KEY_A = "sk-proj-first-000000000000000000AAA1"
KEY_B = "sk-proj-second-00000000000000000BBB2"
GONE = "sk-proj-deleted-0000000000000000DDD4"


def test_keys_are_named_by_their_hints_and_unlisted_keys_are_one_group_on_both_sides() -> None:
    groups = _Groups("api_key", LISTED, [hint_of(s) for s in (KEY_A, KEY_B, GONE)])
    assert groups.ledger(_sent(KEY_A)) == groups.provider(None, "key_a", "proj_a") == "key_a"
    both = "key_b + key_c"
    assert groups.ledger(_sent(KEY_B)) == both
    assert groups.provider(None, "key_b", "proj_b") == groups.provider(None, "key_c", None) == both
    assert groups.ambiguous() == 1
    # deleted since: its id in the report, its hint in the ledger; one group
    assert groups.ledger(_sent(GONE)) == groups.provider(None, "key_gone", "proj_a") == UNLISTED
    by_project = _Groups("project", LISTED, [hint_of(s) for s in (KEY_A, KEY_B, GONE)])
    assert by_project.ledger(_sent(KEY_A)) == by_project.provider(None, "key_a", "x") == "proj_a"
    assert by_project.ledger(_sent(KEY_B)) == "proj_b + proj_c"
    assert by_project.provider(None, "key_gone", "proj_a") == UNLISTED
    # a report that names no key (Anthropic's costs): its project
    assert by_project.provider(None, None, "proj_a") == "proj_a"
    assert by_project.provider(None, None, None) == "(default)"
