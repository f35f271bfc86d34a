"""The JSON the fake provider answers with, in the shapes of the real APIs (each one
validates against the official SDKs' own types: tests/integration/test_fake_provider.py)."""

from __future__ import annotations

import time
from typing import Any

from ..pricing import Usage


def words(n: int) -> str:
    return " ".join(["fake"] * max(1, n))


def openai_usage(usage: Usage) -> dict[str, Any]:
    """A chat (or legacy) completion's usage: cached and cache-written tokens inside
    the prompt total, reasoning inside the completion total."""
    prompt = usage.total_input_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage.output_tokens,
        "total_tokens": prompt + usage.output_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_input_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "audio_tokens": 0,
        },
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chat_completion(
    completion_id: str,
    model: str,
    usage: Usage,
    each_output: int,
    n: int,
    max_tokens: int | None,
    metadata: dict[str, Any],
    tier: str | None,
) -> dict[str, Any]:
    finish = "stop" if each_output < (max_tokens or 10**9) else "length"
    answer = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": words(each_output), "refusal": None},
                "finish_reason": finish,
                "logprobs": None,
            }
            for index in range(n)
        ],
        "usage": openai_usage(usage),
        "metadata": metadata,
    }
    if tier is not None:
        answer["service_tier"] = tier
    return answer


def chat_chunks(completion: dict[str, Any], with_usage: bool) -> list[dict[str, Any]]:
    """A chat completion as the chunks of its stream (and the usage chunk if asked)."""
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }
    if "service_tier" in completion:
        base["service_tier"] = completion["service_tier"]
    text = completion["choices"][0]["message"]["content"] or ""
    chunks = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        },
        *(
            {
                **base,
                "choices": [{"index": 0, "delta": {"content": w + " "}, "finish_reason": None}],
            }
            for w in text.split(" ")
        ),
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "finish_reason": completion["choices"][0]["finish_reason"],
                }
            ],
        },
    ]
    if with_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


def text_completion(
    completion_id: str, model: str, usage: Usage, each_output: int, n: int
) -> dict[str, Any]:
    """A legacy completion."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": words(each_output), "finish_reason": "length", "logprobs": None}
            for i in range(n)
        ],
        "usage": openai_usage(usage),
    }


def text_completion_chunks(completion: dict[str, Any], with_usage: bool) -> list[dict[str, Any]]:
    """A legacy completion as the chunks of its stream (and the usage chunk if asked)."""
    base = {k: completion[k] for k in ("id", "object", "created", "model")}
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "text": w + " ", "finish_reason": None, "logprobs": None}],
        }
        for w in completion["choices"][0]["text"].split(" ")
    ]
    chunks[-1]["choices"][0]["finish_reason"] = completion["choices"][0]["finish_reason"]
    if with_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


def response_object(
    response_id: str,
    created: float,
    model: str,
    usage: Usage,
    *,
    done: bool,
    background: bool,
    tier: str | None,
) -> dict[str, Any]:
    """A Response, in progress (no output, no usage yet) or completed."""
    answer: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(created),
        "status": "completed" if done else "in_progress",
        "model": model,
        "output": []
        if not done
        else [
            {
                "type": "message",
                "id": f"msg_{response_id}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": words(usage.output_tokens), "annotations": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "background": background,
        "usage": None
        if not done
        else {
            "input_tokens": usage.total_input_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.cached_input_tokens,
                "cache_write_tokens": usage.cache_write_tokens,
            },
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_input_tokens + usage.output_tokens,
        },
    }
    if tier is not None:
        answer["service_tier"] = tier
    return answer


def anthropic_usage(usage: Usage, tier: str | None) -> dict[str, Any]:
    written = usage.cache_write_tokens + usage.cache_write_1h_tokens
    answer: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_read_input_tokens": usage.cached_input_tokens,
        "cache_creation_input_tokens": written,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.cache_write_tokens,
            "ephemeral_1h_input_tokens": usage.cache_write_1h_tokens,
        },
    }
    if tier is not None:
        answer["service_tier"] = tier
    return answer


def anthropic_message(
    message_id: str, model: str, usage: Usage, max_tokens: int | None, tier: str | None
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": words(usage.output_tokens)}],
        "stop_reason": "max_tokens"
        if max_tokens and usage.output_tokens >= max_tokens
        else "end_turn",
        "stop_sequence": None,
        "usage": anthropic_usage(usage, tier),
    }


def anthropic_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A message as the events of its stream."""
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**message["usage"], "output_tokens": 1},
    }
    return [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
        *(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": w + " "},
                },
            )
            for w in message["content"][0]["text"].split(" ")
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def batch_object(
    batch_id: str, created: float, ready_at: float, results: list[Any]
) -> dict[str, Any]:
    ended = time.time() >= ready_at
    succeeded = sum(1 for r in results if r["result"]["type"] == "succeeded")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {
        "id": batch_id,
        "type": "message_batch",
        "processing_status": "ended" if ended else "in_progress",
        "request_counts": {
            "processing": 0 if ended else len(results),
            "succeeded": succeeded if ended else 0,
            "errored": len(results) - succeeded if ended else 0,
            "canceled": 0,
            "expired": 0,
        },
        "created_at": stamp,
        "expires_at": stamp,
        "ended_at": stamp if ended else None,
        "archived_at": None,
        "cancel_initiated_at": None,
        "results_url": f"/v1/messages/batches/{batch_id}/results" if ended else None,
    }


def embeddings(model: str, inputs: int, tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": [0.0, 0.1, 0.2]}
            for i in range(max(1, inputs))
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


#: A 1x1 transparent PNG, base64: what every generated image is here.
PIXEL_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


def images(n: int, usage: Usage, size: str, quality: str) -> dict[str, Any]:
    return {
        "created": int(time.time()),
        "data": [{"b64_json": PIXEL_PNG} for _ in range(n)],
        "size": size,
        "quality": quality,
        "output_format": "png",
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"text_tokens": usage.input_tokens, "image_tokens": 0},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"image_tokens": usage.output_tokens, "text_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    }


def error(status: int, message: str, anthropic: bool) -> dict[str, Any]:
    if anthropic:
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            429: "rate_limit_error",
            500: "api_error",
            529: "overloaded_error",
        }
        return {
            "type": "error",
            "error": {"type": kinds.get(status, "api_error"), "message": message},
        }
    return {"error": {"message": message, "type": "fake_error", "code": str(status)}}
