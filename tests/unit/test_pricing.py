import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budget_tasks.errors import EstimateRefused, UnknownModelPrice
from budget_tasks.pricing import ModelPrice, PriceTable, Usage, default_prices, load_prices
from budget_tasks.pricing.prices import Pricing
from budget_tasks.pricing.rates import MESSAGE_OVERHEAD_TOKENS, REQUEST_OVERHEAD_TOKENS
from budget_tasks.pricing.table import parse_prices
from budget_tasks.pricing.usage import PriceContext

TABLE = PriceTable(
    version="test-1",
    models={
        "m": ModelPrice(input=1_000_000, cached_input=250_000, output=3_000_000),
        "c": ModelPrice(input=3, cached_input=1, output=7, cache_write=5),
    },
)


def test_cost_rounds_up_to_a_whole_minor_unit() -> None:
    # 1 input token at 3 per million is 0.000003 minor units: charged as 1, never 0.
    assert TABLE.cost("c", Usage(input_tokens=1)) == 1
    assert TABLE.cost("c", Usage()) == 0
    # exactly one million tokens at 7 per million is exactly 7
    assert TABLE.cost("c", Usage(output_tokens=1_000_000)) == 7
    assert TABLE.cost("c", Usage(output_tokens=1_000_001)) == 8


def test_cost_prices_each_kind_of_token() -> None:
    usage = Usage(input_tokens=10, cached_input_tokens=4, output_tokens=20, reasoning_tokens=5)
    # 10 x 1.0 + 4 x 0.25 + 20 x 3.0 = 71 minor units
    assert TABLE.cost("m", usage) == 71
    # cache writes fall back to the input price when the model has none
    assert TABLE.cost("m", Usage(cache_write_tokens=2)) == 2
    assert TABLE.cost("c", Usage(cache_write_tokens=1_000_000)) == 5


def test_unknown_model_is_refused_not_guessed() -> None:
    with pytest.raises(UnknownModelPrice) as info:
        TABLE.cost("gpt-9", Usage(input_tokens=1))
    assert (info.value.model, info.value.version) == ("gpt-9", "test-1")
    with pytest.raises(UnknownModelPrice):
        TABLE.estimate("gpt-9", ["hi"], 10)


def test_estimate_needs_a_max_output_limit() -> None:
    with pytest.raises(EstimateRefused, match="max output"):
        TABLE.estimate("m", ["hi"], None)
    with pytest.raises(EstimateRefused, match="positive"):
        TABLE.estimate("m", ["hi"], 0)
    with pytest.raises(TypeError):
        TABLE.estimate("m", ["hi"], 10.0)  # type: ignore[arg-type]


def test_estimate_bounds_input_by_utf8_bytes_plus_overhead() -> None:
    est = TABLE.estimate("m", ["héllo", "世界"], 100)
    # "héllo" is 6 bytes, "世界" is 6 bytes
    assert est.input_tokens == REQUEST_OVERHEAD_TOKENS + 6 + 6 + 2 * MESSAGE_OVERHEAD_TOKENS
    assert est.output_tokens == 100
    assert est.price_version == "test-1"
    assert est.amount == est.input_tokens * 1 + 100 * 3


def test_usage_refuses_bad_counts() -> None:
    with pytest.raises(TypeError):
        Usage(input_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        Usage(output_tokens=-1)
    with pytest.raises(ValueError, match="reasoning"):
        Usage(output_tokens=1, reasoning_tokens=2)


MILLION = 1_000_000


def test_the_default_prices_come_from_the_maintained_source_in_integer_units() -> None:
    prices = default_prices()
    assert prices.version.startswith("genai-prices ")
    # gpt-4o-mini: $0.15 / $0.60 per million tokens, as micro-USD per million
    rates = prices.rates("gpt-4o-mini", provider="openai")
    assert (rates.input, rates.output, rates.cached_input) == (150_000, 600_000, 75_000)
    assert prices.cost("gpt-4o-mini", Usage(input_tokens=MILLION), provider="openai") == 150_000
    assert isinstance(prices.cost("gpt-4o-mini", Usage(input_tokens=7), provider="openai"), int)
    # one token at $0.15/M is 0.15 micro-USD: charged 1, never 0
    assert prices.cost("gpt-4o-mini", Usage(input_tokens=1), provider="openai") == 1


def test_a_snapshot_id_is_priced_as_its_model() -> None:
    prices = default_prices()
    for alias, snapshot, provider in (
        ("gpt-4o", "gpt-4o-2024-08-06", "openai"),
        ("claude-haiku-4-5", "claude-haiku-4-5-20251001", "anthropic"),
    ):
        usage = Usage(input_tokens=1234, output_tokens=567)
        assert (
            prices.cost(snapshot, usage, provider=provider)
            == prices.cost(alias, usage, provider=provider)
            > 0
        )


def test_anthropic_cache_writes_are_priced_by_their_ttl() -> None:
    prices = default_prices()
    five = prices.cost("claude-haiku-4-5", Usage(cache_write_tokens=MILLION), provider="anthropic")
    hour = prices.cost(
        "claude-haiku-4-5", Usage(cache_write_1h_tokens=MILLION), provider="anthropic"
    )
    read = prices.cost("claude-haiku-4-5", Usage(cached_input_tokens=MILLION), provider="anthropic")
    plain = prices.cost("claude-haiku-4-5", Usage(input_tokens=MILLION), provider="anthropic")
    # input $1/M: a 5-minute write 1.25x, a 1-hour write 2x, a read 0.1x
    assert (plain, five, hour, read) == (1_000_000, 1_250_000, 2_000_000, 100_000)


def test_batches_bill_half_and_tiers_bill_their_own_rates() -> None:
    prices = default_prices()
    usage = Usage(input_tokens=MILLION, output_tokens=MILLION)
    full = prices.cost("claude-haiku-4-5", usage, provider="anthropic")
    batch = prices.cost(
        "claude-haiku-4-5", usage, provider="anthropic", context=PriceContext(batch=True)
    )
    assert batch * 2 == full == 6_000_000
    standard = prices.cost("gpt-4o", usage, provider="openai")
    priority = prices.cost(
        "gpt-4o", usage, provider="openai", context=PriceContext(service_tier="priority")
    )
    flex = prices.cost("o3", usage, provider="openai", context=PriceContext(service_tier="flex"))
    assert standard < priority and flex * 2 == prices.cost("o3", usage, provider="openai")


def test_a_long_context_request_is_priced_at_its_tier() -> None:
    prices = default_prices()
    short = prices.rates("claude-sonnet-4-5", provider="anthropic", input_tokens=100_000)
    long = prices.rates("claude-sonnet-4-5", provider="anthropic", input_tokens=300_000)
    assert long.input == 2 * short.input and long.output > short.output
    # the estimate picks the tier its own input bound falls in
    big = ["x" * 250_000]
    est = prices.estimate("claude-sonnet-4-5", big, 10, provider="anthropic", cache=None)
    assert est.amount >= -(-(est.input_tokens * long.input + 10 * long.output) // MILLION)


def test_the_tier_starts_just_past_its_boundary_whatever_was_asked_before() -> None:
    from budget_tasks.pricing.maintained import MaintainedPrices

    prices = MaintainedPrices()  # its rates are kept by tier: ask across the boundary
    rates = [
        prices.rates("claude-sonnet-4-5", provider="anthropic", input_tokens=n).input
        for n in (200_001, 200_000, 0, 200_001, 10**7)
    ]
    assert rates[1] == rates[2] and rates[0] == rates[3] == rates[4] == 2 * rates[1]


def test_a_model_is_looked_up_in_its_own_provider_only() -> None:
    prices = default_prices()
    assert prices.knows("gpt-4o-mini", "openai")
    assert not prices.knows("gpt-4o-mini", "anthropic")  # never another vendor's price
    with pytest.raises(UnknownModelPrice):
        prices.cost("claude-9-turbo", Usage(input_tokens=1), provider="anthropic")


def test_your_own_table_overrides_the_maintained_prices_and_matches_snapshots() -> None:
    contract = parse_prices(
        {
            "version": "acme-2026",
            "models": {
                "gpt-4o": {
                    "input": 1_000_000,
                    "output": 2_000_000,
                    "variants": {"batch": {"input": 500_000, "output": 1_000_000}},
                }
            },
        }
    )
    prices = Pricing(contract)
    usage = Usage(input_tokens=MILLION, output_tokens=MILLION)
    assert prices.cost("gpt-4o-2024-08-06", usage, provider="openai") == 3_000_000
    assert (
        prices.cost("gpt-4o", usage, provider="openai", context=PriceContext(batch=True))
        == 1_500_000
    )
    # a model the table does not name: the maintained price
    assert prices.cost("gpt-4o-mini", usage, provider="openai") == default_prices().cost(
        "gpt-4o-mini", usage, provider="openai"
    )
    assert prices.version.startswith("acme-2026+genai-prices")


def test_a_table_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"version": "v9", "models": {"x": {"input": 1, "output": 2}}}))
    table = load_prices(path)
    assert table.version == "v9"
    assert table.price("x") == ModelPrice(input=1, cached_input=1, output=2)
    path.write_text(json.dumps({"version": "v9", "models": {"x": {"input": 1.5, "output": 2}}}))
    with pytest.raises(TypeError):
        load_prices(path)


texts = st.lists(st.text(max_size=200), min_size=1, max_size=6)
MODELS = [
    ("gpt-4o-mini", "openai"),
    ("gpt-4o", "openai"),
    ("gpt-4.1-nano", "openai"),
    ("o4-mini", "openai"),
    ("claude-haiku-4-5", "anthropic"),
    ("claude-sonnet-4-5", "anthropic"),
    ("claude-opus-4-1", "anthropic"),
]


@given(
    model=st.sampled_from(MODELS),
    prompt=texts,
    max_output=st.integers(1, 4_000),
    cache=st.sampled_from([None, "5m", "1h"]),
    data=st.data(),
)
def test_estimate_is_never_below_any_usage_within_the_limits(
    model: tuple[str, str],
    prompt: list[str],
    max_output: int,
    cache: str | None,
    data: st.DataObject,
) -> None:
    """Whatever way a provider splits the bounded input between plain, cached and
    cache-write tokens (only the writes the request allows), and however much of the
    output limit it uses (reasoning included), the priced actual never exceeds the
    estimate."""
    name, provider = model
    table = default_prices()
    est = table.estimate(name, prompt, max_output, provider=provider, cache=cache)
    cached = data.draw(st.integers(0, est.input_tokens))
    written = 0 if cache is None else data.draw(st.integers(0, est.input_tokens - cached))
    hour = 0 if cache != "1h" else data.draw(st.integers(0, est.input_tokens - cached - written))
    plain = data.draw(st.integers(0, est.input_tokens - cached - written - hour))
    output = data.draw(st.integers(0, max_output))
    usage = Usage(
        input_tokens=plain,
        cached_input_tokens=cached,
        cache_write_tokens=written,
        cache_write_1h_tokens=hour,
        output_tokens=output,
        reasoning_tokens=data.draw(st.integers(0, output)),
    )
    assert table.cost(name, usage, provider=provider) <= est.amount
