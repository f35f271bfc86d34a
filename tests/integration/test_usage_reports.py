"""The vendors' organisation usage and cost reports, read by the OpenAI and Anthropic
vendors with an admin key through the official SDKs, from the fake provider, which
builds them from what it served and billed: tokens, requests and money add up exactly,
every page is read once, groupings split by model, key and project, reports lag,
admin endpoints refuse a project's key, and an unreadable report is never read as 0."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import openai
import pytest

from budget_tasks.errors import ReportUnreadable
from budget_tasks.providers.anthropic import Anthropic
from budget_tasks.providers.anthropic import reports as anthropic_reports
from budget_tasks.providers.openai import OpenAI
from budget_tasks.providers.openai import reports as openai_reports
from budget_tasks.providers.reports import ReportQuery, hint_of, key_for
from budget_tasks.testing import FakeProvider

OPENAI_ADMIN = "sk-admin-fake-0123456789abcdef"
ANTHROPIC_ADMIN = "sk-ant-admin01-fake-0123456789abcdef"
KEY_A = "sk-proj-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAa1"
KEY_B = "sk-proj-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbBBb2"
CLAUDE_A = "sk-ant-api03-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-AAa1"
CLAUDE_B = "sk-ant-api03-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-BBb2"
HI = [{"role": "user", "content": "Summarise the minutes, please."}]


@pytest.fixture
def admins(fake: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """Each vendor's admin client, as a deployment gets it: from the environment."""
    monkeypatch.setenv("OPENAI_ADMIN_KEY", OPENAI_ADMIN)
    monkeypatch.setenv("OPENAI_BASE_URL", fake.openai_base_url)
    monkeypatch.setenv("ANTHROPIC_ADMIN_KEY", ANTHROPIC_ADMIN)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    return OpenAI().admin_client(5.0), Anthropic().admin_client(5.0)


def gpt(fake: FakeProvider, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.openai_base_url, api_key=key, max_retries=0)


def claude(fake: FakeProvider, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.url, api_key=key, max_retries=0)


def around_now(bucket: str = "1h", group_by: tuple[str, ...] = ()) -> ReportQuery:
    now = datetime.now(UTC)
    return ReportQuery(now - timedelta(days=1), now + timedelta(days=1), bucket, group_by)


def billed_by_day(fake: FakeProvider) -> dict[datetime, int]:
    days: Counter[datetime] = Counter()
    for served in fake.served():
        day = datetime.fromtimestamp(served.at, UTC).replace(hour=0, minute=0, second=0)
        days[day.replace(microsecond=0)] += served.billed
    return {day: amount for day, amount in days.items() if amount}


def summed(lines: list[Any], by: Callable[[Any], Any], *fields: str) -> dict[Any, tuple[int, ...]]:
    totals: dict[Any, list[int]] = defaultdict(lambda: [0] * len(fields))
    for line in lines:
        for i, name in enumerate(fields):
            totals[by(line)][i] += getattr(line, name)
    return {key: tuple(values) for key, values in totals.items()}


def test_openai_reports_add_up_to_what_was_served_and_billed(
    fake: FakeProvider, admins: tuple[Any, Any]
) -> None:
    """Tokens and requests per model are the answers' own usage summed, embeddings
    included; costs per day are what the fake billed, to the micro-dollar."""
    admin, _ = admins
    client = gpt(fake, KEY_A)
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for model, n in (("gpt-4o-mini", 2), ("gpt-4.1-nano", 1)):
        for i in range(n):
            done = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Question {i} " * (i + 3)}],
                max_completion_tokens=40,
                extra_headers={"x-fake-cached-tokens": "4"},
            )
            assert done.usage is not None
            totals = expected[done.model]
            totals[0] += done.usage.prompt_tokens  # cached ones included, as OpenAI's are
            totals[1] += done.usage.completion_tokens
            totals[2] += 1
    embedded = client.embeddings.create(model="text-embedding-3-small", input=["a b c", "d e"])
    expected[embedded.model] = [embedded.usage.prompt_tokens, 0, 1]
    usage = OpenAI().usage_report(admin, around_now(group_by=("model",)))
    assert usage is not None
    by_model = summed(usage, lambda line: line.model, "input_tokens", "output_tokens", "requests")
    assert by_model == {model: tuple(totals) for model, totals in expected.items()}
    assert all(line.end - line.start == timedelta(hours=1) for line in usage)
    costs = OpenAI().cost_report(admin, around_now())
    assert costs is not None and costs
    assert {line.model for line in costs} == set(expected)
    assert {line.line_item.rpartition(", ")[2] for line in costs if line.line_item} == {
        "input",
        "output",
    }
    assert {d: t[0] for d, t in summed(costs, lambda c: c.start, "amount").items()} == (
        billed_by_day(fake)
    )


def test_anthropic_reports_count_cache_and_batches_and_cents_exactly(
    fake: FakeProvider, admins: tuple[Any, Any]
) -> None:
    """Input is uncached tokens, cache writes and cache reads together; a batch's
    requests count at the models that answered them; the cost report's cents come back
    as the micro-dollars the fake billed."""
    _, admin = admins
    client = claude(fake, CLAUDE_A)
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def count(model: str, used: Any) -> None:
        expected[model][0] += (
            used.input_tokens
            + (used.cache_read_input_tokens or 0)
            + (used.cache_creation_input_tokens or 0)
        )
        expected[model][1] += used.output_tokens

    system = [{"type": "text", "text": "rules " * 400, "cache_control": {"type": "ephemeral"}}]
    for _ in range(2):  # a cache write, then a cache read
        message = client.messages.create(
            model="claude-haiku-4-5", max_tokens=30, system=system, messages=HI
        )
        count(message.model, message.usage)
    assert message.usage.cache_read_input_tokens  # the second read what the first wrote
    batch = client.messages.batches.create(
        requests=[
            {
                "custom_id": f"r{i}",
                "params": {"model": model, "max_tokens": 20, "messages": HI},
            }
            for i, model in enumerate(["claude-haiku-4-5", "claude-sonnet-4-5"])
        ]
    )
    for entry in client.messages.batches.results(batch.id):
        assert entry.result.type == "succeeded"
        count(entry.result.message.model, entry.result.message.usage)
    usage = Anthropic().usage_report(admin, around_now(group_by=("model",)))
    assert usage is not None
    assert all(line.requests is None for line in usage)  # Anthropic does not count them
    by_model = summed(usage, lambda line: line.model, "input_tokens", "output_tokens")
    assert by_model == {model: tuple(totals) for model, totals in expected.items()}
    costs = Anthropic().cost_report(admin, around_now())
    assert costs is not None
    assert {line.model for line in costs} == set(expected)
    assert {d: t[0] for d, t in summed(costs, lambda c: c.start, "amount").items()} == (
        billed_by_day(fake)
    )


def test_reports_split_by_api_key_and_project(fake: FakeProvider, admins: tuple[Any, Any]) -> None:
    """Two keys in two projects (workspaces): each key's usage and money is its own,
    and the key list gives each key's hint, which the ledger's hint of it finds."""
    openai_admin, anthropic_admin = admins
    ids = {
        KEY_A: fake.add_key(KEY_A, project="proj_a"),
        KEY_B: fake.add_key(KEY_B, project="proj_b"),
        CLAUDE_A: fake.add_key(CLAUDE_A, project="wrkspc_a", vendor="anthropic"),
        CLAUDE_B: fake.add_key(CLAUDE_B, vendor="anthropic"),  # the default workspace
    }
    sent: dict[str, int] = Counter()
    for key, times in ((KEY_A, 2), (KEY_B, 1)):
        for _ in range(times):
            done = gpt(fake, key).chat.completions.create(
                model="gpt-4o-mini", messages=HI, max_completion_tokens=20
            )
            assert done.usage is not None
            sent[ids[key]] += done.usage.prompt_tokens
    for key, times in ((CLAUDE_A, 1), (CLAUDE_B, 3)):
        for _ in range(times):
            used = (
                claude(fake, key)
                .messages.create(model="claude-haiku-4-5", max_tokens=20, messages=HI)
                .usage
            )
            sent[ids[key]] += used.input_tokens
    billed = Counter({ids[k]: 0 for k in ids})
    for served in fake.served():
        billed[str(served.key_id)] += served.billed
    query = around_now(group_by=("api_key", "project"))
    for vendor, admin, projects in (
        (OpenAI(), openai_admin, {ids[KEY_A]: "proj_a", ids[KEY_B]: "proj_b"}),
        (Anthropic(), anthropic_admin, {ids[CLAUDE_A]: "wrkspc_a", ids[CLAUDE_B]: None}),
    ):
        usage = vendor.usage_report(admin, query)
        assert usage is not None
        by_key = summed(usage, lambda line: (line.api_key_id, line.project), "input_tokens")
        assert by_key == {(key, project): (sent[key],) for key, project in projects.items()}
        keys = vendor.api_keys(admin)
        assert keys is not None
        assert {(k.id, k.project) for k in keys} == set(projects.items())
        for secret, key_id in ids.items():
            found = key_for(hint_of(secret), keys)
            assert (found is not None) == (key_id in projects)
            assert found is None or found.id == key_id
    # costs by project: each project's money is its key's
    costs = OpenAI().cost_report(openai_admin, query)
    assert costs is not None
    by_project = summed(costs, lambda line: line.project, "amount")
    assert by_project == {"proj_a": (billed[ids[KEY_A]],), "proj_b": (billed[ids[KEY_B]],)}
    costs = Anthropic().cost_report(anthropic_admin, query)
    assert costs is not None
    by_workspace = summed(costs, lambda line: line.project, "amount")
    assert by_workspace == {"wrkspc_a": (billed[ids[CLAUDE_A]],), None: (billed[ids[CLAUDE_B]],)}


def page_requests(fake: FakeProvider, path: str) -> int:
    return sum(1 for s in fake.served() if s.method == "GET" and s.path == path)


def test_every_page_is_read_once(fake: FakeProvider, admins: tuple[Any, Any]) -> None:
    """Two hours of minute buckets, 7 a page: 18 pages of each report, all read (the
    traffic is in the last one), none twice; with the default limit, 8 days of hourly
    buckets and 200 days of costs take two pages."""
    openai_admin, anthropic_admin = admins
    done = gpt(fake, KEY_A).chat.completions.create(
        model="gpt-4o-mini", messages=HI, max_completion_tokens=20
    )
    message = claude(fake, CLAUDE_A).messages.create(
        model="claude-haiku-4-5", max_tokens=20, messages=HI
    )
    assert done.usage is not None
    end = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
    minutes = ReportQuery(end - timedelta(hours=2), end, "1m")
    lines = openai_reports.usage_report(openai_admin, minutes, limit=7)
    assert [line.input_tokens for line in lines] == [done.usage.prompt_tokens]
    assert page_requests(fake, "/v1/organization/usage/completions") == 18
    assert page_requests(fake, "/v1/organization/usage/embeddings") == 18
    lines = anthropic_reports.usage_report(anthropic_admin, minutes, limit=7)
    assert [line.output_tokens for line in lines] == [message.usage.output_tokens]
    assert page_requests(fake, "/v1/organizations/usage_report/messages") == 18
    hours = end.replace(minute=0) + timedelta(hours=1)
    week = ReportQuery(hours - timedelta(days=8), hours, "1h")
    assert sum(line.output_tokens for line in OpenAI().usage_report(openai_admin, week) or []) == (
        done.usage.completion_tokens
    )
    assert page_requests(fake, "/v1/organization/usage/completions") == 18 + 2
    long = ReportQuery(hours - timedelta(days=200), hours, "1d")
    assert sum(c.amount for c in OpenAI().cost_report(openai_admin, long) or []) == sum(
        s.billed for s in fake.served() if s.path == "/v1/chat/completions"
    )
    assert page_requests(fake, "/v1/organization/costs") == 2
    month = ReportQuery(hours - timedelta(days=40), hours, "1d")
    assert sum(c.amount for c in Anthropic().cost_report(anthropic_admin, month) or []) == sum(
        s.billed for s in fake.served() if s.path == "/v1/messages"
    )
    assert page_requests(fake, "/v1/organizations/cost_report") == 2


def test_a_limit_above_the_most_is_refused_as_the_apis_refuse_it(
    fake: FakeProvider, admins: tuple[Any, Any]
) -> None:
    openai_admin, anthropic_admin = admins
    start = int(time.time()) - 3600
    with pytest.raises(openai.BadRequestError):
        openai_admin.get(
            "/organization/usage/completions",
            cast_to=object,
            options={"params": {"start_time": start, "bucket_width": "1m", "limit": 1441}},
        )
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_admin.get(
            "/v1/organizations/cost_report",
            cast_to=object,
            options={"params": {"starting_at": "2026-01-01T00:00:00Z", "limit": 32}},
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(ValueError, match="between 1 and 1440"):
        openai_reports.usage_report(openai_admin, around_now("1m"), limit=1441)


def control(fake: FakeProvider, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"{fake.url}/_fake/{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


def test_a_request_shows_in_the_reports_only_after_the_delay(
    fake: FakeProvider, admins: tuple[Any, Any]
) -> None:
    """Reports lag (set over the control API, as for a fake in its own process): a
    request within the delay is in no report yet; once it has passed, it is."""
    openai_admin, _ = admins
    control(fake, "reports", {"delay": 1.0})
    assert fake.report_delay == 1.0
    gpt(fake, KEY_A).chat.completions.create(
        model="gpt-4o-mini", messages=HI, max_completion_tokens=20
    )
    [served] = fake.served()
    assert OpenAI().usage_report(openai_admin, around_now()) == []
    assert OpenAI().cost_report(openai_admin, around_now()) == []
    time.sleep(max(0.0, served.at + 1.1 - time.time()))
    [line] = OpenAI().usage_report(openai_admin, around_now()) or []
    assert line.requests == 1
    assert sum(c.amount for c in OpenAI().cost_report(openai_admin, around_now()) or []) == (
        served.billed
    )


def test_the_admin_endpoints_refuse_a_projects_key_and_bill_nothing(fake: FakeProvider) -> None:
    """A normal key gets the SDK's AuthenticationError (Anthropic's authentication_error);
    reading reports is free and adds nothing to them."""
    with pytest.raises(openai.AuthenticationError):
        openai_reports.usage_report(gpt(fake, KEY_A), around_now())
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic_reports.api_keys(claude(fake, CLAUDE_A))
    body = refused.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"
    admin = gpt(fake, OPENAI_ADMIN)
    assert openai_reports.usage_report(admin, around_now()) == []
    assert openai_reports.cost_report(admin, around_now()) == []
    assert all(s.method == "GET" and s.billed == 0 and not s.bills for s in fake.served())
    # the admin key is no key of the organisation's: only the refused project key is
    listed = openai_reports.api_keys(admin)
    assert [k.hint for k in listed] == [f"{KEY_A[:6]}...{KEY_A[-4:]}"]


def test_admin_client_is_none_without_an_admin_key(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_ADMIN_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_ADMIN_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-not-an-admin-key")
    assert OpenAI().admin_client(5.0) is None
    assert Anthropic().admin_client(5.0) is None
    assert (OpenAI.admin_key_env, Anthropic.admin_key_env) == (
        "OPENAI_ADMIN_KEY",
        "ANTHROPIC_ADMIN_KEY",
    )


def first_bucket(page: dict[str, Any]) -> dict[str, Any]:
    """The first bucket of a report page that has results (the one to spoil)."""
    bucket: dict[str, Any] = next(b for b in page["data"] if b["results"])
    return bucket


def first_result(page: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = first_bucket(page)["results"][0]
    return result


UNREADABLE: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("openai", "usage", lambda p: first_result(p).update(input_tokens="12abc"), "input_tokens"),
    ("openai", "usage", lambda p: first_result(p).update(output_tokens=-3), "output_tokens"),
    ("openai", "usage", lambda p: first_result(p).pop("output_tokens"), "output_tokens"),
    ("openai", "usage", lambda p: first_bucket(p).update(start_time="noon"), "start_time"),
    ("openai", "usage", lambda p: p.update(has_more=True, next_page=None), "next_page"),
    ("openai", "costs", lambda p: first_result(p)["amount"].update(value="1,5"), "amount.value"),
    (
        "openai",
        "costs",
        lambda p: first_result(p)["amount"].update(currency="eur"),
        "amount.currency",
    ),
    (
        "anthropic",
        "usage",
        lambda p: first_result(p).pop("uncached_input_tokens"),
        "uncached_input_tokens",
    ),
    (
        "anthropic",
        "usage",
        lambda p: first_result(p)["cache_creation"].update(ephemeral_5m_input_tokens=True),
        "cache_creation.ephemeral_5m_input_tokens",
    ),
    (
        "anthropic",
        "usage",
        lambda p: first_bucket(p).update(starting_at="2026-01-01T00:00:00"),
        "starting_at",
    ),
    ("anthropic", "costs", lambda p: first_result(p).update(amount="NaN"), "amount"),
    ("anthropic", "costs", lambda p: first_result(p).update(amount=None), "amount"),
    ("anthropic", "costs", lambda p: first_result(p).update(currency="EUR"), "currency"),
]


@pytest.mark.parametrize(("vendor", "report", "tamper", "field"), UNREADABLE)
def test_an_unreadable_report_raises_never_reads_as_zero(
    fake: FakeProvider,
    admins: tuple[Any, Any],
    vendor: str,
    report: str,
    tamper: Callable[[dict[str, Any]], None],
    field: str,
) -> None:
    openai_admin, anthropic_admin = admins
    if vendor == "openai":
        gpt(fake, KEY_A).chat.completions.create(
            model="gpt-4o-mini", messages=HI, max_completion_tokens=20
        )
        reader, admin = OpenAI(), openai_admin
    else:
        claude(fake, CLAUDE_A).messages.create(model="claude-haiku-4-5", max_tokens=20, messages=HI)
        reader, admin = Anthropic(), anthropic_admin
    read = reader.usage_report if report == "usage" else reader.cost_report
    fake.tamper_next_report = tamper
    with pytest.raises(ReportUnreadable) as unreadable:
        read(admin, around_now())
    assert unreadable.value.field == field
    assert (unreadable.value.vendor, unreadable.value.report) == (
        vendor,
        "usage" if report == "usage" else "cost",
    )
    assert read(admin, around_now())  # the tamper was for one answer only


@pytest.mark.parametrize(
    ("vendor", "amount", "micro"),
    [
        # read as floats, 0.000123 * 1e6 is 123.00000000000001 and the float 0.07 is a
        # little more than 0.07: either would round up a micro-dollar too many
        ("openai", 0.000123, 123),
        ("openai", 0.07, 70_000),
        ("openai", 1.0000001, 1_000_001),  # a part of a micro-dollar rounds up
        ("anthropic", "0.00015", 2),  # cents: 1.5 micro-dollars, rounded up
        ("anthropic", "1234.5", 12_345_000),
    ],
)
def test_amounts_are_read_as_decimals_rounded_up_to_the_micro_dollar(
    fake: FakeProvider, admins: tuple[Any, Any], vendor: str, amount: Any, micro: int
) -> None:
    openai_admin, anthropic_admin = admins
    if vendor == "openai":
        gpt(fake, KEY_A).embeddings.create(model="text-embedding-3-small", input="hi")
        fake.tamper_next_report = lambda p: first_result(p)["amount"].update(value=amount)
        [line] = OpenAI().cost_report(openai_admin, around_now()) or []
    else:
        claude(fake, CLAUDE_A).messages.create(model="claude-haiku-4-5", max_tokens=1, messages=HI)
        fake.tamper_next_report = lambda p: first_result(p).update(amount=amount)
        line = (Anthropic().cost_report(anthropic_admin, around_now()) or [])[0]
    assert line.amount == micro


def listed_ids(admin: Any, path: str, **params: Any) -> list[str]:
    """The ids one page of a key list holds, asked with ``params``."""
    page = admin.get(path, cast_to=object, options={"params": params})
    return [item["id"] for item in page["data"]]


def test_key_lists_leave_out_what_the_real_ones_leave_out_unless_asked_and_the_readers_ask(
    fake: FakeProvider, admins: tuple[Any, Any]
) -> None:
    """OpenAI's project list leaves out a working key whose owner lost access to the
    project unless asked with ``owner_project_access``, and a deleted key is in no list
    and refused; Anthropic's list leaves out an archived key unless asked by status,
    and an archived key is refused. Both vendors' readers list every key that may have
    spent."""
    openai_admin, anthropic_admin = admins
    kept = fake.add_key(KEY_A, project="proj_a")
    away = fake.add_key(KEY_B, project="proj_a", owner_access="inactive")
    keys_of = "/organization/projects/proj_a/api_keys"
    assert listed_ids(openai_admin, keys_of) == [kept]
    assert listed_ids(openai_admin, keys_of, owner_project_access="inactive") == [away]
    assert sorted(listed_ids(openai_admin, keys_of, owner_project_access="any")) == sorted(
        [kept, away]
    )
    assert (
        gpt(fake, KEY_B)
        .chat.completions.create(model="gpt-4o-mini", messages=HI, max_completion_tokens=20)
        .usage
    )  # the key works
    assert {k.id for k in OpenAI().api_keys(openai_admin) or []} == {kept, away}
    with openai.OpenAI(
        api_key=OPENAI_ADMIN,
        admin_api_key=OPENAI_ADMIN,
        base_url=fake.openai_base_url,
        max_retries=0,
    ) as admin:
        assert admin.admin.organization.projects.api_keys.delete(kept, project_id="proj_a").deleted
    assert listed_ids(openai_admin, keys_of, owner_project_access="any") == [away]
    with pytest.raises(openai.AuthenticationError):
        gpt(fake, KEY_A).chat.completions.create(
            model="gpt-4o-mini", messages=HI, max_completion_tokens=20
        )
    # its past traffic keeps its id; what it was refused is billed nowhere
    usage = OpenAI().usage_report(openai_admin, around_now(group_by=("api_key",))) or []
    assert {line.api_key_id for line in usage} == {away}
    assert sum(s.billed for s in fake.served() if s.status == 401) == 0

    old = fake.add_key(CLAUDE_A, project="wrkspc_a", vendor="anthropic")
    new = fake.add_key(CLAUDE_B, project="wrkspc_a", vendor="anthropic")
    keys = "/v1/organizations/api_keys"
    anthropic_admin.organization.api_keys.update(old, status="archived")
    assert listed_ids(anthropic_admin, keys) == [new]
    assert listed_ids(anthropic_admin, keys, status="archived") == [old]
    with pytest.raises(anthropic.BadRequestError):  # archived for good
        anthropic_admin.organization.api_keys.update(old, status="active")
    with pytest.raises(anthropic.AuthenticationError):
        claude(fake, CLAUDE_A).messages.create(model="claude-haiku-4-5", max_tokens=20, messages=HI)
    assert {k.id for k in Anthropic().api_keys(anthropic_admin) or []} == {old, new}
