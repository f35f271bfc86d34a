"""The guarded clients through the official openai and anthropic SDKs, over HTTP, to
the fake provider: retries off, classification, request ids, usage and cost."""

from __future__ import annotations

import socket
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from budget_tasks.errors import RetriesEnabled, StreamIncomplete
from budget_tasks.providers import ErrorOutcome, classify
from budget_tasks.providers.clients import require_no_retries
from budget_tasks.providers.registry import anthropic_client, openai_client
from budget_tasks.testing import FakeProvider
from tests.support.sdk_calls import anthropic_message, openai_chat, openai_response

# What the SDKs raise: their own errors, and (Anthropic streams) raw transport errors.
PROVIDER_ERRORS = (openai.APIError, anthropic.APIError, httpx2.TransportError)
PROMPT = [{"role": "user", "content": "Summarise the quarterly report in one line."}]


@pytest.fixture
def oai(fake: FakeProvider) -> Any:
    return openai_client(base_url=fake.openai_base_url, api_key="sk-test", timeout=5.0)


@pytest.fixture
def claude(fake: FakeProvider) -> Any:
    return anthropic_client(base_url=fake.url, api_key="sk-ant-test", timeout=5.0)


def chat(client: Any, key: str, **extra: Any) -> Any:
    return openai_chat(
        client, key=key, model="gpt-4o-mini", messages=PROMPT, max_completion_tokens=64, **extra
    )


def message(client: Any, key: str, **extra: Any) -> Any:
    return anthropic_message(
        client, key=key, model="claude-haiku-4-5", messages=PROMPT, max_tokens=64, **extra
    )


# -- retries ---------------------------------------------------------------------------


def test_guarded_clients_have_retries_off(oai: Any, claude: Any) -> None:
    assert oai.max_retries == 0
    assert claude.max_retries == 0
    with pytest.raises(RetriesEnabled):
        openai_client(api_key="x", max_retries=2)
    with pytest.raises(RetriesEnabled):
        anthropic_client(api_key="x", max_retries=1)


def test_a_500_is_exactly_one_http_request(fake: FakeProvider, oai: Any, claude: Any) -> None:
    for call, client in ((chat, oai), (message, claude)):
        fake.reset()
        with pytest.raises(PROVIDER_ERRORS) as info:
            call(client, "k-500", extra_headers={"x-fake-fault": "status=500"})
        assert classify(info.value) is ErrorOutcome.UNKNOWN
        assert len(fake.served()) == 1


def test_an_sdk_default_client_would_retry_and_is_refused(fake: FakeProvider) -> None:
    # What the guard prevents: the SDK's default sends the same request three times.
    default = openai.OpenAI(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    assert default.max_retries == 2
    fake.plan("status=500", count=3)
    with pytest.raises(openai.InternalServerError):
        default.with_options(max_retries=2).chat.completions.create(
            model="gpt-4o-mini",
            messages=PROMPT,
            max_completion_tokens=8,
        )
    assert len(fake.served()) == 3  # the SDK retried twice on its own
    fake.reset()
    for client in (default, anthropic.Anthropic(base_url=fake.url, api_key="x")):
        with pytest.raises(RetriesEnabled):
            require_no_retries(client)
    with pytest.raises(RetriesEnabled):
        chat(default, "k-default")
    with pytest.raises(RetriesEnabled):
        message(anthropic.Anthropic(base_url=fake.url, api_key="x"), "k-default")
    assert fake.served() == []  # refused before anything was sent


# -- classification --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        ("status=400", ErrorOutcome.NOT_BILLED),
        ("status=401", ErrorOutcome.NOT_BILLED),
        ("status=403", ErrorOutcome.NOT_BILLED),
        ("status=404", ErrorOutcome.NOT_BILLED),
        ("status=422", ErrorOutcome.NOT_BILLED),
        ("status=429", ErrorOutcome.RATE_LIMITED),
        ("status=500", ErrorOutcome.UNKNOWN),
        ("status=503", ErrorOutcome.UNKNOWN),
        ("reset", ErrorOutcome.UNKNOWN),
        ("hang=3", ErrorOutcome.UNKNOWN),
    ],
)
@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_classification_matches_what_the_provider_billed(
    fake: FakeProvider, sdk: str, fault: str, outcome: ErrorOutcome
) -> None:
    if sdk == "openai":
        client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
        call = chat
    else:
        client = anthropic_client(base_url=fake.url, api_key="x", timeout=1.0)
        call = message
    with pytest.raises(PROVIDER_ERRORS) as info:
        call(client, f"k-{fault}", extra_headers={"x-fake-fault": fault})
    assert classify(info.value) is outcome
    billed = fake.billed_for(f"k-{fault}")
    if outcome is not ErrorOutcome.UNKNOWN:
        assert billed == 0  # "not billed" must really mean the provider charged nothing
    elif fault in ("reset", "hang=3"):
        assert billed > 0  # the provider did the work: unknown is the honest answer


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_cut_stream_is_unknown_and_was_billed(fake: FakeProvider, sdk: str) -> None:
    seen: list[str] = []
    if sdk == "openai":
        client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
        run = lambda: chat(  # noqa: E731
            client,
            "k-cut",
            stream=True,
            on_request_id=seen.append,
            extra_headers={"x-fake-fault": "cut-stream"},
        )
    else:
        client = anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
        run = lambda: message(  # noqa: E731
            client,
            "k-cut",
            stream=True,
            on_request_id=seen.append,
            extra_headers={"x-fake-fault": "cut-stream"},
        )
    with pytest.raises(PROVIDER_ERRORS) as info:
        run()
    assert classify(info.value) is ErrorOutcome.UNKNOWN
    [served] = fake.served()
    assert served.billed > 0
    # The request id arrived with the headers, before the stream broke.
    assert seen == [served.request_id]


def test_connection_refused_before_sending_is_not_billed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the call: nothing listens
    for client, call in (
        (openai_client(base_url=f"http://127.0.0.1:{port}/v1", api_key="x"), chat),
        (anthropic_client(base_url=f"http://127.0.0.1:{port}", api_key="x"), message),
    ):
        with pytest.raises(PROVIDER_ERRORS) as info:
            call(client, "k-refused")
        assert classify(info.value) is ErrorOutcome.NOT_BILLED


def test_unrelated_errors_are_unknown() -> None:
    assert classify(RuntimeError("boom")) is ErrorOutcome.UNKNOWN
    assert classify(StreamIncomplete("openai", "no usage chunk")) is ErrorOutcome.UNKNOWN


# -- request ids, idempotency keys, usage and cost -------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_reports_request_id_usage_and_the_billed_cost(
    fake: FakeProvider, oai: Any, stream: bool
) -> None:
    seen: list[str] = []
    sent = chat(
        oai,
        "summarize:doc-1",
        stream=stream,
        on_request_id=seen.append,
        extra_headers={"x-fake-cached-tokens": "5", "x-fake-reasoning-tokens": "3"},
    )
    [served] = fake.served()
    assert served.idempotency_key == "summarize:doc-1"
    assert seen == [served.request_id] == [sent.request_id]
    assert sent.usage is not None
    assert sent.usage.cached_input_tokens == 5
    assert sent.usage.reasoning_tokens == 3
    assert sent.cost == served.billed > 0
    assert sent.result["finish_reason"] in ("stop", "length")
    assert sent.result["content"].strip()
    import openai.types.chat as chat_types

    if stream:  # the SDK's own events, every one, in order
        assert len(sent.response) > 2
        assert all(isinstance(c, chat_types.ChatCompletionChunk) for c in sent.response)
        assert sent.response[-1].usage is not None
    else:
        assert isinstance(sent.response, chat_types.ChatCompletion)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_message_reports_request_id_usage_and_the_billed_cost(
    fake: FakeProvider, claude: Any, stream: bool
) -> None:
    seen: list[str] = []
    sent = message(
        claude,
        "summarize:doc-2",
        stream=stream,
        on_request_id=seen.append,
        system="You are terse.",
        extra_headers={"x-fake-output-tokens": "40"},
    )
    [served] = fake.served()
    assert served.idempotency_key == "summarize:doc-2"
    assert seen == [served.request_id] == [sent.request_id]
    assert sent.usage is not None
    assert sent.usage.output_tokens == 40
    assert sent.cost == served.billed > 0
    assert sent.result["stop_reason"] == "end_turn"
    if stream:
        types = [event.type for event in sent.response]
        assert types[0] == "message_start" and types[-1] == "message_stop"
    else:
        assert sent.response.id == sent.response_id


def test_openai_response_background_has_no_usage_until_done(fake: FakeProvider, oai: Any) -> None:
    sent = openai_response(
        oai,
        key="k-bg",
        model="gpt-4o-mini",
        input="hello",
        max_output_tokens=32,
        background=True,
        extra_headers={"x-fake-work-seconds": "60"},
    )
    assert sent.result["status"] == "in_progress"
    assert (sent.usage, sent.cost) == (None, None)
    done = openai_response(
        oai, key="k-fg", model="gpt-4o-mini", input="hello", max_output_tokens=32
    )
    assert done.cost == fake.billed_for("k-fg") > 0


def test_unknown_model_is_a_404_and_not_billed(fake: FakeProvider, oai: Any) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        openai_chat(oai, key="k-m", model="gpt-nope", messages=PROMPT, max_completion_tokens=8)
    assert classify(info.value) is ErrorOutcome.NOT_BILLED
    assert fake.billed_for("k-m") == 0


def test_every_request_carries_its_attempt_key(fake: FakeProvider, oai: Any, claude: Any) -> None:
    chat(oai, "a-1")
    chat(oai, "a-2", stream=True)
    message(claude, "a-3")
    openai_response(oai, key="a-4", model="gpt-4o-mini", input="x", max_output_tokens=8)
    assert fake.state()["by_key"] == {"a-1": 1, "a-2": 1, "a-3": 1, "a-4": 1}


def test_the_helpers_hand_back_the_sdks_own_response_and_keep_all_of_it(
    fake: FakeProvider, oai: Any, claude: Any
) -> None:
    """Every choice past the first (n=2), the SDK's object itself, and the whole
    response as JSON in what is stored for replay."""
    import anthropic.types
    import openai.types.chat

    sent = openai_chat(
        oai,
        key="full:1",
        model="gpt-4o-mini",
        max_completion_tokens=16,
        n=2,
        messages=[{"role": "user", "content": "Two answers, please."}],
    )
    assert isinstance(sent.response, openai.types.chat.ChatCompletion)
    assert len(sent.response.choices) == 2
    assert len(sent.result["response"]["choices"]) == 2
    assert sent.result["response"]["id"] == sent.response_id
    said = anthropic_message(
        claude,
        key="full:2",
        model="claude-haiku-4-5",
        max_tokens=16,
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert isinstance(said.response, anthropic.types.Message)
    assert said.result["response"]["content"][0]["text"] == said.result["content"]
