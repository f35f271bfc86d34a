"""The fake provider's own rate limits (:mod:`budget_tasks.testing.fake_limits`), driven
through the official SDKs over HTTP: requests and tokens counted as each vendor counts
them, a request that does not fit answered 429 in the vendor's shape and not billed,
the vendors' rate-limit headers read from buckets that refill continuously, and exact
under many processes at once.

Tests at a boundary run on a fake of their own whose limiter clock stands still (no
refill between two requests); the others run on the real clock."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import anthropic
import openai
import pytest

from budget_tasks.pricing import default_prices
from budget_tasks.testing import FakeProvider
from budget_tasks.testing.fake_limits import Limiter, LimitSpec, parse_limits

CHAT: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "hello"}],
}
HAIKU = "claude-haiku-4-5"
#: Go's duration format, as OpenAI writes ``x-ratelimit-reset-*``: 12ms, 1.5s, 6m0s
GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$|^(\d+)ms$")


class Frozen:
    """A monotonic clock that moves only when told: nothing refills between requests."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def frozen() -> Iterator[FakeProvider]:
    """A fake of the test's own whose rate limits run on a clock that stands still."""
    with FakeProvider() as own:
        own.limits = Limiter(Frozen())
        yield own


def openai_client(fake: FakeProvider) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.openai_base_url, api_key="sk-test", max_retries=0)


def anthropic_client(fake: FakeProvider) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.url, api_key="sk-ant-test", max_retries=0)


def message(client: anthropic.Anthropic, max_tokens: int, output: int, **extra: Any) -> Any:
    """A message whose answer is ``output`` tokens long, its raw response (headers)."""
    return client.messages.with_raw_response.create(
        model=HAIKU,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": "hello"}],
        extra_headers={"x-fake-output-tokens": str(output)},
        **extra,
    )


def seconds(duration: str) -> float:
    found = GO_DURATION.match(duration)
    assert found and duration, duration
    hours, minutes, secs, ms = found.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0)


def control(fake: FakeProvider, method: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{fake.url}/_fake/limits", data=data, method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def test_a_request_over_the_requests_per_minute_is_answered_429_and_not_billed(
    fake: FakeProvider,
) -> None:
    fake.set_limits("openai", requests=5)
    client = openai_client(fake)
    remaining = []
    for _ in range(5):
        raw = client.chat.completions.with_raw_response.create(**CHAT)
        raw.parse()
        assert raw.headers["x-ratelimit-limit-requests"] == "5"
        assert seconds(raw.headers["x-ratelimit-reset-requests"]) <= 60
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
        # only the limits set get headers
        assert "x-ratelimit-limit-tokens" not in raw.headers
    assert remaining == [4, 3, 2, 1, 0]
    billed = fake.state()["billed_total"]
    assert billed > 0

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**CHAT)

    error = info.value
    assert error.status_code == 429
    assert (error.code, error.type, error.param) == ("rate_limit_exceeded", "requests", None)
    assert "on requests per min (RPM): Limit 5, Used 5, Requested 1" in error.message
    headers = error.response.headers
    # a request comes back every 12 s at 5 a minute
    assert 1 <= int(headers["retry-after"]) <= 12
    assert 0 < int(headers["retry-after-ms"]) <= 12_000
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert 0 < seconds(headers["x-ratelimit-reset-requests"]) <= 60
    state = fake.state()
    assert state["billed_total"] == billed
    assert state["rate_limited"] == 1
    assert [(r["status"], r["billed"] > 0) for r in state["requests"]] == [(200, True)] * 5 + [
        (429, False)
    ]


def test_openai_tokens_count_input_plus_the_output_bound_on_arrival(
    frozen: FakeProvider,
) -> None:
    frozen.set_limits("openai", tokens=100)
    client = openai_client(frozen)
    tiny = {"x-fake-output-tokens": "1"}  # each answer is one token long

    first = client.chat.completions.with_raw_response.create(**CHAT, extra_headers=tiny)
    usage = first.parse().usage
    assert usage is not None and usage.completion_tokens == 1
    # taken: the input and the whole bound of 16, not corrected to the 1 produced
    left = 100 - usage.prompt_tokens - 16
    assert first.headers["x-ratelimit-remaining-tokens"] == str(left)
    assert "x-ratelimit-limit-requests" not in first.headers

    one_more = left - usage.prompt_tokens + 1
    with pytest.raises(openai.RateLimitError) as info:
        # its real output (1 token) would fit; its bound does not
        client.chat.completions.create(
            **{**CHAT, "max_completion_tokens": one_more}, extra_headers=tiny
        )
    assert info.value.type == "tokens"
    asked = usage.prompt_tokens + one_more
    assert f"Limit 100, Used {100 - left}, Requested {asked}" in info.value.message

    exact = client.chat.completions.with_raw_response.create(
        **{**CHAT, "max_completion_tokens": one_more - 1}, extra_headers=tiny
    )
    exact.parse()
    assert exact.headers["x-ratelimit-remaining-tokens"] == "0"
    assert [r.status for r in frozen.served()] == [200, 429, 200]


def test_anthropic_output_is_reserved_at_max_tokens_and_the_unused_part_comes_back(
    frozen: FakeProvider,
) -> None:
    frozen.set_limits("anthropic", HAIKU, output_tokens=100, tokens=1_000)
    client = anthropic_client(frozen)

    first = message(client, max_tokens=90, output=5)
    first_usage = first.parse().usage
    assert first_usage.output_tokens == 5
    # 90 reserved on arrival, corrected to the 5 produced when billed
    assert first.headers["anthropic-ratelimit-output-tokens-remaining"] == "95"
    assert first.headers["anthropic-ratelimit-output-tokens-limit"] == "100"
    combined = 1_000 - first_usage.input_tokens - 5
    assert first.headers["anthropic-ratelimit-tokens-remaining"] == str(combined)
    assert "anthropic-ratelimit-input-tokens-limit" not in first.headers

    with pytest.raises(anthropic.RateLimitError) as info:
        message(client, max_tokens=96, output=5)
    assert info.value.status_code == 429
    body: Any = info.value.body
    assert (set(body), body["type"], body["error"]["type"]) == (
        {"type", "error"},
        "error",
        "rate_limit_error",
    )
    assert "100 output tokens per minute (model: claude-haiku-4-5)" in body["error"]["message"]
    assert int(info.value.response.headers["retry-after"]) >= 1

    # without the 85 given back only 10 would be left: 95 fits only because they were
    exact = message(client, max_tokens=95, output=95)
    assert exact.parse().usage.output_tokens == 95
    assert exact.headers["anthropic-ratelimit-output-tokens-remaining"] == "0"

    frozen.plan("status=529")  # overloaded is a fault, not a rate limit
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        message(client, max_tokens=1, output=1)
    assert overloaded.value.status_code == 529
    assert not isinstance(overloaded.value, anthropic.RateLimitError)
    assert frozen.state()["rate_limited"] == 1


def test_anthropic_cache_reads_do_not_count_toward_input_tokens(frozen: FakeProvider) -> None:
    client = anthropic_client(frozen)
    system = [
        {
            "type": "text",
            "text": "a long shared context " * 40,
            "cache_control": {"type": "ephemeral"},
        }
    ]

    def send() -> Any:
        return message(client, max_tokens=8, output=1, system=system)

    written, read = send().parse().usage, send().parse().usage
    assert written.cache_creation_input_tokens and read.cache_read_input_tokens
    frozen.reset()  # the cache too
    # room for the write (counted whole) and one read's uncached tokens, no more
    frozen.set_limits(
        "anthropic",
        input_tokens=written.input_tokens + written.cache_creation_input_tokens + read.input_tokens,
    )

    assert send().parse().usage.cache_creation_input_tokens
    again = send()
    assert again.parse().usage.cache_read_input_tokens
    assert again.headers["anthropic-ratelimit-input-tokens-remaining"] == "0"
    with pytest.raises(anthropic.RateLimitError):
        send()


def test_a_refused_request_leaves_the_prompt_cache_as_it_was(frozen: FakeProvider) -> None:
    client = anthropic_client(frozen)
    system = [{"type": "text", "text": "context " * 40, "cache_control": {"type": "ephemeral"}}]
    frozen.set_limits("anthropic", input_tokens=10)
    with pytest.raises(anthropic.RateLimitError):
        message(client, max_tokens=8, output=1, system=system)
    frozen.clear_limits()
    usage = message(client, max_tokens=8, output=1, system=system).parse().usage
    assert usage.cache_creation_input_tokens and not usage.cache_read_input_tokens


def test_a_request_passes_again_once_the_wait_it_was_told_has_passed(
    frozen: FakeProvider,
) -> None:
    """The wait a 429 gives is the wait: a millisecond before it the request is still
    refused, at it the request passes (on a clock moved by hand, not slept on)."""
    clock = frozen.limits.clock
    assert isinstance(clock, Frozen)
    # 6,000 tokens a minute refill 100 a second
    frozen.set_limits("openai", tokens=6_000)
    client = openai_client(frozen)
    prompt = client.chat.completions.create(**CHAT).usage
    assert prompt is not None
    clock.now += 60  # full again
    client.chat.completions.create(
        **{**CHAT, "max_completion_tokens": 6_000 - prompt.prompt_tokens}
    )  # takes the whole bucket
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**CHAT)
    headers = info.value.response.headers
    wait_ms = int(headers["retry-after-ms"])
    # the request's input and its 16 tokens of output, at 100 a second
    assert wait_ms == math.ceil(1_000 * (prompt.prompt_tokens + 16) / 100)
    assert seconds(headers["x-ratelimit-reset-tokens"]) == 60
    clock.now += (wait_ms - 1) / 1000
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)
    clock.now += 0.001
    assert client.chat.completions.create(**CHAT).choices

    # Anthropic: 600 output tokens a minute refill 10 a second; retry-after is whole
    # seconds
    frozen.set_limits("anthropic", output_tokens=600)
    claude = anthropic_client(frozen)
    message(claude, max_tokens=600, output=600)
    with pytest.raises(anthropic.RateLimitError) as refused:
        message(claude, max_tokens=5, output=5)
    retry_after = int(refused.value.response.headers["retry-after"])
    assert retry_after == 1
    reset = refused.value.response.headers["anthropic-ratelimit-output-tokens-reset"]
    full_at = datetime.strptime(reset, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert 0 < full_at.timestamp() - time.time() <= 61
    clock.now += retry_after
    assert message(claude, max_tokens=5, output=5).parse().usage.output_tokens == 5
    assert frozen.state()["rate_limited"] == 3


def test_a_model_limit_is_its_own_and_star_is_one_quota_for_the_others(
    frozen: FakeProvider,
) -> None:
    client = openai_client(frozen)

    def status(model: str) -> int:
        try:
            client.chat.completions.create(**{**CHAT, "model": model})
        except openai.RateLimitError as exc:
            return exc.status_code
        return 200

    frozen.set_limits("openai", "gpt-4o-mini", requests=1)
    assert [status("gpt-4o-mini"), status("gpt-4o-mini")] == [200, 429]
    assert [status("gpt-4o"), status("gpt-4o")] == [200, 200]
    unlimited = client.chat.completions.with_raw_response.create(**{**CHAT, "model": "gpt-4o"})
    assert unlimited.headers["x-ratelimit-limit-requests"] == "100000"  # as before limits

    frozen.set_limits("openai", "*", requests=2)
    # gpt-4o and gpt-4.1-mini share the "*" quota; gpt-4o-mini keeps its own
    assert [status("gpt-4o"), status("gpt-4.1-mini"), status("gpt-4o")] == [200, 200, 429]
    assert status("gpt-4o-mini") == 429
    # another vendor's models are not limited by it
    assert message(anthropic_client(frozen), max_tokens=8, output=1).parse().content
    assert frozen.state()["rate_limited"] == 3


def _burst(base_url: str, attempts: int, barrier: Barrier, out: Queue[Any]) -> None:
    """One process of the burst: waits for the others, then sends ``attempts`` requests
    as fast as it can, and reports when it started and ended and what it got."""
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    barrier.wait(60)
    started, statuses = time.time(), []
    for _ in range(attempts):
        try:
            client.chat.completions.create(**CHAT)
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
    out.put((started, time.time(), statuses))


def test_processes_at_once_get_exactly_what_the_bucket_holds(fake: FakeProvider) -> None:
    rpm, processes, each = 30, 8, 15
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    workers = [
        ctx.Process(target=_burst, args=(fake.openai_base_url, each, barrier, out))
        for _ in range(processes)
    ]
    fake.set_limits("openai", requests=rpm)
    for worker in workers:
        worker.start()
    reports = [out.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(30)

    starts, ends = [r[0] for r in reports], [r[1] for r in reports]
    statuses = [s for r in reports for s in r[2]]
    # they overlapped: every process had started before the first one finished
    assert max(starts) < min(ends)
    assert len(statuses) == processes * each
    assert set(statuses) <= {200, 429}
    passed = statuses.count(200)
    # the bucket's capacity, plus at most what refilled while the burst lasted
    refilled = math.floor(rpm / 60 * (max(ends) - min(starts)))
    assert rpm <= passed <= rpm + refilled
    state = fake.state()
    assert state["rate_limited"] == statuses.count(429)
    billed = [r for r in state["requests"] if r["billed"]]
    assert len(billed) == passed
    assert all(r["status"] == 429 for r in state["requests"] if not r["billed"])


def test_limits_are_set_and_cleared_over_the_control_api(fake: FakeProvider) -> None:
    client = openai_client(fake)
    answer = control(fake, "POST", {"vendor": "openai", "model": "gpt-4o", "requests": 1})
    assert answer["limits"] == [{"vendor": "openai", "model": "gpt-4o", "requests": 1}]
    assert fake.state()["limits"] == answer["limits"]
    gpt4o = {**CHAT, "model": "gpt-4o"}
    client.chat.completions.create(**gpt4o)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**gpt4o)

    with pytest.raises(urllib.error.HTTPError) as bad:  # OpenAI has no input token limit
        control(fake, "POST", {"vendor": "openai", "input_tokens": 5})
    assert bad.value.code == 400

    assert control(fake, "DELETE") == {"limits": []}
    client.chat.completions.create(**gpt4o)

    control(fake, "POST", {"vendor": "openai", "model": "gpt-4o", "requests": 1})
    assert control(fake, "POST", {"clear": True}) == {"limits": []}
    client.chat.completions.create(**gpt4o)
    client.chat.completions.create(**gpt4o)

    control(fake, "POST", {"vendor": "anthropic", "requests": 1})
    urllib.request.urlopen(
        urllib.request.Request(f"{fake.url}/_fake/reset", data=b"{}", method="POST"), timeout=5
    ).close()
    assert (fake.state()["limits"], fake.state()["rate_limited"]) == ([], 0)


def test_each_vendor_reads_its_own_429_as_the_fake_writes_it(frozen: FakeProvider) -> None:
    """What the library learns from a provider's answer (``Vendor.rate_state``): the
    fake's headers and 429s, read back through the official SDKs, give the limit set,
    what remains and how long to wait."""
    from budget_tasks.providers import Anthropic, OpenAI

    frozen.set_limits("openai", requests=2)
    frozen.set_limits("anthropic", requests=2, output_tokens=10_000)
    now = datetime.now(UTC)
    oai, claude = openai_client(frozen), anthropic_client(frozen)
    ask = [{"role": "user", "content": "hello"}]
    first = oai.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=ask, max_completion_tokens=8
    )
    told = OpenAI().rate_state(first.headers, now)
    assert (told.windows["requests"].limit, told.windows["requests"].remaining) == (2, 1)
    assert told.retry_after is None
    oai.chat.completions.create(model="gpt-4o-mini", messages=ask, max_completion_tokens=8)
    with pytest.raises(openai.RateLimitError) as refused:
        oai.chat.completions.create(model="gpt-4o-mini", messages=ask, max_completion_tokens=8)
    state = OpenAI().rate_state(refused.value.response.headers, now)
    assert state.windows["requests"].remaining == 0
    assert state.retry_after is not None and state.retry_after.total_seconds() > 0
    reset = state.windows["requests"].reset_in
    assert reset is not None and 0 < reset.total_seconds() <= 60

    said = Anthropic().rate_state(message(claude, 100, 10).headers, now)
    assert said.windows["output_tokens"].limit == 10_000
    message(claude, 100, 10)
    with pytest.raises(anthropic.RateLimitError) as again:
        message(claude, 100, 10)
    state = Anthropic().rate_state(again.value.response.headers, now)
    assert state.retry_after is not None and state.retry_after.total_seconds() >= 1


#: The fake's two command lines: ``budget-tasks fake-provider`` and the ``python -m`` one.
FAKE_COMMANDS = {
    "budget-tasks": [sys.executable, "-m", "budget_tasks.cli", "fake-provider"],
    "python -m": [sys.executable, "-m", "budget_tasks.testing"],
}


@pytest.mark.parametrize("command", FAKE_COMMANDS)
def test_the_fake_sets_its_own_limits_from_the_command_line(command: str) -> None:
    """``--limit VENDOR:MODEL:KIND=N[,KIND=N...]``, repeatable: several kinds of one model
    at once, or apart; ``*`` for the vendor's other models; Anthropic's kinds with a
    hyphen as the ledger's flags write them. The fake says what it holds, and holds it."""
    server = subprocess.Popen(
        [
            *FAKE_COMMANDS[command],
            "--port", "0",
            "--limit", "openai:gpt-4o-mini:requests=2,tokens=60000",
            "--limit", "anthropic:*:input-tokens=5000",
            "--limit", "anthropic:*:requests=50",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", first)
        assert url, first
        lines = [server.stdout.readline() for _ in range(4 if command == "budget-tasks" else 2)]
        assert [line for line in lines if line.startswith("rate limit ")] == [
            "rate limit openai gpt-4o-mini: requests 2, tokens 60,000 a minute\n",
            "rate limit anthropic *: input_tokens 5,000, requests 50 a minute\n",
        ]
        with urllib.request.urlopen(f"{url.group()}/_fake/state", timeout=5) as response:
            state = json.loads(response.read())
        assert state["limits"] == [
            {"vendor": "openai", "model": "gpt-4o-mini", "requests": 2, "tokens": 60000},
            {"vendor": "anthropic", "model": "*", "input_tokens": 5000, "requests": 50},
        ]
        client = openai.OpenAI(base_url=f"{url.group()}/v1", api_key="sk-test", max_retries=0)
        for _ in range(2):
            client.chat.completions.create(**CHAT)
        with pytest.raises(openai.RateLimitError):  # the third of 2 a minute
            client.chat.completions.create(**CHAT)
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize(
    ("limit", "says"),
    [
        ("openai:gpt-4o-mini", "'openai:gpt-4o-mini' is not VENDOR:MODEL:KIND=N[,KIND=N...]"),
        ("openai:gpt-4o-mini:requests=0", "requests=0 would admit nothing"),
        ("openai:gpt-4o-mini:requests=lots", "requests=lots is not a whole number a minute"),
        ("openai:gpt-4o-mini:tokens=1.5", "tokens=1.5 is not a whole number a minute"),
        ("openai:gpt-4o-mini:requests=-3", "requests=-3 is not a whole number a minute"),
        ("opnai:gpt-4o-mini:requests=5", "no vendor 'opnai' (one of openai, anthropic)"),
        ("openai:gpt-4o-mini:input_tokens=5", "openai has no 'input_tokens' limit"),
        ("openai:gpt-4o-mini:rpm=600", "openai has no 'rpm' limit (its limits: requests, tokens)"),
        ("openai:gpt-4o-mini:requests", "'requests' is not KIND=N"),
        ("openai:gpt-4o-mini:requests=5,requests=6", "requests is given twice"),
        ("openai:gpt4o-mini:requests=5", "the fake serves no openai model 'gpt4o-mini'"),
        ("anthropic:gpt-4o-mini:requests=5", "the fake serves no anthropic model 'gpt-4o-mini'"),
    ],
)
def test_a_bad_limit_is_refused_saying_what_is_wrong(limit: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_limits([limit], default_prices())


def test_a_model_limited_twice_on_the_command_line_is_refused_and_apart_is_one() -> None:
    with pytest.raises(ValueError, match="openai gpt-4o-mini requests is given twice"):
        parse_limits(["openai:gpt-4o-mini:requests=5", "openai:gpt-4o-mini:requests=6"])
    # a fine-tuned model's name holds colons: the kinds are after the last one
    tuned = "ft:gpt-4o-mini-2024-07-18:acme::x1"
    assert parse_limits(
        [f"openai:{tuned}:requests=5", f"openai:{tuned}:tokens=9_000"], default_prices()
    ) == [LimitSpec("openai", tuned, {"requests": 5, "tokens": 9000})]


@pytest.mark.parametrize("command", FAKE_COMMANDS)
@pytest.mark.parametrize(
    ("limit", "says"),
    [
        ("openai:gpt-4o-mini:requests=0", "requests=0 would admit nothing"),
        ("openai:gpt-4o-mini:input_tokens=5", "openai has no 'input_tokens' limit"),
    ],
)
def test_a_bad_limit_on_the_command_line_is_one_error_line_and_exit_2(
    command: str, limit: str, says: str
) -> None:
    """Checked before the port is taken: nothing served, nothing printed but the error
    (the good --limit beside it is not set either)."""
    done = subprocess.run(
        [
            *FAKE_COMMANDS[command],
            "--port", "0",
            "--limit", "openai:*:tokens=5000",
            "--limit", limit,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and "--limit" in line and says in line, line
