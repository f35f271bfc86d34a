"""Whether a provider's answer may be charged as it reports itself.

The provider, or a gateway in front of it, is outside the ledger's trust: an answer that
claims more tokens than its request allowed, or a cost past the ledger's money ceiling,
is never charged as it is. Its hold stays ``unknown`` for an operator, and an alert is
raised. The bound is what the request itself allowed, as its estimate counted it: input
at most the request's bytes plus the overheads a provider documents (message format,
tool prompts, per-image bounds; cache reads and writes are input), output at most the
requested maximum times ``n`` plus what the provider documents on top (rejected
predicted tokens; reasoning and thinking are inside the maximum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._validate import MAX_MONEY

if TYPE_CHECKING:  # the ledger reads bounds without loading the price tables
    from .pricing import Estimate, Usage


@dataclass(frozen=True, slots=True)
class Bound:
    """The most tokens a request allowed: ``input_tokens`` however billed (plain,
    cache reads and writes) and ``output_tokens`` (reasoning included). A bound whose
    input is 0 counts no tokens (a speech request is priced per character): only the
    money ceiling vets it. Every estimate that counts tokens counts input (the
    request's own overhead at least), and its output bound holds even when it is 0
    (an embeddings request allows none)."""

    input_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def of(cls, estimate: Estimate | None) -> Bound | None:
        """The bound an estimate counted, or None where it counted no tokens at all."""
        if estimate is None or not (estimate.input_tokens or estimate.output_tokens):
            return None
        return cls(estimate.input_tokens, estimate.output_tokens)


def untrusted_note(why: str) -> str:
    """The note an attempt keeps when its answer was doubted (by its run or by beat)."""
    return f"untrusted usage: {why}"


def doubt(usage: Usage | None, cost: int | None, bound: Bound | None) -> str | None:
    """Why an answer's usage (priced at ``cost``) cannot be charged as it is, or None.

    A cost past the ledger's money ceiling is always doubted. Token counts are vetted
    where the request's bound is known (``bound``; None: only the ceiling)."""
    if cost is not None and (cost < 0 or cost > MAX_MONEY):
        return f"its cost {cost} is outside what the ledger can charge (0..{MAX_MONEY})"
    if usage is None or bound is None or not bound.input_tokens:
        return None
    if usage.total_input_tokens > bound.input_tokens:
        return (
            f"it reports {usage.total_input_tokens} input tokens where the request "
            f"allowed at most {bound.input_tokens}"
        )
    if usage.output_tokens > bound.output_tokens:
        return (
            f"it reports {usage.output_tokens} output tokens where the request "
            f"allowed at most {bound.output_tokens}"
        )
    return None
