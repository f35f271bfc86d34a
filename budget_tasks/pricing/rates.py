"""One model's rates in integer minor units, and the upper bound of a request from them.

Estimates are upper bounds, so that a reservation is never below the real charge:
input tokens are bounded by the UTF-8 byte length of the prompt plus a per-message
overhead (no tokenizer emits more tokens than bytes), output tokens by the request's
max output limit, every input token priced at the dearest input rate the request could
be billed at (cache writes, 1-hour cache writes and image input included where the
request may make them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .. import _validate as check
from ..errors import EstimateRefused
from .usage import STANDARD, Estimate, PriceContext

PER_MILLION = 1_000_000
#: Tokens a chat format may add per message (role, separators) and per request.
MESSAGE_OVERHEAD_TOKENS = 8
REQUEST_OVERHEAD_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Rates:
    """Minor units per million units (tokens, characters), rounded up; ``web_search``
    per search. None where the model has no rate of its own for that unit (the plain
    input or output rate applies)."""

    input: int
    output: int
    cached_input: int | None = None
    cache_write: int | None = None
    cache_write_1h: int | None = None
    input_audio: int | None = None
    input_image: int | None = None
    output_audio: int | None = None
    output_image: int | None = None
    web_search: int | None = None
    input_character: int | None = None

    def dearest_input(self, *, cache: str | None = "5m", images: bool = False) -> int:
        """The most one input token may cost: plain, a cache write (``cache``: None when
        the request makes none, "5m", or "1h" when it asks for the 1-hour cache) and,
        with ``images``, an image token."""
        candidates = [self.input, self.cached_input or 0]
        if cache is not None:
            candidates.append(self.cache_write if self.cache_write is not None else self.input)
        if cache == "1h":
            candidates.append(self.cache_write_1h or 0)
        if images:
            candidates.append(self.input_image or 0)
        return max(candidates)

    def dearest_output(self) -> int:
        return max(self.output, self.output_audio or 0, self.output_image or 0)


def bound(
    rates: Rates,
    model: str,
    version: str,
    prompt: Iterable[str],
    max_output_tokens: int | None,
    *,
    choices: int = 1,
    extra_input_tokens: int = 0,
    extra_output_tokens: int = 0,
    cache: str | None = "5m",
    images: bool = False,
) -> Estimate:
    """An upper bound for a request whose billed input texts are ``prompt``.

    Output is ``max_output_tokens`` per choice, times ``choices`` (OpenAI's ``n``), plus
    ``extra_output_tokens``; ``extra_input_tokens`` are input the texts do not show
    (per-image bounds, the format around tools). Refused (EstimateRefused) without a max
    output limit: an unbounded output has no upper bound.
    """
    if max_output_tokens is None:
        raise EstimateRefused(
            f"a request to {model} without a max output token limit has no upper bound; "
            "set max_tokens / max_output_tokens or give an explicit estimate"
        )
    check.count(max_output_tokens, "max_output_tokens")
    check.positive(choices, "choices")
    check.count(extra_input_tokens, "extra_input_tokens")
    check.count(extra_output_tokens, "extra_output_tokens")
    if max_output_tokens == 0:
        raise EstimateRefused("max_output_tokens must be positive")
    input_tokens = input_bound(prompt, extra_input_tokens)
    output_tokens = max_output_tokens * choices + extra_output_tokens
    total = (
        input_tokens * rates.dearest_input(cache=cache, images=images)
        + output_tokens * rates.dearest_output()
    )
    return Estimate(
        amount=-(-total // PER_MILLION),
        model=model,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        price_version=version,
    )


def input_bound(prompt: Iterable[str], extra_input_tokens: int = 0) -> int:
    """The most input tokens ``prompt`` may be billed as (bytes, plus the overheads)."""
    texts = list(prompt)
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"prompt texts must be str, not {type(text).__name__} ({text!r})")
    return (
        REQUEST_OVERHEAD_TOKENS
        + extra_input_tokens
        + sum(len(text.encode("utf-8")) + MESSAGE_OVERHEAD_TOKENS for text in texts)
    )


class Estimating:
    """The one way every price source bounds a request, from its ``rates`` (in the
    long-context tier the request's input bound falls in) and its ``version``."""

    version: str

    def rates(
        self,
        model: str,
        *,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        input_tokens: int = 0,
    ) -> Rates:
        raise NotImplementedError

    def estimate(
        self,
        model: str,
        prompt: Iterable[str],
        max_output_tokens: int | None,
        *,
        choices: int = 1,
        extra_input_tokens: int = 0,
        extra_output_tokens: int = 0,
        provider: str | None = None,
        context: PriceContext = STANDARD,
        cache: str | None = "5m",
        images: bool = False,
    ) -> Estimate:
        """An upper bound for a request whose billed texts are ``prompt`` (see
        :func:`bound`). Unknown models raise UnknownModelPrice."""
        texts = list(prompt)
        tokens = input_bound(texts, extra_input_tokens)
        rates = self.rates(model, provider=provider, context=context, input_tokens=tokens)
        return bound(
            rates,
            model,
            self.version,
            texts,
            max_output_tokens,
            choices=choices,
            extra_input_tokens=extra_input_tokens,
            extra_output_tokens=extra_output_tokens,
            cache=cache,
            images=images,
        )
