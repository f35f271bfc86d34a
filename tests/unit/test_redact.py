"""Credentials out of error text: each shape an HTTP library or an SDK quotes a key in."""

from __future__ import annotations

import logging

import pytest

from budget_tasks._redact import RedactingFilter, redact


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Illegal header value b'Bearer sk-test-SECRET123\\n'",
            "Illegal header value b'[redacted]'",
        ),
        (
            "Illegal header value b'gw-secret-without-prefix\\n'",
            "Illegal header value b'[redacted]'",
        ),
        ("x-api-key: sk-ant-api03-abcdefgh", "x-api-key: [redacted]"),
        ("{'x-api-key': b'sk-ant-xyzxyzxyz'}", "{'x-api-key': b'[redacted]'}"),
        ("api_key=hunter2hunter2 more", "api_key=[redacted] more"),
        ('{"Authorization": "Bearer abc.def.ghi"}', '{"Authorization": "Bearer [redacted]"}'),
        ("authorization: Basic dXNlcjpwYXNz", "authorization: Basic [redacted]"),
        ("a sk-proj-AbC_12-xyz end", "a sk-[redacted] end"),
    ],
)
def test_every_shape_of_a_quoted_credential_is_redacted(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text", ["the key sk- is short", "no secrets here: bearer of news", "attempt op#1: 429"]
)
def test_text_without_a_credential_is_left_as_it_is(text: str) -> None:
    assert redact(text) == text


def test_the_filter_redacts_a_records_message_and_its_whole_traceback() -> None:
    try:
        try:
            raise ValueError("Illegal header value b'Bearer sk-inner-cause-SECRET\\n'")
        except ValueError as inner:
            raise RuntimeError("Connection error.") from inner
    except RuntimeError:
        record = logging.LogRecord(
            "t", logging.ERROR, __file__, 1, "call with %s", ("sk-argument-SECRET",), None
        )
        import sys

        record.exc_info = sys.exc_info()
    assert RedactingFilter().filter(record)
    written = logging.Formatter().format(record)
    assert "SECRET" not in written
    assert "Connection error." in written and "sk-[redacted]" in written


def test_an_error_is_described_on_one_line_without_its_credentials() -> None:
    from budget_tasks.delivery.fates import describe_error

    described = describe_error(ValueError("bad\nINFO forged line\r\nBearer abcdefghijk"))
    assert "\n" not in described and "\r" not in described
    assert described == "ValueError: bad\\nINFO forged line\\r\\nBearer [redacted]"
