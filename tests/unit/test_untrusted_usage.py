"""What an answer says it used is read as a count, or not at all: never as 0 where it
is garbled, never below its own parts, never at a cheaper model than the request asked
for; a stream without its final counts says nothing."""

from __future__ import annotations

from typing import Any

import pytest

from budget_tasks.errors import UsageUnreadable
from budget_tasks.pricing import Usage, default_prices
from budget_tasks.providers.anthropic import usage as anthropic_usage
from budget_tasks.providers.base import Part, Reported
from budget_tasks.providers.openai import usage as openai_usage


@pytest.mark.parametrize(
    "usage",
    [
        "weird",
        {"prompt_tokens": "many", "completion_tokens": 1},
        {"prompt_tokens": -5, "completion_tokens": 1},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"prompt_tokens": float("inf"), "completion_tokens": 1},
        {"completion_tokens": 10},  # no input total at all
    ],
)
def test_a_usage_that_cannot_be_read_is_not_read_as_zero(usage: Any) -> None:
    with pytest.raises(UsageUnreadable):
        openai_usage.chat({"usage": usage, "model": "gpt-4o-mini"}, {})


def test_counts_in_other_spellings_are_read_and_rounded_up() -> None:
    read = openai_usage.chat(
        {"usage": {"prompt_tokens": "5000", "completion_tokens": 12.5}, "model": "m"}, {}
    )
    assert read is not None
    assert (read.usage.input_tokens, read.usage.output_tokens) == (5000, 13)


def test_a_total_below_its_parts_is_read_as_its_parts() -> None:
    read = openai_usage.chat(
        {
            "usage": {
                "prompt_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": 5000},
                "completion_tokens": 0,
                "completion_tokens_details": {"reasoning_tokens": 3000},
            },
            "model": "m",
        },
        {},
    )
    assert read is not None
    assert (read.usage.cached_input_tokens, read.usage.output_tokens) == (5000, 3000)
    split = anthropic_usage.tokens(
        {
            "input_tokens": 1,
            "output_tokens": 1,
            "cache_creation_input_tokens": 10,
            "cache_creation": {"ephemeral_5m_input_tokens": 700, "ephemeral_1h_input_tokens": 300},
        }
    )
    assert (split.cache_write_tokens, split.cache_write_1h_tokens) == (700, 300)


def test_a_stream_left_before_its_final_counts_says_nothing() -> None:
    start = {
        "type": "message_start",
        "message": {
            "id": "m1",
            "model": "claude-haiku-4-5",
            "usage": {"input_tokens": 30, "output_tokens": 1},
        },
    }
    assert anthropic_usage.message_stream([start], {}) is None
    error = {"type": "error", "error": {"type": "overloaded_error"}}
    assert anthropic_usage.message_stream([start, error], {}) is None
    delta = {"type": "message_delta", "usage": {"output_tokens": 4000}}
    done = anthropic_usage.message_stream([start, delta], {})
    assert done is not None and done.usage.output_tokens == 4000


def test_an_answer_naming_a_cheaper_model_than_the_request_is_priced_at_the_request() -> None:
    used = Usage(input_tokens=1_000_000)
    cheaper = Reported((Part("gpt-4o-mini", used, asked="gpt-4o"),))
    snapshot = Reported((Part("gpt-4o-2024-08-06", used, asked="gpt-4o"),))
    prices = default_prices()
    asked = prices.cost("gpt-4o", used, provider="openai")
    assert cheaper.cost(None, "openai", None) == asked == snapshot.cost(None, "openai", None)
    # a dearer model than asked for is charged as it is
    dearer = Reported((Part("gpt-4o", used, asked="gpt-4o-mini"),))
    assert dearer.cost(None, "openai", None) == asked


def test_your_own_table_refuses_a_dearer_tier_it_has_no_rate_for() -> None:
    from budget_tasks.errors import UnknownModelPrice
    from budget_tasks.pricing.table import parse_prices
    from budget_tasks.pricing.usage import PriceContext

    table = parse_prices(
        {"version": "contract", "models": {"gpt-4o": {"input": 1_000_000, "output": 2_000_000}}}
    )
    assert table.rates("gpt-4o", context=PriceContext(batch=True)).input == 1_000_000
    with pytest.raises(UnknownModelPrice, match="priority"):
        table.rates("gpt-4o", context=PriceContext(service_tier="priority"))


def test_a_provider_host_is_known_with_or_without_its_trailing_dot() -> None:
    from budget_tasks import bypass

    bypass.know("https://llm-gw.example.net./v1")
    assert ("llm-gw.example.net", 443) in bypass._endpoints
    import budget_tasks.providers  # noqa: F401  (registers the vendors)

    assert ("eu.api.openai.com", 443) in bypass._endpoints
