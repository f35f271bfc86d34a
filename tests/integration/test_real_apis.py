"""What the real provider APIs do that a kind fake does not, each through the guarded
transport with the official SDKs, against the fake provider in its realistic default
mode (the ways money was lost, sent twice or held forever when it was kinder)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import Celery

from budget_tasks import BudgetTask, Ledger
from budget_tasks.pricing import Usage
from budget_tasks.testing import FakeProvider, fake_wire
from budget_tasks.transport import guarded_anthropic_client, guarded_openai_client


@pytest.fixture
def app(backend_url: str) -> Celery:
    app = Celery(f"real-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )
    Ledger(backend_url).create_budget("team", 10_000_000)
    return app


def task(app: Celery, fn: Any, key: str) -> Any:
    """``fn`` as a BudgetTask on ``app``: zero main estimate, every call through the
    guarded transport reserves its own bound."""
    return app.task(
        base=BudgetTask,
        bind=True,
        name=f"{fn.__name__}-{uuid.uuid4().hex[:6]}",
        budget="team",
        idempotency_key=lambda *a, **k: key,
        estimate_cost=lambda *a, **k: 0,
    )(fn)


def posts(fake: FakeProvider) -> list[Any]:
    return [s for s in fake.served() if s.method == "POST"]


def settled_at_the_bill(ledger: Ledger, fake: FakeProvider) -> dict[str, int]:
    """Every metered call's attempt, checked against what the fake billed for its key."""
    sent = posts(fake)
    charged = {ledger.provider_key(a.key): a for a in ledger.attempts() if "#" not in a.key}
    assert len(charged) == len(sent)
    for s in sent:
        attempt = charged[s.idempotency_key]
        assert (attempt.state, attempt.actual) == ("settled", s.billed), attempt
        assert s.billed > 0
    assert ledger.balance("team").held == 0 and ledger.audit() == []
    return {a.key: a.actual or 0 for a in charged.values()}


# -- 1. compressed answers ----------------------------------------------------------------


@pytest.mark.parametrize("encoding", [*fake_wire.available(), "identity"])
def test_compressed_answers_and_streams_settle_at_the_bill_in_every_encoding(
    app: Celery, fake: FakeProvider, backend_url: str, encoding: str
) -> None:
    """The real APIs compress whenever the client accepts it (httpx2 asks for gzip and
    deflate, and br and zstd where their packages are installed). The transport hands
    the SDK what it decoded, so the SDK must not decode it again, and a stream's usage
    is read from the decoded events."""
    fake.encodings = (encoding,)
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
    ask = [{"role": "user", "content": "Compressed, please."}]

    def calls(self: BudgetTask) -> list[Any]:
        plain = oai.chat.completions.create(
            model="gpt-4o-mini", max_completion_tokens=16, messages=ask
        )
        streamed = [
            chunk.choices[0].delta.content or ""
            for chunk in oai.chat.completions.create(
                model="gpt-4o-mini", max_completion_tokens=16, stream=True, messages=ask
            )
        ]
        message = claude.messages.create(model="claude-haiku-4-5", max_tokens=16, messages=ask)
        with claude.messages.stream(
            model="claude-haiku-4-5", max_tokens=16, messages=ask
        ) as events:
            told = "".join(events.text_stream)
        return [
            plain.usage.total_tokens,
            "".join(streamed).strip(),
            message.usage.output_tokens,
            told.strip(),
        ]

    tokens, streamed, output, told = task(app, calls, "zip:1").delay().get()
    assert tokens > 0 and output > 0
    assert streamed.startswith("fake") and told.startswith("fake")
    assert {s.encoding for s in posts(fake)} == {encoding}  # it went out compressed
    assert len(settled_at_the_bill(Ledger(backend_url), fake)) == 4


# -- 2. the SDKs' own retries ------------------------------------------------------------------


def _sdk_client(vendor: str, fake: FakeProvider, timeout: float) -> Any:
    """The SDK's own client over the guarded http client, its default 2 retries kept."""
    import anthropic
    import openai

    from budget_tasks.transport import guarded_http_client

    http = guarded_http_client(timeout=timeout)
    if vendor == "openai":
        return openai.OpenAI(base_url=fake.openai_base_url, api_key="x", http_client=http)
    return anthropic.Anthropic(base_url=fake.url, api_key="x", http_client=http)


def _ask(client: Any, vendor: str) -> Any:
    ask = [{"role": "user", "content": "Retry me."}]
    if vendor == "openai":
        return client.chat.completions.create(
            model="gpt-4o-mini", max_completion_tokens=16, messages=ask
        )
    return client.messages.create(model="claude-haiku-4-5", max_tokens=16, messages=ask)


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
@pytest.mark.parametrize("fault", ["hang=2", "status=500"])
def test_the_sdks_own_retry_is_refused_before_it_is_sent(
    app: Celery, fake: FakeProvider, backend_url: str, vendor: str, fault: str
) -> None:
    """A client built by hand over the guarded http client keeps the SDK's default of
    2 retries. After a timeout (billed, answered too late) or a 500, the SDK sends the
    same request again, marked by x-stainless-retry-count: refused before it leaves,
    so the provider sees it once and the first try keeps its hold."""
    from budget_tasks.errors import RetriesEnabled

    client = _sdk_client(vendor, fake, timeout=1.0)
    assert client.max_retries == 2
    fake.plan(fault)

    def once(self: BudgetTask) -> Any:
        return _ask(client, vendor)

    with pytest.raises(RetriesEnabled, match=r"x-stainless-retry-count=[12]"):
        task(app, once, f"retry:{vendor}").delay().get()
    [sent] = posts(fake)  # sent once, never again
    ledger = Ledger(backend_url)
    calls = [a for a in ledger.attempts() if "#" not in a.key]
    assert [a.key for a in calls] == [
        f"retry:{vendor}:{vendor}.{'chat' if vendor == 'openai' else 'messages'}:1"
    ]
    [first] = calls
    if fault.startswith("hang"):  # billed, answer lost: the hold stays for reconciliation
        assert sent.billed > 0 and first.state == "unknown"
        assert ledger.balance("team").held == first.amount
    else:
        assert sent.billed == 0 and sent.status == 500 and first.state == "unknown"


@pytest.mark.parametrize("vendor", ["openai", "anthropic"])
def test_a_guarded_client_cannot_have_its_retries_turned_back_on(
    fake: FakeProvider, vendor: str
) -> None:
    import httpx2

    from budget_tasks.errors import RetriesEnabled

    build = guarded_openai_client if vendor == "openai" else guarded_anthropic_client
    client = build(base_url=fake.url, api_key="x", timeout=5.0)
    for turn_on in (
        lambda: client.with_options(max_retries=2),
        lambda: client.copy(max_retries=1),
        lambda: setattr(client, "max_retries", 3),
    ):
        with pytest.raises(RetriesEnabled):
            turn_on()
    with pytest.raises(ValueError, match="guarded http client"):
        client.with_options(http_client=httpx2.Client())
    other = client.with_options(timeout=2.0)  # other options still change
    assert (other.max_retries, other.timeout, type(other)) == (0, 2.0, type(client))
    with pytest.raises(RetriesEnabled):
        build(base_url=fake.url, api_key="x", max_retries=2)


# -- 3. every billable endpoint metered, refused or free; deny by default ----------------


def test_embeddings_legacy_completions_images_and_speech_are_metered_at_their_bill(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def billable(self: BudgetTask) -> list[Any]:
        embedded = oai.embeddings.create(
            model="text-embedding-3-small", input=["a tide table", "the moon"]
        )
        legacy = oai.completions.create(
            model="gpt-3.5-turbo-instruct", prompt="Once upon a tide", max_tokens=12
        )
        image = oai.images.generate(
            model="gpt-image-1", prompt="A lighthouse", size="1024x1024", quality="low"
        )
        spoken = oai.audio.speech.create(model="tts-1", voice="alloy", input="High tide at six.")
        return [
            len(embedded.data),
            legacy.choices[0].text.startswith("fake"),
            bool(image.data[0].b64_json),
            len(spoken.content) > 0,
        ]

    job = task(app, billable, "media:1")
    assert job.delay().get() == [2, True, True, True]
    ledger = Ledger(backend_url)
    charged = settled_at_the_bill(ledger, fake)
    assert sorted(k.split(":")[2] for k in charged) == [
        "openai.completions",
        "openai.embeddings",
        "openai.images",
        "openai.speech",
    ]
    # the same business key again: every answer replays, speech's audio bytes too
    before = len(posts(fake))
    assert job.delay().get() == [2, True, True, True]
    assert len(posts(fake)) == before


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/batches", {"input_file_id": "f", "endpoint": "/v1/chat/completions"}, "batches"),
        ("/audio/transcriptions", {"model": "whisper-1"}, "transcriptions"),
        ("/v1/brand-new-billable-thing", {"model": "gpt-4o"}, "deny by default"),
    ],
)
def test_a_post_that_may_bill_unbounded_is_refused_inside_a_task_and_outside(
    app: Celery, fake: FakeProvider, path: str, body: dict[str, Any], named: str
) -> None:
    """Through a plain guarded http client, as a gateway's client would call it: a batch
    behind a gateway prefix, audio, and a POST no vendor knows."""
    from budget_tasks.errors import RefusedEndpoint
    from budget_tasks.transport import guarded_http_client

    http = guarded_http_client(timeout=5.0)
    url = f"{fake.url}/openai{path}" if path.startswith("/batches") else fake.openai_base_url + path
    if path.startswith("/v1/"):
        url = fake.url + path

    def post(self: BudgetTask) -> int:
        return http.post(url, json=body).status_code

    with pytest.raises(RefusedEndpoint, match=named):
        task(app, post, f"refused:{named}").delay().get()
    with pytest.raises(RefusedEndpoint, match=named):
        http.post(url, json=body)  # outside any task: refused all the same
    assert posts(fake) == []


def test_free_requests_pass_and_billable_ones_outside_a_task_are_refused(
    fake: FakeProvider,
) -> None:
    from budget_tasks.errors import UnguardedCall

    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    counted = claude.messages.count_tokens(
        model="claude-haiku-4-5", messages=[{"role": "user", "content": "hi"}]
    )
    assert counted.input_tokens > 0  # free: passed, billed nothing
    with pytest.raises(UnguardedCall):
        oai.embeddings.create(model="text-embedding-3-small", input="outside")
    assert [s.billed for s in posts(fake)] == [0]


# -- 4. estimates that are upper bounds: unseen input refused, media priced as media ------


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({"type": "item_reference", "id": "msg_stored_1"}, "item_reference"),
        (
            {
                "type": "computer_call_output",
                "call_id": "c1",
                "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,AA"},
            },
            "computer_screenshot",
        ),
        (
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": "https://example.org/chart.png"}],
            },
            "input_image",
        ),
    ],
)
def test_responses_items_that_bill_unseen_or_as_media_are_refused_before_sending(
    app: Celery, fake: FakeProvider, backend_url: str, item: dict[str, Any], named: str
) -> None:
    """A stored item referenced by id bills its content (6,000 tokens at the fake, as at
    OpenAI) while the request carries 30 bytes; a screenshot or an image inside a tool's
    output bills as an image, not as its JSON. Without a per-image bound, refused."""
    from budget_tasks.errors import EstimateRefused

    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def agent(self: BudgetTask) -> str:
        answer = oai.responses.create(
            model="gpt-4o-mini",
            max_output_tokens=32,
            input=[{"role": "user", "content": "Go on."}, item],
        )
        return str(answer.output_text)

    with pytest.raises(EstimateRefused, match=named):
        task(app, agent, f"items:{named}").delay().get()
    assert posts(fake) == []
    assert Ledger(backend_url).balance("team").held == 0


def test_media_inside_tool_results_is_bounded_with_a_per_image_bound(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """With ``image_tokens`` on the client, an image in a tool result (and a screenshot,
    a reasoning item) is bounded as media: reserved at least the fake's bill."""
    from budget_tasks.testing.fake_billing import IMAGE_TOKENS

    oai = guarded_openai_client(
        base_url=fake.openai_base_url, api_key="x", timeout=5.0, image_tokens=IMAGE_TOKENS
    )
    claude = guarded_anthropic_client(
        base_url=fake.url, api_key="x", timeout=5.0, image_tokens=IMAGE_TOKENS
    )
    chart = {"type": "input_image", "image_url": "https://example.org/chart.png"}

    def agent(self: BudgetTask) -> list[str]:
        one = oai.responses.create(
            model="gpt-4o-mini",
            max_output_tokens=32,
            input=[
                {"role": "user", "content": "Read the chart."},
                {"type": "function_call", "call_id": "c1", "name": "chart", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [chart, chart]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gA" * 300},
            ],
        )
        two = claude.messages.create(
            model="claude-haiku-4-5",
            max_tokens=32,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "tu_1",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "url", "url": "https://x/y.png"},
                                }
                            ],
                        }
                    ],
                }
            ],
        )
        return [str(one.output_text), str(two.content[0].text)]

    task(app, agent, "media-in-tools:1").delay().get()
    ledger = Ledger(backend_url)
    settled_at_the_bill(ledger, fake)
    openai_call, anthropic_call = posts(fake)
    # the fake billed the media as media: two images, then one, at 765 tokens each
    assert openai_call.usage["input_tokens"] >= 2 * IMAGE_TOKENS
    assert anthropic_call.usage["input_tokens"] >= IMAGE_TOKENS
    for attempt in ledger.attempts():
        if "#" not in attempt.key:
            assert attempt.actual is not None and attempt.actual <= attempt.amount


# -- 5. prices: snapshots, cache writes by TTL, batch discount, tiers ----------------------


def test_anthropic_cache_writes_settle_at_their_ttl_rate(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """A 1-hour cache write bills 2x input, a 5-minute one 1.25x, a read 0.1x: each call
    settles at exactly the fake's bill (a ledger pricing every write at the 5-minute
    rate, or at the read rate, settles below it)."""
    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
    policy = "Answer in the house style. " * 300

    def cached(self: BudgetTask) -> list[Any]:
        out = []
        for ttl in ("1h", "1h", None):
            marker: dict[str, Any] = {"type": "ephemeral"}
            if ttl:
                marker["ttl"] = ttl
            with_cache = [{"type": "text", "text": policy + (ttl or "5m"), "cache_control": marker}]
            message = claude.messages.create(
                model="claude-haiku-4-5",
                max_tokens=16,
                system=with_cache,
                messages=[{"role": "user", "content": "Hello"}],
            )
            usage = message.usage
            out.append(
                [
                    usage.cache_creation.ephemeral_1h_input_tokens,
                    usage.cache_creation.ephemeral_5m_input_tokens,
                    usage.cache_read_input_tokens,
                ]
            )
        return out

    written_1h, read_1h, written_5m = task(app, cached, "cache:1").delay().get()
    assert written_1h[0] > 1000 and written_1h[1:] == [0, 0]  # a 1-hour write
    assert read_1h[2] > 1000 and read_1h[:2] == [0, 0]  # then read
    assert written_5m[1] > 1000 and written_5m[0] == 0  # a 5-minute write
    charged = settled_at_the_bill(Ledger(backend_url), fake)
    assert len(charged) == 3
    served = posts(fake)
    assert served[0].billed > served[2].billed > served[1].billed  # 2x > 1.25x > 0.1x


def test_a_priority_call_settles_at_the_priority_rate_its_answer_names(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def tiers(self: BudgetTask) -> list[str | None]:
        return [
            oai.chat.completions.create(
                model="gpt-4o",
                max_completion_tokens=16,
                service_tier=tier,
                messages=[{"role": "user", "content": "Same words, same tokens."}],
            ).service_tier
            for tier in ("default", "priority", "flex")
        ]

    assert task(app, tiers, "tiers:1").delay().get() == ["default", "priority", "flex"]
    ledger = Ledger(backend_url)
    settled_at_the_bill(ledger, fake)
    # each call records the prices its bound came from
    from budget_tasks.pricing import default_prices

    versions = {a.price_version for a in ledger.attempts() if "#" not in a.key}
    assert versions == {default_prices().version}
    default, priority, flex = (s.billed for s in posts(fake))
    assert priority > default and {s.answered_by for s in posts(fake)} == {"gpt-4o-2024-08-06"}
    assert flex == default  # gpt-4o has no flex rates: billed at the standard ones


def test_a_message_batch_settles_at_the_batch_price_of_the_snapshots_that_answered(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """The batch's results name snapshot models (claude-haiku-4-5-20251001) and bill
    half: reconciliation settles it at the fake's bill, not at full price, and not left
    pending for an unknown model."""
    from datetime import timedelta

    from budget_tasks.beat import reconcile_unknown
    from budget_tasks.providers.registry import anthropic_client

    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)

    def batch(self: BudgetTask) -> str:
        requests = [
            {
                "custom_id": f"q{n}",
                "params": {
                    "model": "claude-haiku-4-5",
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"Question {n} " * 40}],
                },
            }
            for n in range(3)
        ]
        return str(claude.messages.batches.create(requests=requests).id)

    task(app, batch, "batch:half").delay().get()
    ledger = Ledger(backend_url)
    [sent] = [s for s in fake.served_as(ledger) if s.method == "POST"]
    lookups = anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
    assert reconcile_unknown(ledger, lambda kind: lookups, margin=timedelta(0))["found"] == 1
    [step] = [a for a in ledger.attempts() if a.key == sent.idempotency_key]
    assert (step.state, step.actual) == ("settled", sent.billed)
    # what the same tokens cost at full price: the batch billed (and settled) half
    results = list(lookups.messages.batches.results(ledger.attempt(step.key).response_id))
    assert {r.result.message.model for r in results} == {"claude-haiku-4-5-20251001"}
    full = sum(
        fake.prices.cost(
            r.result.message.model,
            Usage(
                input_tokens=r.result.message.usage.input_tokens,
                output_tokens=r.result.message.usage.output_tokens,
            ),
            provider="anthropic",
        )
        for r in results
    )
    assert sent.billed < full <= 2 * sent.billed
    assert ledger.balance("team").held == 0 and ledger.audit() == []


# -- 6. another installation's call is never adopted; keys leave the ledger opaque --------


def test_two_ledgers_on_one_api_key_never_find_or_replay_each_others_calls(
    fake: FakeProvider, tmp_path: Any
) -> None:
    """Staging and production, the same business key, the same API key: both calls time
    out after the provider billed and stored them. Each ledger's beat finds its own
    completion (by its own provider key), settles it at its own bill, and replays its
    own answer for its own document."""
    from datetime import timedelta

    import openai

    from budget_tasks.beat import reconcile_unknown
    from budget_tasks.providers.registry import openai_client

    lookups = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    slow = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    outcomes = {}
    for env, words in (("staging", 5), ("production", 400)):
        url = f"sqlite:///{tmp_path}/{env}.db"
        Ledger(url).create_schema()
        app = Celery(f"{env}-{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.conf.update(task_always_eager=True, task_eager_propagates=True, budget_ledger_url=url)
        Ledger(url).create_budget("team", 10_000_000)

        def summary(self: BudgetTask, doc: str, n: int = words) -> str:
            answer = slow.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=16,
                store=True,
                messages=[{"role": "user", "content": f"{doc} " * n}],
            )
            return str(answer.choices[0].message.content)

        job = task(app, summary, "summary:customer-42@example.com")
        fake.plan("hang=2", path="/chat/completions")
        with pytest.raises(openai.APITimeoutError):
            job.delay("minutes")
        outcomes[env] = (url, job)
    sent = posts(fake)
    assert len(sent) == 2 and sent[0].billed != sent[1].billed
    for s in sent:  # the business key (a customer's e-mail) never reached the provider
        assert "example.com" not in (s.idempotency_key or "")
    stored = lookups.chat.completions.list().data
    assert all("example.com" not in str(c.metadata) for c in stored)
    for n, (url, job) in enumerate(outcomes.values()):
        ledger = Ledger(url)
        assert reconcile_unknown(ledger, lambda kind: lookups, margin=timedelta(0))["found"] == 1
        [step] = [a for a in ledger.attempts() if "#" not in a.key]
        assert (step.state, step.actual) == ("settled", sent[n].billed)  # its own bill
        assert job.delay("minutes").get().startswith("fake")  # its own answer, replayed
        assert len(posts(fake)) == 2
        assert ledger.audit() == []


def test_a_found_answer_for_another_request_is_not_adopted(
    pg_ledger: Ledger, fake: FakeProvider
) -> None:
    """The completion stored under an attempt's provider key answers another request
    (its digest differs from the one the attempt recorded): reconciliation leaves the
    hold for an operator rather than adopt it."""
    from datetime import timedelta

    from budget_tasks.beat import reconcile_unknown
    from budget_tasks.providers.openai.lookups import ATTEMPT_METADATA_KEY, REQUEST_METADATA_KEY
    from budget_tasks.providers.registry import openai_client
    from tests.support.sdk_calls import LOOKUP_OPENAI_CHAT

    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    pg_ledger.create_budget("team", 1_000_000)
    pg_ledger.calls.reserve("team", "doc#1", 10_000)
    pg_ledger.calls.describe_attempt(
        "doc#1", lookup=LOOKUP_OPENAI_CHAT, model="gpt-4o-mini", timeout=1.0, request="a" * 64
    )
    pg_ledger.calls.mark_sending("doc#1")
    pg_ledger.calls.mark_unknown("doc#1", "timeout")
    client.chat.completions.create(
        model="gpt-4o-mini",
        max_completion_tokens=8,
        store=True,
        metadata={
            ATTEMPT_METADATA_KEY: pg_ledger.provider_key("doc#1"),
            REQUEST_METADATA_KEY: "b" * 64,
        },
        messages=[{"role": "user", "content": "another document"}],
    )
    counts = reconcile_unknown(pg_ledger, lambda kind: client, margin=timedelta(0))
    assert counts["unknowable"] == 1 and counts["found"] == 0
    assert pg_ledger.attempt("doc#1").state == "unknown"


# -- 7. a call with no finite timeout is never declared not found ----------------------------


def test_a_call_sent_without_a_timeout_is_never_declared_not_found(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """The provider may still be working on it whenever beat looks: "not found" proves
    nothing, however old the attempt. (Recorded before as no timeout at all, so beat
    used its own client's timeout plus the margin, released it, and the next delivery
    sent it again.)"""
    from datetime import timedelta

    from budget_tasks.beat import reconcile_unknown
    from budget_tasks.ledger.records import NO_TIMEOUT_MS
    from budget_tasks.providers.registry import openai_client
    from budget_tasks.testing import ManualClock

    unbounded = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=None)

    def forever(self: BudgetTask) -> str:
        answer = unbounded.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=8,
            store=True,
            messages=[{"role": "user", "content": "take your time"}],
        )
        return str(answer.id)

    fake.plan("reset", path="/chat/completions")  # billed; the answer never arrives
    fake.completion_storage = "off"  # and nothing is stored to find
    with pytest.raises(Exception, match=r"(?i)connection|disconnect"):
        task(app, forever, "forever:1").delay().get()
    ledger = Ledger(backend_url)
    [step] = [a for a in ledger.attempts() if "#" not in a.key]
    assert (step.state, step.timeout_ms) == ("unknown", NO_TIMEOUT_MS)
    client = openai_client(base_url=fake.openai_base_url, api_key="x", timeout=1.0)
    client.chat.completions.create(  # the store holds something: "none" would mean a lot
        model="gpt-4o-mini",
        max_completion_tokens=8,
        store=True,
        messages=[{"role": "user", "content": "x"}],
    )
    later = Ledger(backend_url, clock=ManualClock(ledger.now() + timedelta(days=30)))
    counts = reconcile_unknown(later, lambda kind: client, margin=timedelta(0))
    assert counts["not_found"] == 0 and counts["pending"] + counts["unknowable"] == 1
    assert later.attempt(step.key).state == "unknown"  # held: never released by a timer


# -- 8. async clients, parallel calls, and clients that bypass the guard ------------------


def test_guarded_async_clients_inside_run_are_metered_and_replay(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    import asyncio

    from budget_tasks.transport import (
        guarded_async_anthropic_client,
        guarded_async_openai_client,
    )

    def agent(self: BudgetTask) -> list[str]:
        async def calls() -> list[str]:
            oai = guarded_async_openai_client(
                base_url=fake.openai_base_url, api_key="x", timeout=5.0
            )
            claude = guarded_async_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)
            chat = await oai.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=16,
                messages=[{"role": "user", "content": "a"}],
            )
            words = []
            stream = await oai.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=16,
                stream=True,
                messages=[{"role": "user", "content": "b"}],
            )
            async for chunk in stream:
                words.append(chunk.choices[0].delta.content or "")
            message = await claude.messages.create(
                model="claude-haiku-4-5", max_tokens=16, messages=[{"role": "user", "content": "c"}]
            )
            return [
                str(chat.choices[0].message.content),
                "".join(words),
                str(message.content[0].text),
            ]

        return asyncio.run(calls())

    job = task(app, agent, "async:1")
    first = job.delay().get()
    assert all(text.strip().startswith("fake") for text in first)
    assert len(settled_at_the_bill(Ledger(backend_url), fake)) == 3
    assert job.delay().get() == first and len(posts(fake)) == 3  # replayed, not resent


def _gathered(fake: FakeProvider, labelled: bool) -> Any:
    import asyncio

    from budget_tasks.transport import call_label, guarded_async_openai_client

    async def branch(client: Any, name: str) -> str:
        async def ask() -> str:
            answer = await client.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=16,
                messages=[{"role": "user", "content": f"branch {name}"}],
            )
            return str(answer.choices[0].message.content)

        if not labelled:
            return await ask()
        with call_label(name):
            return await ask()

    def agent(self: BudgetTask) -> list[str]:
        async def fan_out() -> list[str]:
            client = guarded_async_openai_client(
                base_url=fake.openai_base_url, api_key="x", timeout=5.0
            )
            return list(await asyncio.gather(*(branch(client, n) for n in ("a", "b", "c"))))

        return asyncio.run(fan_out())

    return agent


def _settled_down(ledger: Ledger, prefix: str) -> list[Any]:
    """The attempts under ``prefix`` once none is reserved any more: a cancelled
    branch's admission, off the event loop, is given back on its own thread."""
    deadline = time.monotonic() + 10
    while True:
        found = [a for a in ledger.attempts() if a.key.startswith(prefix)]
        if all(a.state != "reserved" for a in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_asyncio_gather_of_unlabelled_calls_is_refused_and_labelled_branches_replay(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    from budget_tasks.transport import ParallelCallsUnlabelled

    with pytest.raises(ParallelCallsUnlabelled, match="call_label"):
        task(app, _gathered(fake, labelled=False), "gather:plain").delay().get()
    # the second branch was refused before it was reserved or sent; the first was
    # cancelled with the rest of the loop: out already, its hold is kept (it may have
    # been sent), never released by guess; still being admitted (off the event loop),
    # it is released, and nothing was sent under it
    ledger = Ledger(backend_url)
    plain = _settled_down(ledger, "gather:plain:")
    assert [a.key for a in plain] == ["gather:plain:openai.chat:1"]
    if plain[0].state == "released":
        assert len(posts(fake)) == 0
    else:
        assert plain[0].state in ("settled", "unknown") and len(posts(fake)) <= 1
    sent = len(posts(fake))
    job = task(app, _gathered(fake, labelled=True), "gather:labelled")
    first = job.delay().get()
    labelled = sorted(a.key for a in ledger.attempts() if a.key.startswith("gather:labelled:"))
    assert labelled == [f"gather:labelled:{n}/openai.chat:1" for n in ("a", "b", "c")]
    assert job.delay().get() == first and len(posts(fake)) == sent + 3  # each at its place


def test_threads_fanning_out_inside_run_need_a_label_per_branch(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """A ThreadPoolExecutor inside run: its threads find the run; unlabelled branches
    would take positions in whatever order the threads reach them, so they are refused;
    labelled, each branch keeps its position whatever order they finish in, and a
    redelivery replays each answer at its own position."""
    import random
    import time
    from concurrent.futures import ThreadPoolExecutor

    from budget_tasks.transport import ParallelCallsUnlabelled, call_label

    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def ask(topic: str, labelled: bool) -> str:
        time.sleep(random.uniform(0, 0.05))  # the threads race
        request = {
            "model": "gpt-4o-mini",
            "max_completion_tokens": 16,
            "messages": [{"role": "user", "content": f"About {topic}, at length: " + topic * 50}],
        }
        if not labelled:
            return str(oai.chat.completions.create(**request).choices[0].message.content)
        with call_label(topic):
            return str(oai.chat.completions.create(**request).choices[0].message.content)

    def fan_out(self: BudgetTask, labelled: bool) -> list[str]:
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda t: ask(t, labelled), ["tides", "moon", "wind", "sand"]))

    with pytest.raises(ParallelCallsUnlabelled):
        task(app, fan_out, "threads:plain").delay(False).get()
    sent_unlabelled = len(posts(fake))
    # only the thread that took the unlabelled positions first sent (its own calls, one
    # after another); every other thread was refused before reserving
    assert sent_unlabelled < 4
    steps = [a for a in Ledger(backend_url).attempts() if a.key.startswith("threads:plain:")]
    assert len(steps) == sent_unlabelled
    job = task(app, fan_out, "threads:labelled")
    first = job.delay(True).get()
    ledger = Ledger(backend_url)
    keys = sorted(a.key for a in ledger.attempts() if a.key.startswith("threads:labelled:"))
    assert keys == sorted(
        f"threads:labelled:{t}/openai.chat:1" for t in ("tides", "moon", "wind", "sand")
    )
    assert job.delay(True).get() == first  # replayed at their positions, in any order
    assert len(posts(fake)) == sent_unlabelled + 4


def test_labels_open_around_a_pool_reach_its_threads_only_with_the_runs_context(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """Nested labels across a ThreadPoolExecutor. Threads started without the run's
    context find the run but not the labels open around the pool: their calls are
    refused before anything is reserved (before, the outer label was dropped, and two
    phases reusing the pool with the same inner labels met at one path, raced by
    whichever thread ran them). With the context copied into each submission, every
    call sits at <phase>/<topic>, both phases reuse one pool, and a redelivery replays
    every answer at its own position."""
    import contextvars
    import random
    import time
    from concurrent.futures import ThreadPoolExecutor, wait

    from budget_tasks.transport import LabelsLost, call_label

    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)
    topics = ["tides", "moon", "wind"]

    def ask(phase: str, topic: str) -> str:
        time.sleep(random.uniform(0, 0.03))  # the threads race
        request = {
            "model": "gpt-4o-mini",
            "max_completion_tokens": 16,
            "messages": [{"role": "user", "content": f"{phase} {topic}"}],
        }
        with call_label(topic):
            return str(oai.chat.completions.create(**request).choices[0].message.content)

    def phases(self: BudgetTask, copy_context: bool) -> list[str]:
        out: list[str] = []
        with ThreadPoolExecutor(3) as pool:  # one pool for both phases
            for phase in ("draft", "review"):
                with call_label(phase):
                    if copy_context:
                        futures = [
                            pool.submit(contextvars.copy_context().run, ask, phase, t)
                            for t in topics
                        ]
                    else:
                        futures = [pool.submit(ask, phase, t) for t in topics]
                    wait(futures)  # every branch ends inside its phase's label
                    out += [f.result() for f in futures]
        return out

    with pytest.raises(LabelsLost, match="copy_context"):
        task(app, phases, "pool:plain").delay(False).get()
    ledger = Ledger(backend_url)
    assert posts(fake) == []
    assert [a.key for a in ledger.attempts() if a.key.startswith("pool:plain:")] == []
    job = task(app, phases, "pool:context")
    first = job.delay(True).get()
    keys = sorted(a.key for a in ledger.attempts() if a.key.startswith("pool:context:"))
    assert keys == sorted(
        f"pool:context:{phase}/{t}/openai.chat:1" for phase in ("draft", "review") for t in topics
    )
    assert len(posts(fake)) == 6
    assert job.delay(True).get() == first  # replayed, each at its own position
    assert len(posts(fake)) == 6


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_plain_sdk_client_inside_run_is_refused_before_it_connects(
    app: Celery, fake: FakeProvider, backend_url: str, kind: str
) -> None:
    """An SDK client built without the guard, sync or async, inside a task: its
    connection to the provider is refused when it opens (the audit hook), so nothing
    reaches the provider unmetered."""
    import asyncio

    import openai

    from budget_tasks.bypass import unmetered
    from budget_tasks.errors import UnmeteredConnection

    def plain(self: BudgetTask) -> str:
        if kind == "sync":
            client = openai.OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
            return str(
                client.chat.completions.create(
                    model="gpt-4o-mini",
                    max_completion_tokens=8,
                    messages=[{"role": "user", "content": "hi"}],
                ).id
            )

        async def call() -> str:
            client = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
            answer = await client.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=8,
                messages=[{"role": "user", "content": "hi"}],
            )
            return str(answer.id)

        return asyncio.run(call())

    guarded_openai_client(base_url=fake.openai_base_url, api_key="x")  # the provider is known
    with pytest.raises(UnmeteredConnection, match="not guarded"):
        task(app, plain, f"bypass:{kind}").delay().get()
    assert fake.served() == []
    # outside a task the same client is the user's business; and unmetered() lets an
    # unbilled lookup through inside one, on purpose
    client = openai.OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
    assert client.models is not None

    def lookup(self: BudgetTask) -> int:
        with unmetered(), pytest.raises(openai.NotFoundError):
            client.chat.completions.retrieve("chatcmpl-none")
        return 1

    assert task(app, lookup, f"lookup:{kind}").delay().get() == 1
    assert [s.method for s in fake.served()] == ["GET"]


# -- a gateway registered as a vendor of its own -------------------------------------------


def test_an_openai_compatible_gateway_is_a_vendor_of_its_own_for_the_transport_and_beat(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """Registered with its host, a gateway's requests are judged by its rules, recorded
    under its lookups, and reconciled by beat through its own client."""
    from datetime import timedelta

    import openai

    from budget_tasks.beat import reconcile_unknown
    from budget_tasks.providers import OpenAI, registry
    from budget_tasks.providers.registry import openai_client
    from budget_tasks.transport import guarded_http_client

    gateway = OpenAI("gateway", hosts=["localhost"], price_provider="openai")
    registry.register(gateway)
    try:
        base = f"http://localhost:{fake.port}/v1"
        client = openai.OpenAI(
            base_url=base, api_key="x", max_retries=0, http_client=guarded_http_client(timeout=1.0)
        )

        def ask(self: BudgetTask) -> str:
            return str(
                client.chat.completions.create(
                    model="gpt-4o-mini",
                    max_completion_tokens=8,
                    store=True,
                    messages=[{"role": "user", "content": "through the gateway"}],
                )
                .choices[0]
                .message.content
            )

        job = task(app, ask, "gw:1")
        fake.plan("hang=2", path="/chat/completions")
        with pytest.raises(openai.APITimeoutError):
            job.delay().get()
        ledger = Ledger(backend_url)
        [step] = [a for a in ledger.attempts() if "#" not in a.key]
        assert (step.key, step.lookup, step.state) == (
            "gw:1:gateway.chat:1",
            "gateway.chat",
            "unknown",
        )
        asked: list[str] = []

        def clients(kind: str) -> Any:
            asked.append(kind)
            return openai_client(base_url=base, api_key="x", timeout=5.0)

        assert reconcile_unknown(ledger, clients, margin=timedelta(0))["found"] == 1
        assert asked and set(asked) == {"gateway"}
        assert ledger.attempt(step.key).actual == posts(fake)[0].billed
        assert job.delay().get().startswith("fake")  # the found answer, replayed
    finally:
        registry.unregister("gateway")
    assert registry.route("POST", "localhost", "/v1/chat/completions").vendor is not gateway


def test_a_kind_fake_hides_the_compression_bug_the_realistic_one_shows(
    app: Celery, fake: FakeProvider, backend_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport as it was (the decoded body handed on with its Content-Encoding)
    passes against a fake that does not compress, and fails against one that does, as
    the real APIs do: the realistic default is what makes the suite catch it."""
    import openai

    from budget_tasks.testing import Realism
    from budget_tasks.transport import guard

    monkeypatch.setattr(
        guard,
        "decoded_headers",
        lambda headers: [(k, v) for k, v in headers.items() if k.lower() != "content-length"],
    )
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def once(self: BudgetTask, n: int) -> str:
        return str(
            oai.chat.completions.create(
                model="gpt-4o-mini",
                max_completion_tokens=8,
                messages=[{"role": "user", "content": f"call {n}"}],
            ).id
        )

    job = app.task(
        base=BudgetTask,
        bind=True,
        name=f"kind-{uuid.uuid4().hex[:6]}",
        budget="team",
        idempotency_key=lambda n: f"kind:{n}",
        estimate_cost=lambda n: 0,
    )(once)
    fake.realism = Realism().without("compress")
    assert job.delay(1).get()  # the kind fake: nothing to see
    fake.realism = Realism()
    with pytest.raises(openai.APIConnectionError):
        job.delay(2).get()  # compressed, as the real APIs answer: decoded twice
    [lost] = [a for a in Ledger(backend_url).attempts() if a.key.startswith("kind:2:")]
    assert lost.state == "unknown"  # billed, and the answer lost: the old failure


# -- streams left early, streams of legacy completions, a stream whose usage is garbled ----


def test_an_anthropic_stream_left_before_its_final_counts_keeps_its_hold(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    """Its first event carries the input and one output token; the rest comes at the
    end. Left early, it is not settled at that one token: the hold stays unknown."""
    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)

    def early(self: BudgetTask) -> str:
        with claude.messages.stream(
            model="claude-haiku-4-5",
            max_tokens=4000,
            messages=[{"role": "user", "content": "Tell me everything."}],
        ) as events:
            for text in events.text_stream:
                return text  # the caller has what it needs and leaves
        return ""

    task(app, early, "early:1").delay().get()
    [step] = [a for a in Ledger(backend_url).attempts() if "#" not in a.key]
    assert step.state == "unknown" and step.actual is None
    assert Ledger(backend_url).balance("team").held == step.amount


def test_a_streamed_legacy_completion_asks_for_its_usage_and_settles_at_the_bill(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def streamed(self: BudgetTask) -> str:
        return "".join(
            chunk.choices[0].text
            for chunk in oai.completions.create(
                model="gpt-3.5-turbo-instruct", prompt="Once", max_tokens=12, stream=True
            )
            if chunk.choices
        )

    assert task(app, streamed, "legacy-stream:1").delay().get().strip().startswith("fake")
    settled_at_the_bill(Ledger(backend_url), fake)


def test_a_stream_whose_usage_cannot_be_read_ends_unknown_not_sending(
    app: Celery, fake: FakeProvider, backend_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from budget_tasks.errors import UsageUnreadable
    from budget_tasks.transport import guard

    def garbled(*args: Any, **kwargs: Any) -> Any:
        raise UsageUnreadable("usage", "???")

    monkeypatch.setattr(guard, "sent_of_stream", garbled)
    oai = guarded_openai_client(base_url=fake.openai_base_url, api_key="x", timeout=5.0)

    def streamed(self: BudgetTask) -> int:
        stream = oai.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=8,
            stream=True,
            messages=[{"role": "user", "content": "Stream."}],
        )
        return sum(1 for _ in stream)

    task(app, streamed, "garbled:1").delay().get()
    [step] = [a for a in Ledger(backend_url).attempts() if "#" not in a.key]
    assert step.state == "unknown"  # not left 'sending', its position given back


def test_anthropics_overloaded_529_is_not_billed_and_the_retry_is_a_new_attempt(
    app: Celery, fake: FakeProvider, backend_url: str
) -> None:
    import anthropic

    claude = guarded_anthropic_client(base_url=fake.url, api_key="x", timeout=5.0)

    def ask(self: BudgetTask) -> str:
        message = claude.messages.create(
            model="claude-haiku-4-5", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
        return str(message.content[0].text)

    job = task(app, ask, "overloaded:1")
    fake.plan("status=529", path="/v1/messages")
    with pytest.raises(anthropic.APIStatusError) as raised:
        job.delay().get()
    assert raised.value.status_code == 529
    ledger = Ledger(backend_url)
    [first] = [a for a in ledger.attempts() if "#" not in a.key]
    assert (first.state, first.actual) == ("released", 0)  # overloaded: nothing was billed
    assert ledger.operation("overloaded:1").status == "retryable"
    assert job.delay().get().startswith("fake")  # the retry: a new attempt, its own hold
    keys = sorted(a.key for a in ledger.attempts() if "#" not in a.key)
    assert keys == ["overloaded:1:anthropic.messages:1", "overloaded:1:anthropic.messages:1~2"]
