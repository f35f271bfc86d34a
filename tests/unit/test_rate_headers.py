"""What a provider's rate-limit headers say, read as each vendor writes them: the
limit, what remains and when it is full again, and how long a 429 says to wait. A
value that cannot be read is left out, never read as 0 or as no limit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from budget_tasks.providers import Anthropic, OpenAI
from budget_tasks.providers.rate_headers import (
    MOST_WAIT,
    Window,
    go_duration,
    retry_after,
    until,
)

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("0s", 0.0),
        ("12ms", 0.012),
        ("1.5s", 1.5),
        ("6m0s", 360.0),
        ("1h2m3.25s", 3723.25),
        ("250us", 0.00025),
    ],
)
def test_openais_go_durations_are_read(text: str, seconds: float) -> None:
    assert go_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "text", ["", "soon", "-1s", "1s garbage", "s", "1.5", "25h", "99999999999999h", "1e400s"]
)
def test_a_duration_that_cannot_be_read_or_believed_is_left_out(text: str) -> None:
    assert go_duration(text) is None


def test_a_reset_time_is_the_wait_from_now_and_a_past_one_is_no_wait() -> None:
    assert until("2026-12-06T12:00:30Z", NOW) == timedelta(seconds=30)
    assert until("2026-12-06T11:59:00Z", NOW) == timedelta(0)
    assert until("2026-12-06T12:00:30", NOW) is None  # no zone: not a time we can place
    assert until("tomorrow", NOW) is None
    assert until((NOW + MOST_WAIT + timedelta(seconds=1)).isoformat(), NOW) is None


def test_retry_after_is_read_as_the_sdks_read_it() -> None:
    assert retry_after({"retry-after": "3"}, NOW) == timedelta(seconds=3)
    assert retry_after({"retry-after": "0.5"}, NOW) == timedelta(seconds=0.5)
    # milliseconds first, as OpenAI's SDK prefers them
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}, NOW) == timedelta(
        seconds=1.5
    )
    assert retry_after({"retry-after": "Sun, 06 Dec 2026 12:00:10 GMT"}, NOW) == timedelta(
        seconds=10
    )
    for bad in ("-1", "nan", "inf", "later", "999999999", "1e20"):
        assert retry_after({"retry-after": bad}, NOW) is None, bad
    assert retry_after({"retry-after-ms": "1e300"}, NOW) is None
    assert retry_after({}, NOW) is None


def test_openais_headers_give_its_requests_and_tokens_windows() -> None:
    state = OpenAI().rate_state(
        {
            "X-RateLimit-Limit-Requests": "600",
            "x-ratelimit-remaining-requests": "599",
            "x-ratelimit-reset-requests": "100ms",
            "x-ratelimit-limit-tokens": "60000",
            "x-ratelimit-remaining-tokens": "not a number",
            "x-ratelimit-reset-tokens": "6m0s",
            "retry-after": "2",
        },
        NOW,
    )
    assert state.windows == {
        "requests": Window(600, 599, timedelta(milliseconds=100)),
        # the unreadable count is left out; what could be read stands
        "tokens": Window(60000, None, timedelta(minutes=6)),
    }
    assert state.retry_after == timedelta(seconds=2)


def test_anthropics_headers_give_each_of_its_four_windows() -> None:
    headers = {
        f"anthropic-ratelimit-{name}-{part}": value
        for name, limit in (
            ("requests", 50),
            ("tokens", 90000),
            ("input-tokens", 40000),
            ("output-tokens", 8000),
        )
        for part, value in (
            ("limit", str(limit)),
            ("remaining", str(limit - 1)),
            ("reset", "2026-12-06T12:00:01Z"),
        )
    }
    state = Anthropic().rate_state(headers, NOW)
    assert state.windows == {
        "requests": Window(50, 49, timedelta(seconds=1)),
        "tokens": Window(90000, 89999, timedelta(seconds=1)),
        "input_tokens": Window(40000, 39999, timedelta(seconds=1)),
        "output_tokens": Window(8000, 7999, timedelta(seconds=1)),
    }
    assert state.retry_after is None


def test_a_count_is_ascii_digits_only() -> None:
    state = OpenAI().rate_state({"x-ratelimit-limit-requests": "²"}, NOW)
    assert state.empty
    assert OpenAI().rate_state({"x-ratelimit-limit-requests": "9" * 40}, NOW).empty


def test_an_answer_without_rate_headers_says_nothing() -> None:
    assert OpenAI().rate_state({"content-type": "application/json"}, NOW).empty
    # another vendor's headers are not this one's
    assert Anthropic().rate_state({"x-ratelimit-limit-requests": "5"}, NOW).empty
