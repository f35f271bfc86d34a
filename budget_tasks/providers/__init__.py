"""The providers: one package per vendor behind one small interface
(:class:`~budget_tasks.providers.base.Vendor`: which requests bill, the estimate, the
usage and its price, the error classes, the lookup) and a registry the transport, beat
and the CLI use.

A call is metered through a guarded client (:mod:`budget_tasks.transport`) or, for
anything else, inside ``self.spend()``. This package never imports the ledger: the
task layer wires the two together.
"""

from typing import Any as _Any

from .anthropic import Anthropic
from .base import Kind, LookupFacts, Reported, Vendor
from .lookups import Found, Lookup, NotFound, Pending, Unknowable
from .openai import OpenAI
from .outcomes import ErrorOutcome, classify
from .registry import UnknownVendor, register, registry

#: Names that left this package, and where their work is done now.
_GONE = {
    "openai_chat": "call the SDK through budget_tasks.transport.guarded_openai_client()",
    "openai_response": "call the SDK through budget_tasks.transport.guarded_openai_client()",
    "anthropic_message": ("call the SDK through budget_tasks.transport.guarded_anthropic_client()"),
    "openai_client": "use budget_tasks.transport.guarded_openai_client()",
    "anthropic_client": "use budget_tasks.transport.guarded_anthropic_client()",
}


def __getattr__(name: str) -> _Any:
    if name in _GONE:
        raise AttributeError(
            f"budget_tasks.providers.{name} is gone: {_GONE[name]}; meter any other "
            "call inside `with self.spend(amount, label) as call:`"
        )
    raise AttributeError(f"module 'budget_tasks.providers' has no attribute {name!r}")


__all__ = [
    "Anthropic",
    "ErrorOutcome",
    "Found",
    "Kind",
    "Lookup",
    "LookupFacts",
    "NotFound",
    "OpenAI",
    "Pending",
    "Reported",
    "Unknowable",
    "UnknownVendor",
    "Vendor",
    "classify",
    "register",
    "registry",
]
