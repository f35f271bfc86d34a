import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budget_tasks.errors import EstimateRefused, UnknownModelPrice
from budget_tasks.pricing import (
    MESSAGE_OVERHEAD_TOKENS,
    REQUEST_OVERHEAD_TOKENS,
    ModelPrice,
    PriceTable,
    Usage,
    default_prices,
    load_prices,
)

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


def test_packaged_table_is_versioned_and_in_integer_units() -> None:
    table = default_prices()
    assert table.version
    assert "gpt-4o-mini" in table.models
    assert "claude-haiku-4-5" in table.models
    for price in table.models.values():
        assert isinstance(price.input, int)
        assert isinstance(price.output, int)


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


@given(
    model=st.sampled_from(sorted(default_prices().models)),
    prompt=texts,
    max_output=st.integers(1, 4_000),
    data=st.data(),
)
def test_estimate_is_never_below_any_usage_within_the_limits(
    model: str, prompt: list[str], max_output: int, data: st.DataObject
) -> None:
    """Whatever way a provider splits the bounded input between plain, cached and
    cache-write tokens, and however much of the output limit it uses (reasoning
    included), the priced actual never exceeds the estimate."""
    table = default_prices()
    est = table.estimate(model, prompt, max_output)
    cached = data.draw(st.integers(0, est.input_tokens))
    written = data.draw(st.integers(0, est.input_tokens - cached))
    plain = data.draw(st.integers(0, est.input_tokens - cached - written))
    output = data.draw(st.integers(0, max_output))
    usage = Usage(
        input_tokens=plain,
        cached_input_tokens=cached,
        cache_write_tokens=written,
        output_tokens=output,
        reasoning_tokens=data.draw(st.integers(0, output)),
    )
    assert table.cost(model, usage) <= est.amount
