"""Attempt keys: an operation's main attempts (``op#n``) and the attempts of its
labelled calls by position (``op:label:seq``, then ``~n``)."""

from __future__ import annotations


def _quote(label: str) -> str:
    # The separators of step keys never appear inside a label: keys stay one-to-one.
    return label.replace("%", "%25").replace(":", "%3A").replace("~", "%7E").replace("#", "%23")


def main_key(operation: str, number: int) -> str:
    """The key of an operation's ``number``-th main-call attempt: ``op#n``."""
    return f"{operation}#{number}"


def step_key(operation: str, label: str, seq: int, number: int = 1) -> str:
    """The key of attempt ``number`` of the ``seq``-th call labelled ``label``:
    ``op:label:seq`` for the first attempt, ``op:label:seq~n`` for later ones. Main keys
    end in ``#n``, first step keys in ``:n``, later ones in ``~n``, and a label never
    holds ``:``, ``~`` or ``#`` (they are %-escaped): no two positions share a key."""
    base = f"{operation}:{_quote(label)}:{seq}"
    return base if number == 1 else f"{base}~{number}"
