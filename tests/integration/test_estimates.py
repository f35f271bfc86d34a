"""Estimates against what the provider really bills: through the official SDKs, to the
fake provider, for generated prompts and outputs within the request's limits."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget_tasks.errors import EstimateRefused, UnknownModelPrice
from budget_tasks.providers import (
    anthropic_client,
    anthropic_message,
    estimates,
    openai_chat,
    openai_client,
)
from budget_tasks.testing import FakeProvider

texts = st.text(st.characters(codec="utf-8"), max_size=300)
messages = st.lists(
    st.builds(
        lambda role, text: {"role": role, "content": text},
        st.sampled_from(["user", "assistant"]),
        texts,
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=messages,
    system=st.none() | texts,
    limit=st.integers(1, 2_000),
    data=st.data(),
    sdk=st.sampled_from(["openai", "anthropic"]),
)
def test_the_estimate_is_never_below_the_billed_actual(
    fake: FakeProvider,
    prompt: list[dict[str, str]],
    system: str | None,
    limit: int,
    data: st.DataObject,
    sdk: str,
) -> None:
    output = data.draw(st.integers(0, limit), label="output tokens")
    headers = {
        "x-fake-output-tokens": str(output),
        "x-fake-cached-tokens": str(data.draw(st.integers(0, 50), label="cached")),
    }
    key = f"est-{uuid.uuid4()}"  # unique across examples, unlike a drawn value
    sent: Any
    if sdk == "openai":
        params: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "max_completion_tokens": limit,
            "messages": ([{"role": "system", "content": system}] if system else []) + prompt,
        }
        bound = estimates.openai_chat(params)
        client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=10.0)
        sent = openai_chat(client, key=key, extra_headers=headers, **params)
    else:
        params = {"model": "claude-haiku-4-5", "max_tokens": limit, "messages": prompt}
        if system:
            params["system"] = system
        bound = estimates.anthropic_message(params)
        client = anthropic_client(base_url=fake.url, api_key="x", timeout=10.0)
        sent = anthropic_message(client, key=key, extra_headers=headers, **params)
    assert sent.cost == fake.billed_for(key)
    assert sent.cost <= bound.amount
    assert sent.usage.output_tokens == output


def test_estimates_refuse_what_they_cannot_bound() -> None:
    with pytest.raises(EstimateRefused):
        estimates.openai_chat({"model": "gpt-4o-mini", "messages": [{"content": "hi"}]})
    with pytest.raises(UnknownModelPrice):
        estimates.anthropic_message({"model": "claude-9", "max_tokens": 5, "messages": []})
    est = estimates.openai_response(
        {
            "model": "gpt-4o-mini",
            "input": "hello",
            "instructions": "be brief",
            "max_output_tokens": 10,
        }
    )
    assert est.output_tokens == 10
    assert est.input_tokens > len("hello") + len("be brief")


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CHAT = {"model": "gpt-4o-mini", "max_completion_tokens": 40}
CLAUDE = {"model": "claude-haiku-4-5", "max_tokens": 40}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, today. " * 20,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "A city name"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {f"field_{i}": {"type": "string"} for i in range(40)},
        },
    },
}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("messages", [{"role": "user", "content": [IMAGE]}], "image_url"),
        ("messages", [{"role": "user", "content": [{"type": "input_audio"}]}], "input_audio"),
        ("messages", [{"role": "user", "content": [{"type": "file"}]}], "file"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
        ("modalities", ["text", "audio"], "modalities"),
        ("web_search_options", {}, "web_search_options"),
        ("web_search_options", {"search_context_size": "low"}, "web_search_options"),
        ("tools", [{"type": "web_search"}], "web_search"),
        ("service_tier", "priority", "service_tier"),
        ("extra_body", {"anything": 1}, "extra_body"),
        ("some_new_parameter", True, "some_new_parameter"),
    ],
)
def test_a_chat_field_that_may_bill_and_cannot_be_bounded_is_refused_by_name(
    field: str, value: Any, named: str
) -> None:
    params: dict[str, Any] = {**CHAT, "messages": [{"role": "user", "content": "hi"}]}
    params[field] = value
    with pytest.raises(EstimateRefused, match=named):
        estimates.openai_chat(params)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "file_search"}]}, "file_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
    ],
)
def test_a_responses_field_that_may_bill_unseen_is_refused_by_name(
    params: dict[str, Any], named: str
) -> None:
    with pytest.raises(EstimateRefused, match=named):
        estimates.openai_response(
            {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 5, **params}
        )


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"mcp_servers": [{"url": "https://x"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
    ],
)
def test_an_anthropic_field_that_may_bill_unseen_is_refused_by_name(
    params: dict[str, Any], named: str
) -> None:
    with pytest.raises(EstimateRefused, match=named):
        estimates.anthropic_message(
            {**CLAUDE, "messages": [{"role": "user", "content": "hi"}], **params}
        )


def _billed_openai(fake: FakeProvider, params: dict[str, Any], output: int) -> int:
    key = f"est-{uuid.uuid4()}"
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=10.0)
    sent = openai_chat(
        client, key=key, extra_headers={"x-fake-output-tokens": str(output)}, **params
    )
    assert sent.cost == fake.billed_for(key) > 0
    return int(sent.cost)


def test_output_is_bounded_per_choice_times_n(fake: FakeProvider) -> None:
    """n=3 is billed three outputs: the estimate bounds all three, each at its limit
    (the boundary: every choice uses exactly max_completion_tokens)."""
    params = {**CHAT, "n": 3, "messages": [{"role": "user", "content": "Name three birds."}]}
    one = estimates.openai_chat({**params, "n": 1})
    three = estimates.openai_chat(params)
    assert three.output_tokens == 3 * CHAT["max_completion_tokens"] == 3 * one.output_tokens
    billed = _billed_openai(fake, params, output=CHAT["max_completion_tokens"])
    assert one.amount < billed <= three.amount  # without n the estimate was below the bill


def test_tools_and_a_response_schema_are_billed_input_and_bounded(fake: FakeProvider) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for extra in (
        {"tools": [WEATHER_TOOL] * 3, "tool_choice": "auto"},
        {"response_format": SCHEMA},
    ):
        params = {**CHAT, "messages": messages, **extra}
        bare = estimates.openai_chat({**CHAT, "messages": messages})
        bound = estimates.openai_chat(params)
        billed = _billed_openai(fake, params, output=CHAT["max_completion_tokens"])
        assert bare.amount < billed <= bound.amount, extra


def test_a_conversation_with_tool_calls_and_results_is_bounded(fake: FakeProvider) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "' + "Oslo" * 200 + '"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain. " * 100},
    ]
    params = {**CHAT, "messages": messages, "tools": [WEATHER_TOOL]}
    billed = _billed_openai(fake, params, output=CHAT["max_completion_tokens"])
    assert billed <= estimates.openai_chat(params).amount


def test_images_are_bounded_only_with_a_per_image_bound(fake: FakeProvider) -> None:
    from budget_tasks.testing.fake_provider import IMAGE_TOKENS

    params = {
        **CHAT,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE, IMAGE]}
        ],
    }
    with pytest.raises(EstimateRefused, match="image_tokens"):
        estimates.openai_chat(params)
    too_low = estimates.openai_chat(params, image_tokens=1)
    bound = estimates.openai_chat(params, image_tokens=IMAGE_TOKENS)
    billed = _billed_openai(fake, params, output=CHAT["max_completion_tokens"])
    assert too_low.amount < billed <= bound.amount  # the bound is the caller's to give


def test_anthropic_tools_and_system_blocks_are_bounded(fake: FakeProvider) -> None:
    tool = {
        "name": "lookup_order",
        "description": "Find an order by its number. " * 30,
        "input_schema": {"type": "object", "properties": {"number": {"type": "string"}}},
    }
    params = {
        **CLAUDE,
        "system": [{"type": "text", "text": "You are a support agent. " * 40}],
        "tools": [tool, {**tool, "name": "cancel_order"}],
        "messages": [
            {"role": "user", "content": "Where is order 12?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "tu_1",
                        "name": "lookup_order",
                        "input": {"number": "12"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "Shipped. " * 50}
                ],
            },
        ],
    }
    bare = estimates.anthropic_message({**CLAUDE, "messages": [{"role": "user", "content": "x"}]})
    bound = estimates.anthropic_message(params)
    key = f"est-{uuid.uuid4()}"
    client = anthropic_client(base_url=fake.url, api_key="x", timeout=10.0)
    sent = anthropic_message(
        client, key=key, extra_headers={"x-fake-output-tokens": "40"}, **params
    )
    assert bare.amount < sent.cost == fake.billed_for(key) <= bound.amount
