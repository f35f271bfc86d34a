"""A vendor is one package: its hosts, SDK, credential variables and what it keeps are
its own, and nothing outside it names it (a third vendor brings its own)."""

from __future__ import annotations

import pytest

from budget_tasks import bypass
from budget_tasks.providers import Anthropic, OpenAI, registry
from budget_tasks.providers.registry import UnknownVendor
from budget_tasks.transport import guarded_client


def test_registering_a_vendor_makes_its_hosts_and_base_url_variable_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACME_LLM_BASE_URL", "http://acme-llm.internal:9000/v1")

    class Acme(OpenAI):
        base_url_env = "ACME_LLM_BASE_URL"

    registry.register(Acme("acme", hosts=["api.acme-llm.example"]))
    try:
        assert ("api.acme-llm.example", 443) in bypass._endpoints
        assert ("acme-llm.internal", 9000) in bypass._endpoints
        assert "ACME_LLM_BASE_URL" in bypass._base_url_envs
    finally:
        registry.unregister("acme")


def test_each_vendor_says_what_it_stores_and_a_gateway_speaking_its_api_need_not() -> None:
    openai, anthropic = OpenAI(), Anthropic()
    chat = next(r.endpoint for r in openai.rules if r.endpoint and r.endpoint.name == "openai.chat")
    assert openai.stores_by_default(chat)
    gateway = OpenAI("gateway", hosts=["llm-gateway.internal"])
    gateway_chat = next(
        r.endpoint for r in gateway.rules if r.endpoint and r.endpoint.name == "gateway.chat"
    )
    assert not gateway.stores_by_default(gateway_chat)
    assert OpenAI("gateway", stores_chat=True).stores_by_default(gateway_chat)
    assert not any(anthropic.stores_by_default(r.endpoint) for r in anthropic.rules if r.endpoint)
    body = {"model": "m", "store": True, "metadata": {"mine": "1"}}
    marked = openai.marked_for_lookup(chat, body, "bt1-key", "digest")
    assert marked is not None and marked["metadata"]["mine"] == "1"
    assert set(marked["metadata"].values()) >= {"bt1-key", "digest"}
    assert openai.marked_for_lookup(chat, {"model": "m"}, "bt1-key", "digest") is None


def test_the_credential_variables_are_the_vendors_own() -> None:
    assert (OpenAI.key_env, OpenAI.base_url_env) == ("OPENAI_API_KEY", "OPENAI_BASE_URL")
    assert Anthropic.token_env == "ANTHROPIC_AUTH_TOKEN"
    assert "auth_token" in Anthropic.credential_arguments


def test_a_guarded_client_names_a_registered_vendor() -> None:
    with pytest.raises(UnknownVendor):
        guarded_client("nobody")
    client = guarded_client("openai", api_key="sk-test", base_url="http://127.0.0.1:9/v1")
    assert type(client).__name__ == "GuardedOpenAI" and client.max_retries == 0


@pytest.mark.parametrize(
    "name", ["openai_chat", "openai_response", "anthropic_message", "openai_client"]
)
def test_a_name_that_left_the_providers_package_says_where_to_go(name: str) -> None:
    import budget_tasks.providers as providers

    with pytest.raises(AttributeError, match=r"is gone: .*guarded_.*_client\(\).*self\.spend"):
        getattr(providers, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        providers.nothing_here  # noqa: B018
