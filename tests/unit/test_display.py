"""Money as people type and read it: dollars with their unit, or whole micro-USD."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budget_tasks._display import amount, usd
from budget_tasks._validate import MAX_MONEY


@pytest.mark.parametrize(
    ("micros", "shown"),
    [
        (0, "$0.00"),
        (1, "$0.000001"),
        (9_999, "$0.009999"),
        (10_000, "$0.01"),
        (41_250, "$0.04125"),
        (3_000_000, "$3.00"),
        (1_234_500_000, "$1,234.50"),
        (-1_250_000, "-$1.25"),
        (None, "-"),
    ],
)
def test_usd_shows_cents_always_and_finer_digits_only_when_there_are_some(
    micros: int | None, shown: str
) -> None:
    assert usd(micros) == shown


@pytest.mark.parametrize(
    ("typed", "micros"),
    [
        ("50usd", 50_000_000),
        ("50 USD", 50_000_000),
        ("$50", 50_000_000),
        ("0.000001usd", 1),
        ("$1,234.50", 1_234_500_000),
        ("12.345678usd", 12_345_678),
        ("50000000", 50_000_000),
        ("0", 0),
        (" 7 ", 7),
    ],
)
def test_amount_reads_dollars_with_their_unit_or_whole_micro_usd(typed: str, micros: int) -> None:
    assert amount(typed) == micros


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("0.0000001usd", "finer than a micro-dollar"),
        ("50.5", "is not an amount"),  # dollars without their unit: not guessed
        ("$", "is not an amount"),
        ("usd", "is not an amount"),
        ("1e6", "is not an amount"),
        ("", "is not an amount"),
        ("-5", "cannot be negative"),
        ("-0.01usd", "cannot be negative"),
    ],
)
def test_amount_refuses_what_it_would_have_to_guess(typed: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        amount(typed)


def test_a_signed_amount_takes_a_minus() -> None:
    assert amount("-0.00125usd", signed=True) == -1_250
    assert amount("-$1.25", signed=True) == -1_250_000
    assert amount("-1250", signed=True) == -1_250


@given(st.integers(min_value=-MAX_MONEY, max_value=MAX_MONEY))
def test_what_usd_shows_reads_back_as_the_same_amount(micros: int) -> None:
    assert amount(usd(micros), signed=True) == micros
