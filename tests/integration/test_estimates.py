"""Estimates against what the provider really bills: through the official SDKs, to the
fake provider, for generated prompts and outputs within the request's limits."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget_tasks.errors import EstimateRefused, UnknownModelPrice
from budget_tasks.providers import estimates
from budget_tasks.providers.registry import anthropic_client, openai_client
from budget_tasks.testing import FakeProvider
from budget_tasks.testing.fake_billing import IMAGE_TOKENS
from tests.support.sdk_calls import anthropic_message, openai_chat

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
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "base64", "data": "JVBE"}}
                        ],
                    }
                ]
            },
            "billed by its pages",
        ),
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


# -- every metered endpoint: billed within its bound, or refused before sending ---------

IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}
INPUT_IMAGE = {"type": "input_image", "image_url": "https://example.org/a.png"}
FUNCTION_TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up in the dictionary. " * 15,
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
}
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=120)


@st.composite
def responses_input(draw: st.DrawFn) -> list[Any]:
    """Responses input items as agent code sends them: messages, tool calls and their
    outputs (media inside them), reasoning items, computer screenshots."""
    items: list[Any] = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(
            st.sampled_from(
                ["message", "function_call", "output", "output_image", "reasoning", "computer"]
            )
        )
        if kind == "message":
            items.append({"role": "user", "content": draw(words)})
        elif kind == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": '{"word": "' + draw(words).replace('"', "") + '"}',
                }
            )
        elif kind == "output":
            items.append(
                {"type": "function_call_output", "call_id": "call_1", "output": draw(words)}
            )
        elif kind == "output_image":
            items.append(
                {"type": "function_call_output", "call_id": "call_1", "output": [INPUT_IMAGE]}
            )
        elif kind == "reasoning":
            items.append(
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": draw(words)}],
                    "encrypted_content": "gAAAA" + "x" * draw(st.integers(0, 400)),
                }
            )
        else:
            items.append(
                {
                    "type": "computer_call_output",
                    "call_id": "call_2",
                    "output": {
                        "type": "computer_screenshot",
                        "image_url": "data:image/png;base64,AA",
                    },
                }
            )
    return items


@st.composite
def metered_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A request to one of the metered endpoints, as a user's code would send it."""
    endpoint = draw(
        st.sampled_from(
            ["chat", "responses", "embeddings", "completions", "images", "speech", "messages"]
        )
    )
    limit = draw(st.integers(1, 400))
    if endpoint == "chat":
        content: Any = draw(words)
        if draw(st.booleans()):
            content = [{"type": "text", "text": content}, IMAGE_PART]
        params: dict[str, Any] = {
            "model": draw(st.sampled_from(["gpt-4o-mini", "gpt-4.1-nano", "o4-mini"])),
            "max_completion_tokens": limit,
            "n": draw(st.integers(1, 3)),
            "messages": [{"role": "user", "content": content}],
        }
        if draw(st.booleans()):
            params["tools"] = [WEATHER_TOOL]
        tier = draw(st.sampled_from(["default", "priority", "flex", "auto", None]))
        if tier is not None:
            params["service_tier"] = tier
        return endpoint, params
    if endpoint == "responses":
        params = {
            "model": draw(st.sampled_from(["gpt-4o-mini", "o4-mini"])),
            "max_output_tokens": limit,
            "input": draw(responses_input()),
            "instructions": draw(st.none() | words),
            # a tier named: the bound is priced at it alone (tight, as a bill at it is)
            "service_tier": draw(st.sampled_from(["default", "priority", "flex", None])),
        }
        if draw(st.booleans()):
            # tool definitions as large as real ones get (long descriptions, schemas)
            described = {
                **FUNCTION_TOOL,
                "description": "Look it up. " * draw(st.integers(1, 400)),
            }
            params["tools"] = [described] * draw(st.integers(1, 3))
        return endpoint, {k: v for k, v in params.items() if v is not None}
    if endpoint == "embeddings":
        one = draw(words)
        value = draw(st.sampled_from([one, [one, one + "!"], [1, 2, 3, 4]]))
        return endpoint, {"model": "text-embedding-3-small", "input": value}
    if endpoint == "completions":
        params = {
            "model": "gpt-3.5-turbo-instruct",
            "prompt": draw(
                st.sampled_from(
                    [draw(words), [draw(words), draw(words)], [[1, 2, 3]] * draw(st.integers(1, 5))]
                )
            ),
            "n": draw(st.integers(1, 2)),
        }
        if draw(st.booleans()):
            params["max_tokens"] = limit  # else the API's own default of 16
        return endpoint, params
    if endpoint == "images":
        return endpoint, {
            "model": "gpt-image-1",
            "prompt": draw(words),
            "n": draw(st.integers(1, 2)),
            "size": draw(st.sampled_from(["auto", "1024x1024", "1536x1024", "1024x1536"])),
            "quality": draw(st.sampled_from(["auto", "low", "medium", "high"])),
        }
    if endpoint == "speech":
        return endpoint, {
            "model": draw(st.sampled_from(["tts-1", "tts-1-hd"])),
            "voice": "alloy",
            "input": draw(words),
        }
    cache = draw(st.sampled_from([None, {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}]))
    system: Any = [{"type": "text", "text": "You are terse. " * draw(st.integers(1, 50))}]
    if cache:
        system[0]["cache_control"] = cache
    content = draw(words)
    if draw(st.booleans()):
        content = [
            {
                "type": "tool_result",
                "tool_use_id": "tu_1",
                "content": [
                    {"type": "text", "text": content},
                    {
                        "type": "image",
                        "source": {"type": "url", "url": "https://example.org/a.png"},
                    },
                ],
            }
        ]
    return endpoint, {
        "model": draw(st.sampled_from(["claude-haiku-4-5", "claude-sonnet-4-5"])),
        "max_tokens": limit,
        "system": system,
        "messages": [{"role": "user", "content": content}],
    }


def _estimate(endpoint: str, params: dict[str, Any]) -> Any:
    media = {"image_tokens": IMAGE_TOKENS}
    return {
        "chat": lambda: estimates.openai_chat(params, **media),
        "responses": lambda: estimates.openai_response(params, **media),
        "embeddings": lambda: estimates.openai_embeddings(params),
        "completions": lambda: estimates.openai_completions(params),
        "images": lambda: estimates.openai_images(params),
        "speech": lambda: estimates.openai_speech(params),
        "messages": lambda: estimates.anthropic_message(params, **media),
    }[endpoint]()


def _send(fake: FakeProvider, endpoint: str, params: dict[str, Any], key: str) -> None:
    import anthropic as anthropic_sdk
    import openai as openai_sdk

    headers = {"Idempotency-Key": key, "x-fake-output-tokens": "100000"}  # all it may
    if endpoint == "messages":
        with anthropic_sdk.Anthropic(base_url=fake.url, api_key="x", max_retries=0) as claude:
            claude.messages.create(extra_headers=headers, **params)
        return
    with openai_sdk.OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0) as oai:
        {
            "chat": oai.chat.completions.create,
            "responses": oai.responses.create,
            "embeddings": oai.embeddings.create,
            "completions": oai.completions.create,
            "images": oai.images.generate,
            "speech": oai.audio.speech.create,
        }[endpoint](extra_headers=headers, **params)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=metered_request())
def test_every_metered_endpoint_is_billed_within_its_estimate(
    fake: FakeProvider, request: tuple[str, dict[str, Any]]
) -> None:
    """Through the official SDKs to the fake in its realistic mode (cache writes by TTL,
    reasoning tokens, snapshots, tiers, media in tool results billed as media), each
    request using every output token it may: the bill never passes the estimate."""
    endpoint, params = request
    bound = _estimate(endpoint, params)
    key = f"bound-{uuid.uuid4()}"
    _send(fake, endpoint, params, key)
    billed = fake.billed_for(key)
    assert 0 < billed <= bound.amount, (endpoint, billed, bound)


def test_media_billed_by_pages_or_seconds_is_refused_even_with_a_per_image_bound() -> None:
    """A per-image bound cannot bound a PDF's pages or audio's seconds; a document whose
    source is plain text is its text."""
    audio = {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}
    with pytest.raises(EstimateRefused, match="audio"):
        estimates.openai_chat(
            {**CHAT, "messages": [{"role": "user", "content": [audio]}]}, image_tokens=765
        )
    with pytest.raises(EstimateRefused, match="audio"):
        estimates.openai_chat(
            {**CHAT, "messages": [{"role": "assistant", "audio": {"id": "audio_1"}}]}
        )
    text = "w" * 100_000
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": text},
    }
    bound = estimates.anthropic_message(
        {**CLAUDE, "messages": [{"role": "user", "content": [document]}]}
    )
    assert bound.input_tokens > len(text)


def test_legacy_completions_bound_every_prompt_given_as_token_ids() -> None:
    one = estimates.openai_completions(
        {"model": "gpt-3.5-turbo-instruct", "prompt": [[1, 2]], "max_tokens": 1000}
    )
    many = estimates.openai_completions(
        {"model": "gpt-3.5-turbo-instruct", "prompt": [[1, 2]] * 100, "max_tokens": 1000}
    )
    assert (one.output_tokens, many.output_tokens) == (1000, 100_000)
