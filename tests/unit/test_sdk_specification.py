"""The installed official SDKs are the specification: every POST their resources can
send is metered, refused or on a reviewed free list; every usage field of their usage
types is priced or reviewed; every parameter of a metered endpoint has a ruling. A new
SDK that adds a billable endpoint, a usage field or a parameter fails here until a
person has reviewed it in the vendor's module."""

from __future__ import annotations

import ast
import importlib
import re
import typing
from pathlib import Path
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from budget_tasks.providers import Kind, registry
from budget_tasks.providers.anthropic import usage as anthropic_usage
from budget_tasks.providers.anthropic.estimates import REVIEWED_FIELDS as ANTHROPIC_FIELDS
from budget_tasks.providers.openai import usage as openai_usage
from budget_tasks.providers.openai.estimates import REVIEWED_FIELDS as OPENAI_FIELDS


def sdk_posts(package: Any) -> set[tuple[str, str]]:
    """Every path a resource method of ``package`` POSTs to: ``(path template, file)``."""
    root = Path(package.__file__).parent
    found: set[tuple[str, str]] = set()
    for path in sorted((root / "resources").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            kind = node.func.attr
            keywords = {k.arg: k.value for k in node.keywords}
            method = keywords.get("method")
            is_post = kind == "_post" or (
                kind == "_get_api_list"
                and isinstance(method, ast.Constant)
                and method.value == "post"
            )
            if not is_post or not node.args:
                continue
            first = node.args[0]
            if isinstance(first, ast.Call) and first.args:  # path_template("/x/{id}", ...)
                first = first.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                template = first.value
            elif isinstance(first, ast.JoinedStr):
                template = "".join(
                    v.value if isinstance(v, ast.Constant) else "{x}" for v in first.values
                )
            else:
                raise AssertionError(f"{path}: a POST path this test cannot read")
            found.add((template, str(path.relative_to(root))))
    return found


def concrete(template: str) -> str:
    return re.sub(r"\{[^}]*\}", "id_1", template.split("?")[0])


OPENAI_POSTS = sdk_posts(openai)
ANTHROPIC_POSTS = sdk_posts(anthropic)


def test_the_enumeration_sees_the_billable_endpoints_it_must() -> None:
    templates = {t for t, _ in OPENAI_POSTS} | {t for t, _ in ANTHROPIC_POSTS}
    for known in ("/chat/completions", "/responses", "/embeddings", "/v1/messages"):
        assert known in templates
    assert len(OPENAI_POSTS) > 100 and len(ANTHROPIC_POSTS) > 50


@pytest.mark.parametrize(
    ("vendor", "prefix", "posts"),
    [("openai", "/v1", OPENAI_POSTS), ("anthropic", "", ANTHROPIC_POSTS)],
)
def test_every_post_of_the_installed_sdk_is_metered_refused_or_reviewed_free(
    vendor: str, prefix: str, posts: set[tuple[str, str]]
) -> None:
    """None of them falls through to the deny-by-default refusal: each matched a rule a
    person wrote (metered, free with its reason, or refused with its reason)."""
    unreviewed = []
    host = registry.vendor(vendor).hosts[0]
    for template, source in sorted(posts):
        route = registry.route("POST", host, prefix + concrete(template), vendor)
        if route.rule is None:
            unreviewed.append(f"{template} ({source})")
        else:
            assert route.kind in (Kind.METERED, Kind.FREE, Kind.REFUSED)
            assert route.why, template
    assert unreviewed == [], "POSTs no rule reviews: " + ", ".join(unreviewed)


@pytest.mark.parametrize(
    ("vendor", "path", "kind", "endpoint"),
    [
        ("openai", "/v1/chat/completions", Kind.METERED, "openai.chat"),
        ("openai", "/v1/responses", Kind.METERED, "openai.responses"),
        ("openai", "/v1/embeddings", Kind.METERED, "openai.embeddings"),
        ("openai", "/v1/completions", Kind.METERED, "openai.completions"),
        ("openai", "/v1/images/generations", Kind.METERED, "openai.images"),
        ("openai", "/v1/audio/speech", Kind.METERED, "openai.speech"),
        ("openai", "/v1/batches", Kind.REFUSED, None),
        ("openai", "/openai/batches", Kind.REFUSED, None),  # behind a gateway prefix
        ("openai", "/v1/audio/transcriptions", Kind.REFUSED, None),
        ("openai", "/v1/images/edits", Kind.REFUSED, None),
        ("openai", "/v1/moderations", Kind.FREE, None),
        ("openai", "/v1/chat/completions/chatcmpl-1", Kind.FREE, None),
        ("openai", "/v1/something/new", Kind.REFUSED, None),  # deny by default
        ("anthropic", "/v1/messages", Kind.METERED, "anthropic.messages"),
        ("anthropic", "/v1/messages/batches", Kind.METERED, "anthropic.batches"),
        ("anthropic", "/v1/messages/count_tokens", Kind.FREE, None),
        ("anthropic", "/v1/sessions", Kind.REFUSED, None),
    ],
)
def test_routes_by_path(vendor: str, path: str, kind: Kind, endpoint: str | None) -> None:
    route = registry.route("POST", registry.vendor(vendor).hosts[0], path)
    assert route.kind is kind, route
    assert (route.endpoint.name if route.endpoint else None) == endpoint


@pytest.mark.parametrize(
    ("vendor", "path"),
    [
        ("openai", "/api/projects/p/openai/v1/responses"),  # a gateway's project prefix
        (None, "/v1/projects/p/locations/us/endpoints/openapi/chat/completions"),
        (None, "/organization/acme/v1/chat/completions"),  # under a free rule's prefix
        (None, "/v1/vaults/x/v1/messages"),
    ],
)
def test_a_billable_path_under_a_free_rules_prefix_is_still_metered(
    vendor: str | None, path: str
) -> None:
    """A free rule that takes the rest of a path (the admin API's) never lets a billable
    endpoint through: a rule that may bill beats a free one, whatever their lengths."""
    host = registry.vendor(vendor).hosts[0] if vendor else "gateway.example.net"
    assert registry.route("POST", host, path, vendor).kind is Kind.METERED


def test_a_host_no_vendor_claims_is_judged_by_every_vendor_and_denies_by_default() -> None:
    route = registry.route("POST", "llm-gateway.internal", "/openai/v1/chat/completions")
    assert route.kind is Kind.METERED and route.vendor is not None
    assert registry.route("POST", "example.org", "/v1/anything").kind is Kind.REFUSED
    assert registry.route("GET", "example.org", "/v1/anything").kind is Kind.FREE


# -- usage fields -----------------------------------------------------------------------


def leaves(model: type[pydantic.BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every leaf field of a pydantic model, by dotted path, with its annotation."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        nested = [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
        if nested:
            for sub in nested:
                found.update(leaves(sub, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = field.annotation
    return found


USAGE_TYPES = {
    "openai": {
        "CompletionUsage": "openai.types.CompletionUsage",
        "ResponseUsage": "openai.types.responses.ResponseUsage",
        "EmbeddingUsage": "openai.types.create_embedding_response.Usage",
        "ImageUsage": "openai.types.images_response.Usage",
        "SvgUsage": "openai.types.images_response.SvgUsage",
    },
    "anthropic": {
        "Usage": "anthropic.types.Usage",
        "MessageDeltaUsage": "anthropic.types.MessageDeltaUsage",
    },
}


def sdk_type(dotted: str) -> type[pydantic.BaseModel]:
    module, _, name = dotted.rpartition(".")
    found: type[pydantic.BaseModel] = getattr(importlib.import_module(module), name)
    return found


def sdk_usage_fields(vendor: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for label, dotted in USAGE_TYPES[vendor].items():
        fields.update({f"{label}.{k}": v for k, v in leaves(sdk_type(dotted)).items()})
    return fields


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_every_usage_field_of_the_sdk_is_priced_or_reviewed(vendor: str) -> None:
    reviewed = registry.vendor(vendor).usage_fields
    fields = sdk_usage_fields(vendor)
    assert sorted(set(fields) - set(reviewed)) == [], "usage fields nobody reviewed"
    assert sorted(set(reviewed) - set(fields)) == [], "reviewed fields the SDK no longer has"
    for name, ruling in reviewed.items():
        assert ruling.startswith(("priced: ", "reviewed: ")), name


def _nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


#: How each SDK type's usage reaches a reader, and the totals its parts sit in.
READERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "CompletionUsage": (
        lambda u: openai_usage.chat({"usage": u, "model": "m"}, {}),
        {"prompt_tokens": 1000, "completion_tokens": 1000},
    ),
    "ResponseUsage": (
        lambda u: openai_usage.response({"usage": u, "model": "m"}, {}),
        {"input_tokens": 1000, "output_tokens": 1000},
    ),
    "EmbeddingUsage": (lambda u: openai_usage.embeddings({"usage": u}, {"model": "m"}), {}),
    "ImageUsage": (
        lambda u: openai_usage.images({"usage": u}, {"model": "m"}),
        {"input_tokens": 1000, "output_tokens": 1000},
    ),
    "SvgUsage": (
        lambda u: openai_usage.images(
            {"usage": {"input_tokens": 1, "output_tokens": 1}, "svg_usage": u}, {"model": "m"}
        ),
        {"model": "svg-author", "input_tokens": 1000, "output_tokens": 1000},
    ),
    "Usage": (
        lambda u: anthropic_usage.message({"usage": u, "model": "m"}, {}),
        {"input_tokens": 10, "output_tokens": 1000, "cache_creation_input_tokens": 1000},
    ),
    "MessageDeltaUsage": (
        lambda u: anthropic_usage.message_stream(
            [
                {
                    "type": "message_start",
                    "message": {"id": "m", "model": "m", "usage": {"input_tokens": 10}},
                },
                {"type": "message_delta", "usage": u},
            ],
            {},
        ),
        {"output_tokens": 1000, "cache_creation_input_tokens": 1000},
    ),
}
#: What a priced string field is set to, to see it read.
PRICED_TEXT = {"service_tier": "batch", "speed": "fast", "model": "svg-author-2"}


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_every_field_said_to_be_priced_is_read(vendor: str) -> None:
    """A field the review calls priced changes what the reader reports: a review that
    says "priced" of a field the reader ignores fails here."""
    types = sdk_usage_fields(vendor)
    for name, ruling in registry.vendor(vendor).usage_fields.items():
        if not ruling.startswith("priced: "):
            continue
        label, _, path = name.partition(".")
        read, totals = READERS[label]
        leaf = path.rsplit(".", 1)[-1]
        value = PRICED_TEXT.get(leaf, 7) if types[name] is not int else 7
        if leaf in ("input_tokens", "prompt_tokens", "output_tokens", "completion_tokens"):
            value = 1001 if totals.get(leaf) else 7
        base = read(totals)
        changed = read(_merge(totals, _nested(path, value)))
        assert changed != base, f"{name} is said to be priced but reading it changes nothing"


# -- request parameters -------------------------------------------------------------------

CREATE_PARAMS = [
    ("chat", "openai.types.chat.completion_create_params.CompletionCreateParamsBase"),
    ("responses", "openai.types.responses.response_create_params.ResponseCreateParamsBase"),
    ("embeddings", "openai.types.embedding_create_params.EmbeddingCreateParams"),
    ("completions", "openai.types.completion_create_params.CompletionCreateParamsBase"),
    ("images", "openai.types.image_generate_params.ImageGenerateParamsBase"),
    ("speech", "openai.types.audio.speech_create_params.SpeechCreateParams"),
    ("messages", "anthropic.types.message_create_params.MessageCreateParamsBase"),
]


@pytest.mark.parametrize(("endpoint", "dotted"), CREATE_PARAMS)
def test_every_parameter_of_a_metered_endpoint_has_a_ruling(endpoint: str, dotted: str) -> None:
    """Billing nothing, counted as input, or refused: a parameter the estimator has not
    been told about would be refused at run time (deny by default), and fails here
    first, so a person decides."""
    module, _, name = dotted.rpartition(".")
    params = set(getattr(importlib.import_module(module), name).__annotations__)
    reviewed = {**OPENAI_FIELDS, **ANTHROPIC_FIELDS}[endpoint]
    assert params, dotted
    assert sorted(params - reviewed) == [], f"{endpoint}: parameters with no ruling"
