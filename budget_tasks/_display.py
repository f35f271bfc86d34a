"""How the operator's tools (the CLI, the dashboard) write a value for a person, and
read an amount a person typed. The API and ``--json`` keep integer micro-USD."""

from __future__ import annotations

import re
from decimal import Decimal

MICROS_PER_DOLLAR = 1_000_000
_DOLLARS = re.compile(
    r"(?P<sign>[+-]?)\s*(?:\$\s*(?P<a>\d[\d,_]*(?:\.\d*)?)|(?P<b>\d[\d,_]*(?:\.\d*)?)\s*usd)",
    re.I,
)


def usd(micros: int | None) -> str:
    """Micro-USD as dollars, exactly (no float on the way): cents always, and the
    digits below a cent only when there are some ($3.00, $0.04125, -$1,250.50)."""
    if micros is None:
        return "-"
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_DOLLAR)
    digits = f"{frac:06d}"
    digits = digits[:2] + digits[2:].rstrip("0")
    return f"{sign}${whole:,}.{digits}"


def amount(text: str, *, signed: bool = False) -> int:
    """An amount a person typed, in micro-USD: dollars with their unit (``50usd``,
    ``$0.25``, ``-1.5usd``) or a whole number of micro-USD (``50000000``). Anything
    else, a fraction of a micro-dollar, or a sign where none is allowed is a
    ValueError that says which forms are taken."""
    text = text.strip()
    found = _DOLLARS.fullmatch(text)
    if found:
        figure = (found.group("a") or found.group("b")).replace(",", "").replace("_", "")
        micros = Decimal(figure) * MICROS_PER_DOLLAR
        if micros != micros.to_integral_value():
            raise ValueError(f"{text!r} is finer than a micro-dollar (at most 6 decimals)")
        value = int(micros) * (-1 if found.group("sign") == "-" else 1)
    elif re.fullmatch(r"[+-]?\d[\d_]*", text):
        value = int(text)
    else:
        raise ValueError(
            f"{text!r} is not an amount: give dollars with their unit (50usd, 0.25usd)"
            " or a whole number of micro-USD (50000000)"
        )
    if value < 0 and not signed:
        raise ValueError(f"{text!r}: the amount cannot be negative")
    return value


def age(seconds: int | None) -> str:
    """A person's reading of a duration: 45s, 12m05s, 3h20m, 2d04h."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def units(value: float) -> str:
    """A count as the CLI and the dashboard show it: thousands separated, fractions (a
    rate window refills in thousandths) to three places and only where there are some."""
    return f"{value:,.3f}".rstrip("0").rstrip(".")
