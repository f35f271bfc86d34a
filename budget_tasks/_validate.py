"""Input checks for money and identifiers, shared by every public entry point."""

from __future__ import annotations

import getpass
import os
import socket
from datetime import datetime, timedelta
from typing import Any

#: The largest amount accepted in one call, in minor units (10**15 micro-USD is $1e9).
MAX_MONEY = 10**15
MAX_KEY_LENGTH = 255
#: An operation's attempts are keyed ``key#n`` (and its steps ``key:label:n~k``), each
#: within MAX_KEY_LENGTH: an idempotency key leaves room for the suffixes.
MAX_OPERATION_KEY_LENGTH = 200
#: ``~n`` of a step's later attempts, with room for any count of them.
STEP_SUFFIX_ROOM = 21
MAX_NAME_LENGTH = 200
#: Row ids are BIGINT.
MAX_ID = 2**63 - 1


def money(value: Any, name: str = "amount", *, signed: bool = False) -> int:
    """Return ``value`` if it is an int of minor units within range, else raise.

    bool, float and Decimal are refused with TypeError: money is never fractional here.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int of minor units, not {type(value).__name__} ({value!r})"
        )
    if not signed and value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    if abs(value) > MAX_MONEY:
        raise ValueError(f"{name} {value} is out of range (|{name}| <= {MAX_MONEY})")
    return value


def count(value: Any, name: str) -> int:
    """Return ``value`` if it is a non-negative int (a token count), else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return value


def text(value: Any, name: str, *, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``value`` if it is non-empty, bounded text without NUL that encodes as
    UTF-8, else raise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__} ({value!r})")
    if not value.strip():
        raise ValueError(f"{name} must not be empty")
    if len(value) > max_length:
        raise ValueError(f"{name} is {len(value)} characters long (at most {max_length})")
    if "\x00" in value:
        raise ValueError(f"{name} must not contain NUL characters")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} is not valid Unicode (a lone surrogate)") from None
    return value


def key(value: Any, name: str, *, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``value`` if it is text (see :func:`text`) of printable ASCII only, else
    raise: a key or a label reaches HTTP headers and log lines, where a line break or a
    byte outside ASCII fails after money was held, or forges a line (hash such a key
    first, e.g. ``hashlib.sha256(key.encode()).hexdigest()``)."""
    checked = text(value, name, max_length=max_length)
    bad = next((c for c in checked if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"{name} must be printable ASCII; it holds {bad!r} at {checked.index(bad)} "
            "(hash a key that is not)"
        )
    return checked


def printable(value: Any, name: str, *, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``value`` if it is text (see :func:`text`) without control characters
    (line breaks, escapes), else raise: a name is printed to operators' terminals."""
    checked = text(value, name, max_length=max_length)
    if not checked.isprintable():
        bad = next(c for c in checked if not c.isprintable())
        raise ValueError(f"{name} must be printable; it holds {bad!r} at {checked.index(bad)}")
    return checked


def actor(value: Any) -> str:
    """Who did an operator's action: ``value``, or the OS user and host."""
    if value is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (a container's)
            user = f"uid {os.getuid()}"
        value = f"{user}@{socket.gethostname()}"
    return printable(value, "actor", max_length=100)


def optional_text(value: Any, name: str, *, max_length: int = MAX_KEY_LENGTH) -> str | None:
    return None if value is None else text(value, name, max_length=max_length)


def moment(value: Any, name: str) -> datetime:
    """Return ``value`` if it is a timezone-aware datetime, else raise (a naive one
    would be read in the machine's local time zone)."""
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, not {type(value).__name__} ({value!r})")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {value!r}")
    return value


def row_id(value: Any, name: str) -> int:
    """Return ``value`` if it is a positive int that fits a BIGINT row id, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if not 0 < value <= MAX_ID:
        raise ValueError(f"{name} {value} is not a row id")
    return value


def duration(value: Any, name: str, *, allow_zero: bool = False) -> timedelta:
    """Return ``value`` if it is a positive timedelta (or zero, with ``allow_zero``)."""
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a timedelta, not {type(value).__name__} ({value!r})")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        raise ValueError(f"{name} must be {'' if allow_zero else 'more than '}0, got {value}")
    return value


def positive(value: Any, name: str) -> int:
    """Return ``value`` if it is an int of at least 1 (a limit, a number of runs)."""
    if count(value, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)
