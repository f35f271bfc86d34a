from decimal import Decimal
from fractions import Fraction

import pytest

from budget_tasks import _validate as check


@pytest.mark.parametrize("value", [1.0, 0.5, Decimal("1"), Fraction(1, 2), "10", None, True, False])
def test_money_refuses_non_int(value: object) -> None:
    with pytest.raises(TypeError, match="int of minor units"):
        check.money(value)


@pytest.mark.parametrize("value", [-1, check.MAX_MONEY + 1, -(check.MAX_MONEY + 1)])
def test_money_refuses_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match="amount"):
        check.money(value)


def test_money_signed_allows_negative_within_range() -> None:
    assert check.money(-5, signed=True) == -5
    assert check.money(check.MAX_MONEY) == check.MAX_MONEY
    with pytest.raises(ValueError, match="out of range"):
        check.money(-check.MAX_MONEY - 1, signed=True)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("", ValueError),
        ("   ", ValueError),
        ("x" * 256, ValueError),
        ("a\x00b", ValueError),
        (None, TypeError),
        (b"key", TypeError),
        (12, TypeError),
    ],
)
def test_text_refuses_bad_keys(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="key"):
        check.text(value, "key")


def test_text_accepts_bounded_key() -> None:
    assert check.text("summarize:call-58142", "key") == "summarize:call-58142"
    assert check.text("x" * 255, "key") == "x" * 255
