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
    with pytest.raises(ValueError, match="image"):
        estimates.openai_chat(
            {
                "model": "gpt-4o-mini",
                "max_tokens": 5,
                "messages": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            }
        )
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
