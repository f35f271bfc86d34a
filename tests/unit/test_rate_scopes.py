"""Which rate windows a call claims (its scopes, its own model's among them), what a
provider's answer tells the windows, and the app's limits checked before any is set."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from budget_tasks import rate_limits
from budget_tasks._rate_ask import RateAsk, RateSeen
from budget_tasks._trust import Bound
from budget_tasks.ledger.rate_takes import MOST_REMAINING, MOST_WAIT_MS, narrowing
from budget_tasks.pricing import Usage
from budget_tasks.providers.anthropic import Anthropic
from budget_tasks.providers.openai import OpenAI
from budget_tasks.providers.rate_headers import RateState, Window, seen_of

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def no_groups() -> None:
    rate_limits.set_groups({})


def test_a_call_claims_its_model_its_family_its_groups_every_model_and_its_key() -> None:
    rate_limits.set_groups({"openai": {"mini": ["gpt-4o-mini"], "big": ["gpt-4o"]}})
    claim = rate_limits.claim_of(
        OpenAI(), "openai", "gpt-4o-mini-2024-07-18", "sk-proj-abcdefgh...wxyz", Bound(100, 16)
    )
    assert claim.scopes == (
        "gpt-4o-mini-2024-07-18",
        "gpt-4o-mini",
        "mini",
        "*",
        "key:sk-proj-abcdefgh...wxyz",
    )
    assert claim.own == ("gpt-4o-mini-2024-07-18", "gpt-4o-mini")
    assert claim.ask == RateAsk(1, 116, 100, 16)
    # a model with no date is its own family, once; another vendor's groups are not its
    plain = rate_limits.claim_of(Anthropic(), "anthropic", "claude-haiku-4-5", None, None)
    assert plain.scopes == ("claude-haiku-4-5", "*") and plain.own == ("claude-haiku-4-5",)
    assert plain.ask == RateAsk(1, 0, 0, 0)


def test_each_vendor_counts_a_call_in_the_end_by_its_own_rule() -> None:
    used = Usage(input_tokens=40, cached_input_tokens=50, cache_write_tokens=10, output_tokens=7)
    bound = Bound(100, 64)
    # OpenAI: every input token, and the output it allowed, never corrected
    assert OpenAI().rate_counted(used, bound) == RateAsk(1, 100 + 64, 100, 64)
    # Anthropic: cache reads free, output as produced
    assert Anthropic().rate_counted(used, bound) == RateAsk(1, 50 + 7, 50, 7)


def test_limits_from_the_apps_config_are_checked_whole() -> None:
    good = {"openai": {"gpt-4o-mini": {"requests": 600, "tokens": 60_000}}}
    assert [(x.scope, x.kind, x.per_minute) for x in rate_limits.limits_of(good)] == [
        ("gpt-4o-mini", "requests", 600),
        ("gpt-4o-mini", "tokens", 60_000),
    ]
    with pytest.raises(ValueError, match="not 'rpm'"):
        rate_limits.limits_of({"openai": {"*": {"rpm": 600}}})
    with pytest.raises(ValueError, match="admits nothing"):
        rate_limits.limits_of({"openai": {"*": {"requests": 0}}})
    with pytest.raises(ValueError, match="negative"):
        rate_limits.limits_of({"openai": {"*": {"requests": -1}}})
    with pytest.raises(TypeError):
        rate_limits.limits_of({"openai": {"*": {"requests": 1.5}}})
    with pytest.raises(TypeError, match="mapping"):
        rate_limits.limits_of({"openai": ["gpt-4o-mini"]})
    with pytest.raises(TypeError, match="lists its models"):
        rate_limits.set_groups({"openai": {"mini": "gpt-4o-mini"}})


def test_what_an_answer_tells_the_windows() -> None:
    told = RateState(
        {"requests": Window(30, 0, timedelta(seconds=2)), "tokens": Window(60_000, 5_000)},
        retry_after=timedelta(seconds=1.5),
    )
    seen = seen_of(told, NOW, refused=True)
    assert seen == RateSeen(
        int(NOW.timestamp() * 1000),
        requests=0,
        tokens=5_000,
        wait_ms=1_500,
        requests_limit=30,
        tokens_limit=60_000,
    )
    # the wait only where nothing remains; the others narrowed to what remains
    assert narrowing(seen, "requests", True) == (0, 1_500, 30)
    assert narrowing(seen, "tokens", True) == (5_000, 0, 60_000)
    assert narrowing(seen, "output_tokens", True) is None
    # an answer that is not a refusal carries no wait
    assert seen_of(told, NOW, refused=False).wait_ms == 0  # type: ignore[union-attr]
    assert seen_of(RateState(), NOW, refused=False) is None


def test_a_refusal_that_names_no_limit_narrows_every_window_and_values_are_bounded() -> None:
    bare = RateSeen(0, wait_ms=10**9)
    assert narrowing(bare, "tokens", False) == (0, MOST_WAIT_MS, None)
    assert narrowing(RateSeen(0), "tokens", True) is None
    huge = RateSeen(0, requests=10**17, requests_limit=10**17)
    assert narrowing(huge, "requests", True) == (MOST_REMAINING, 0, MOST_REMAINING)


def test_one_models_headers_narrow_its_own_windows_and_no_shared_one() -> None:
    told = RateSeen(0, requests=0, wait_ms=2_000, requests_limit=30)
    assert narrowing(told, "requests", True) == (0, 2_000, 30)
    assert narrowing(told, "requests", False) is None  # `*`, a group, a key: not by it
    # a refusal that names no limit says nothing of which: every window owes its wait
    assert narrowing(RateSeen(0, wait_ms=2_000), "requests", False) == (0, 2_000, None)
