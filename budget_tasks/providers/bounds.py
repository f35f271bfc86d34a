"""What every vendor's estimator shares: walking a request for the text it bills and the
media it carries, and refusing what cannot be bounded.

Every input the provider bills is counted (its UTF-8 bytes bound its tokens: no
tokenizer emits more tokens than bytes): message texts, system prompts, tool and
function definitions, schemas, tool calls and results carried in the conversation, and
any item a request carries whose content is not media, as its JSON text. Media (images,
screenshots, documents, audio) is billed by its size, not its bytes here: it needs a
per-item bound from the caller (``image_tokens``), wherever it sits, tool results
included; a reference to content the request does not carry (a stored item, a file
id, an earlier response) is refused. So is any field an estimator does not know: a
new API parameter may bill.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import EstimateRefused

#: Tokens a provider may add when tools are given: the tool-use system prompt it
#: inserts (Anthropic documents up to a few hundred) and the format around each tool.
TOOLS_OVERHEAD_TOKENS = 1_000

#: Content types that are text, and where their text is.
TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "summary_text"})
#: Images: billed by their size, bounded by the caller's ``image_tokens``.
MEDIA_TYPES = frozenset({"image_url", "input_image", "image", "computer_screenshot"})
#: Media billed by pages or seconds, which nothing in the request bounds.
UNBOUNDED_MEDIA = {
    "input_audio": "audio is billed by its length",
    "audio": "audio is billed by its length",
    "input_file": "a file is billed by its pages",
    "file": "a file is billed by its pages",
    "document": "a document is billed by its pages",
    "input_video": "video is billed by its length",
    "video": "video is billed by its length",
}
#: Item types that point at content the request does not carry.
REFERENCE_TYPES = frozenset({"item_reference", "container_reference", "search_result_reference"})


def refuse(field: str, why: str) -> EstimateRefused:
    return EstimateRefused(
        f"cannot bound the cost of field {field!r}: {why}; drop it or give an explicit estimate"
    )


def check_fields(
    params: Mapping[str, Any],
    plain: frozenset[str],
    counted: frozenset[str],
    refused: Mapping[str, str],
) -> None:
    """Refuse a field that may bill unseen (``refused``, when set) or that the estimator
    does not know at all."""
    for name, value in params.items():
        if name in refused:
            if value is not None:  # even empty: web_search_options={} turns search on
                raise refuse(name, refused[name])
            continue
        if name not in plain and name not in counted:
            raise refuse(name, "the estimator does not know what it bills")


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


class Parts:
    """The texts a request bills and the media items in it."""

    def __init__(self, image_tokens: int | None) -> None:
        self.texts: list[str] = []
        self.media = 0
        self.image_tokens = image_tokens
        self.overhead = 0

    @property
    def extra_tokens(self) -> int:
        """Input the texts do not show: each media item's bound, the tools' format."""
        return self.media * (self.image_tokens or 0) + self.overhead

    def add(self, text: str) -> None:
        self.texts.append(text)

    def definitions(self, text: str) -> None:
        """Tool definitions, schemas and choices, billed as input with the format a
        provider wraps them in (``TOOLS_OVERHEAD_TOKENS``)."""
        if text:
            self.texts.append(text)
            self.overhead += TOOLS_OVERHEAD_TOKENS

    def content(self, content: Any, field: str) -> str:
        """The text of a message's content (a string or a list of parts); media parts
        are counted apart, anywhere they sit (a tool result's own content too)."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, Mapping):
            return self.part(content, field)
        if isinstance(content, Iterable) and not isinstance(content, bytes | bytearray):
            return "".join(
                self.part(part, field) if isinstance(part, Mapping) else str(part)
                for part in content
            )
        return str(content)

    def part(self, part: Mapping[str, Any], field: str) -> str:
        """The billed text of one content part or item, media counted apart."""
        kind = part.get("type", "text")
        if kind in REFERENCE_TYPES:
            raise refuse(f"{field}[].{kind}", "it refers to content the request does not carry")
        if kind in MEDIA_TYPES:
            self._media(part, f"{field}[].{kind}")
            return ""
        if kind in UNBOUNDED_MEDIA:
            return self._unbounded(part, f"{field}[].{kind}")
        if kind in TEXT_TYPES and isinstance(part.get("text", part.get("refusal")), str):
            others = {k: v for k, v in part.items() if k not in ("type", "text", "refusal")}
            text = str(part.get("text", part.get("refusal", "")))
            return text + (self._nested(others, field) if others else "")
        # Any other item (a tool call, a tool result, a reasoning item, a computer call):
        # its JSON text bounds its tokens, its nested content walked for media.
        return self._nested(part, field)

    def _nested(self, value: Any, field: str) -> str:
        """The JSON text of ``value`` with every media item (at any depth) taken out and
        counted apart."""
        return json_text(self._strip(value, field))

    def _strip(self, value: Any, field: str) -> Any:
        if isinstance(value, Mapping):
            kind = value.get("type")
            if kind in REFERENCE_TYPES:
                raise refuse(f"{field}[].{kind}", "it refers to content the request does not carry")
            if kind in MEDIA_TYPES:
                self._media(value, f"{field}[].{kind}")
                return None
            if kind in UNBOUNDED_MEDIA:
                return self._unbounded(value, f"{field}[].{kind}")
            if "file_id" in value and value.get("file_id"):
                raise refuse(f"{field}[].file_id", "a stored file's content is billed, unseen here")
            return {k: self._strip(v, field) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._strip(v, field) for v in value]
        return value

    def _unbounded(self, part: Mapping[str, Any], field: str) -> str:
        """A document whose source is plain text is its text; any other audio, video,
        file or document is refused: billed by its pages or seconds, unseen here."""
        source = part.get("source")
        if part.get("type") == "document" and isinstance(source, Mapping):
            if source.get("type") == "text" and isinstance(source.get("data"), str):
                return str(source["data"]) + json_text(
                    {k: v for k, v in part.items() if k != "source"}
                )
            if source.get("type") == "content":
                return self.content(source.get("content"), field)
        raise refuse(field, UNBOUNDED_MEDIA[str(part.get("type"))])

    def _media(self, part: Mapping[str, Any], field: str) -> None:
        if self.image_tokens is None:
            raise refuse(
                field,
                "an image or other media is billed by its size; pass image_tokens= (the most "
                "tokens one item may cost on this model)",
            )
        self.media += 1

    def messages(self, messages: Iterable[Any], field: str = "messages") -> None:
        """Chat messages, Anthropic messages or Responses input items."""
        for message in messages:
            if not isinstance(message, Mapping):
                self.texts.append(str(message))
                continue
            if message.get("audio"):
                raise refuse(f"{field}[].audio", "an earlier answer's audio is billed, unseen here")
            kind = message.get("type", "message")
            if kind != "message" or "content" not in message:
                # a Responses item that is not a message: bounded as a whole
                self.texts.append(self.part(message, field))
                continue
            text = self.content(message.get("content"), field)
            extras = {
                k: message[k]
                for k in ("tool_calls", "function_call", "name", "tool_call_id")
                if message.get(k)
            }
            if extras:
                text += self._nested(extras, field)
            self.texts.append(text)


def function_tools(tools: Any, field: str, custom: tuple[str, ...]) -> str:
    """Tool definitions as the text they are billed as; built-in tools (billed per use
    or by what they fetch) are refused."""
    if not tools:
        return ""
    for tool in tools:
        kind = tool.get("type", "custom") if isinstance(tool, Mapping) else None
        if kind not in custom:
            raise refuse(f"{field}[].type={kind!r}", "a built-in tool bills per use")
    return json_text(tools)


def fields_text(params: Mapping[str, Any], names: Iterable[str]) -> str:
    """The JSON text of the fields of ``names`` that ``params`` sets."""
    return "".join(json_text(params[n]) for n in names if params.get(n) is not None)


def model_of(params: Mapping[str, Any]) -> str:
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise EstimateRefused("the request names no model: nothing to price it by")
    return model


def choices(params: Mapping[str, Any], name: str = "n") -> int:
    n = params.get(name)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EstimateRefused(f"{name} must be a positive int, not {n!r}")
    return n


def has_key(value: Any, key: str) -> bool:
    """Whether ``key`` appears anywhere in a JSON value (a cache_control marker)."""
    if isinstance(value, Mapping):
        return key in value or any(has_key(v, key) for v in value.values())
    if isinstance(value, list | tuple):
        return any(has_key(v, key) for v in value)
    return False


def find_values(value: Any, key: str) -> list[Any]:
    """Every value of ``key`` anywhere in a JSON value."""
    found: list[Any] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            if k == key:
                found.append(v)
            found.extend(find_values(v, key))
    elif isinstance(value, list | tuple):
        for v in value:
            found.extend(find_values(v, key))
    return found
