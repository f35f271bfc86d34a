"""The fake provider answers as the real APIs do, by default: every answer it serves
validates against the official SDKs' own types, compressed, named by its snapshot,
with each vendor's headers; and each realistic behaviour can be turned off
(:class:`~budget_tasks.testing.Realism`), which is how a test shows it catches a kind
fake."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pydantic
import pytest

from budget_tasks.testing import FakeProvider, Realism

CHAT = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "hello"}],
}


def openai_type(name: str) -> Any:
    import openai.types as t
    import openai.types.chat as c
    import openai.types.responses as r

    for module in (t, c, r):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def anthropic_type(name: str) -> Any:
    import anthropic.types as a
    import anthropic.types.messages as m

    for module in (a, m):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def valid(kind: Any, data: Any) -> Any:
    """``data`` as ``kind``, every required field present and of its type (the SDK's
    own models; extra fields allowed, as the SDKs allow them)."""
    parsed = kind.model_validate(data)
    missing = [
        name
        for name, field in kind.model_fields.items()
        if field.is_required() and name not in data
    ]
    assert missing == [], f"{kind.__name__} lacks {missing}"
    return parsed


def sse(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in text.splitlines()
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")
    ]


@pytest.fixture
def http() -> Any:
    with httpx2.Client(timeout=10.0, headers={"Accept-Encoding": "gzip, br, zstd"}) as client:
        yield client


def test_every_answer_validates_against_the_sdks_own_types(fake: FakeProvider, http: Any) -> None:
    oai, base = fake.openai_base_url, fake.url
    stored = http.post(f"{oai}/chat/completions", json={**CHAT, "store": True}).json()
    answers = [
        (openai_type("ChatCompletion"), stored),
        (
            openai_type("ChatCompletion"),
            http.post(f"{oai}/chat/completions", json={**CHAT, "n": 2}).json(),
        ),
        (openai_type("ChatCompletion"), http.get(f"{oai}/chat/completions/{stored['id']}").json()),
        (
            openai_type("Response"),
            http.post(
                f"{oai}/responses",
                json={"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 16},
            ).json(),
        ),
        (
            openai_type("CreateEmbeddingResponse"),
            http.post(
                f"{oai}/embeddings", json={"model": "text-embedding-3-small", "input": ["a", "b"]}
            ).json(),
        ),
        (
            openai_type("Completion"),
            http.post(
                f"{oai}/completions",
                json={"model": "gpt-3.5-turbo-instruct", "prompt": "Once", "max_tokens": 5},
            ).json(),
        ),
        (
            openai_type("ImagesResponse"),
            http.post(
                f"{oai}/images/generations",
                json={"model": "gpt-image-1", "prompt": "a cat", "quality": "low"},
            ).json(),
        ),
        (
            anthropic_type("Message"),
            http.post(
                f"{base}/v1/messages",
                json={
                    "model": "claude-haiku-4-5",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ).json(),
        ),
        (
            anthropic_type("MessageTokensCount"),
            http.post(
                f"{base}/v1/messages/count_tokens",
                json={"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]},
            ).json(),
        ),
    ]
    batch = http.post(
        f"{base}/v1/messages/batches",
        json={
            "requests": [
                {
                    "custom_id": "q1",
                    "params": {
                        "model": "claude-haiku-4-5",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                }
            ]
        },
    ).json()
    answers.append((anthropic_type("MessageBatch"), batch))
    results = http.get(f"{base}/v1/messages/batches/{batch['id']}/results").text
    for line in results.splitlines():
        answers.append((anthropic_type("MessageBatchIndividualResponse"), json.loads(line)))
    for kind, data in answers:
        valid(kind, data)
    streamed = http.post(
        f"{oai}/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    ).text
    for chunk in sse(streamed):
        valid(openai_type("ChatCompletionChunk"), chunk)
    events = http.post(
        f"{base}/v1/messages",
        json={
            "model": "claude-haiku-4-5",
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ).text
    adapter = pydantic.TypeAdapter(anthropic_type("RawMessageStreamEvent"))
    for event in sse(events):
        if event["type"] != "ping":
            adapter.validate_python(event)


def test_answers_are_compressed_named_by_snapshot_with_each_vendors_headers(
    fake: FakeProvider, http: Any
) -> None:
    answer = http.post(f"{fake.openai_base_url}/chat/completions", json=CHAT)
    assert answer.headers["content-encoding"] in ("br", "gzip", "zstd")
    assert answer.json()["model"] == "gpt-4o-mini-2024-07-18"
    assert answer.headers["x-request-id"] and "request-id" not in answer.headers
    assert answer.headers["x-ratelimit-remaining-requests"]
    claude = http.post(
        f"{fake.url}/v1/messages",
        json={
            "model": "claude-haiku-4-5",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert claude.json()["model"] == "claude-haiku-4-5-20251001"
    assert claude.headers["request-id"] and "x-request-id" not in claude.headers
    assert claude.headers["anthropic-ratelimit-requests-remaining"]
    fake.plan("status=429")
    limited = http.post(f"{fake.openai_base_url}/chat/completions", json=CHAT)
    assert limited.status_code == 429 and limited.headers["retry-after"]
    fake.plan("status=529")
    overloaded = http.post(
        f"{fake.url}/v1/messages",
        json={
            "model": "claude-haiku-4-5",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert overloaded.status_code == 529
    assert overloaded.json()["error"]["type"] == "overloaded_error"


def test_reasoning_tiers_and_cache_writes_are_reported_as_the_apis_report_them(
    fake: FakeProvider, http: Any
) -> None:
    reasoning = http.post(
        f"{fake.openai_base_url}/chat/completions", json={**CHAT, "model": "o4-mini"}
    ).json()
    details = reasoning["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= reasoning["usage"]["completion_tokens"]
    priority = http.post(
        f"{fake.openai_base_url}/chat/completions", json={**CHAT, "service_tier": "priority"}
    ).json()
    assert priority["service_tier"] == "priority"
    cached = {
        "model": "claude-haiku-4-5",
        "max_tokens": 8,
        "system": [
            {
                "type": "text",
                "text": "policy " * 500,
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        "messages": [{"role": "user", "content": "x"}],
    }
    first = http.post(f"{fake.url}/v1/messages", json=cached).json()["usage"]
    again = http.post(f"{fake.url}/v1/messages", json=cached).json()["usage"]
    assert first["cache_creation"]["ephemeral_1h_input_tokens"] > 500
    assert (
        first["cache_creation_input_tokens"] == first["cache_creation"]["ephemeral_1h_input_tokens"]
    )
    assert again["cache_read_input_tokens"] == first["cache_creation_input_tokens"]
    served = fake.served()
    assert served[-2].billed > served[-1].billed  # a 1-hour write (2x) dearer than a read


def test_each_realistic_behaviour_can_be_turned_off(fake: FakeProvider, http: Any) -> None:
    """The kind fake the old tests ran against: no compression, the alias echoed, both
    request-id headers, no reasoning tokens, no cache writes, no tier."""
    fake.realism = Realism.kind()
    answer = http.post(
        f"{fake.openai_base_url}/chat/completions", json={**CHAT, "model": "o4-mini"}
    )
    assert "content-encoding" not in answer.headers
    data = answer.json()
    assert data["model"] == "o4-mini" and "service_tier" not in data
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert answer.headers["request-id"] and answer.headers["x-request-id"]
    message = http.post(
        f"{fake.url}/v1/messages",
        json={
            "model": "claude-haiku-4-5",
            "max_tokens": 8,
            "system": [
                {"type": "text", "text": "p " * 500, "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [{"role": "user", "content": "x"}],
        },
    ).json()
    assert message["usage"]["cache_creation_input_tokens"] == 0
    fake.reset()
    assert fake.realism == Realism()  # a reset makes it realistic again


def test_both_sdks_list_and_retrieve_the_models_the_fake_answers_for(fake: FakeProvider) -> None:
    """`GET /v1/models` in each vendor's shape (a client that checks its model at start,
    as LangChain and many apps do, works offline), parsed by each SDK's own types; an
    unknown model is the SDK's NotFoundError."""
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
    listed = [m.id for m in oai.models.list()]
    assert {"gpt-4o-mini", "gpt-4o-mini-2024-07-18"} <= set(listed)
    assert not any(name.startswith("claude") for name in listed)
    assert oai.models.retrieve("gpt-4o-mini").owned_by == "openai"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-nope")
    claude = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
    names = [m.id for m in claude.models.list()]
    assert "claude-haiku-4-5" in names and all(n.startswith("claude") for n in names)
    assert claude.models.retrieve("claude-haiku-4-5").type == "model"
    assert [s.billed for s in fake.served()] == [0] * len(fake.served())  # free to ask


def test_a_tool_call_carries_every_required_argument_of_its_schema(fake: FakeProvider) -> None:
    """A model's tool call fills the tool's required parameters (code that reads them,
    or validates them with the schema, works against the fake), in both vendors'
    shapes."""
    import anthropic
    import openai

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}},
                       "required": ["hourly"]},
            "note": {"type": "string"},
        },
        "required": ["city", "days", "unit", "detail"],
    }  # fmt: skip
    expected = {"city": "fake", "days": 1, "unit": "celsius", "detail": {"hourly": True}}
    oai = openai.OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
    completion = oai.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=32,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": schema}}],
    )
    [call] = completion.choices[0].message.tool_calls or []
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == expected
    claude = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model="claude-haiku-4-5",
        max_tokens=32,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": "weather", "input_schema": schema}],
    )
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.input == expected
