"""No key at rest: an API key never lands in the ledger or a log, a request the HTTP
library refused before a byte left releases its hold, and keys and labels that no
header or log line may carry are refused before anything is reserved."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import BudgetTask, Ledger, UnusableApiKey
from budget_tasks.providers import estimates
from budget_tasks.testing import FakeProvider
from budget_tasks.transport import guarded_openai_client
from tests.support import Worker
from tests.support.sdk_calls import openai_chat

from ..services import pg_conninfo

#: recognisable wherever it lands
KEY = "sk-budgettasks-LEAKCHECK-7f3a9c2e"
REQUEST = {
    "model": "gpt-4o-mini",
    "max_completion_tokens": 16,
    "messages": [{"role": "user", "content": "Summarise the minutes."}],
}


def dump(url: str) -> str:
    """The whole database as SQL (schema and every row), as pg_dump writes it."""
    done = subprocess.run(
        ["pg_dump", "--no-owner", pg_conninfo(url)], capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.parametrize("ending", ["", "\n"], ids=["clean-key", "key-with-newline"])
def test_a_workers_key_is_nowhere_in_the_database_or_the_worker_log(
    client: Celery,
    start_worker: Callable[..., Worker],
    fake: FakeProvider,
    pg_ledger: Ledger,
    pg_url: str,
    ending: str,
) -> None:
    """A real worker calls through a client its team built, with a key as a secret file
    hands it over. Clean, the call is made and billed; with its newline, the HTTP
    library refuses the header before a byte leaves (quoting the key in its error):
    the hold is released, not left unknown, and neither the ledger nor the log (the
    task's failure, traceback and all) shows the key."""
    worker = start_worker(LEAK_TEST_KEY=KEY + ending)
    result = client.send_task("tests.own_client_summary", args=["doc-1", "Board minutes."])
    if ending:
        with pytest.raises(Exception, match="Connection error"):
            result.get(timeout=60)
        assert fake.served() == []
    else:
        assert result.get(timeout=60)
        assert len(fake.served()) == 1
    [attempt] = pg_ledger.attempts()
    assert attempt.state == ("released" if ending else "settled")
    if ending:
        assert "never sent" in (attempt.note or "") or "not billed" in (attempt.note or "")
        assert pg_ledger.operation("own-client:doc-1").status == "retryable"
    assert pg_ledger.audit() == []
    worker.stop()
    log = worker.log_path.read_text()
    database = dump(pg_url)
    assert "own-client:doc-1" in database  # the dump holds the ledger's rows
    for written in (database, log):
        assert KEY not in written
        assert KEY[len("sk-") :] not in written
    if ending:
        # the refusal was logged, the key in it redacted
        assert "Illegal header value b'[redacted]'" in log


@pytest.fixture
def app(backend_url: str, fake: FakeProvider) -> Any:
    prefix = f"secrets{uuid.uuid4().hex[:8]}"
    app = Celery("secrets-tests", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, budget_ledger_url=backend_url
    )

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.own",
        budget="team",
        idempotency_key=lambda key, n: f"own:{n}",
        estimate_cost=lambda key, n: estimates.openai_chat(REQUEST).amount,
    )
    def own(self: BudgetTask, key: str, n: int) -> str:
        client = openai.OpenAI(base_url=fake.openai_base_url, api_key=key, max_retries=0)
        return str(openai_chat(client, attempt=self.attempt, **REQUEST).result["content"])

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.keyed",
        budget="team",
        idempotency_key=lambda key: key,
        estimate_cost=lambda key: 0,
    )
    def keyed(self: BudgetTask, key: str) -> str:
        return key

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.labelled",
        budget="team",
        idempotency_key=lambda label: "labelled",
        estimate_cost=lambda label: 0,
    )
    def labelled(self: BudgetTask, label: str) -> None:
        with self.spend(100, label):
            pass

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.gateway",
        budget="team",
        idempotency_key=lambda: "gateway",
        estimate_cost=lambda: 0,
    )
    def gateway(self: BudgetTask) -> None:
        # a gateway's own key, in a header of the team's, read with its newline
        guarded = guarded_openai_client(
            base_url=fake.openai_base_url,
            api_key="sk-fake",
            default_headers={"x-gateway-key": KEY + "\n"},
        )
        guarded.chat.completions.create(**REQUEST)

    app.jobs = {"own": own, "keyed": keyed, "labelled": labelled, "gateway": gateway}
    Ledger(backend_url).create_budget("team", 10_000_000)
    return app


@pytest.mark.parametrize("key", [KEY + "\n", "sk-budgettasks-LEAKCHÉCK"], ids=["newline", "é"])
def test_a_request_the_http_library_refused_releases_its_hold_and_keeps_no_key(
    app: Any, fake: FakeProvider, backend_url: str, key: str
) -> None:
    """A line break (h11 refuses the header) or a byte outside ASCII (httpx cannot
    encode it): refused as the request is built, so it is never sent: released."""
    with pytest.raises((openai.APIConnectionError, UnicodeEncodeError)):
        app.jobs["own"].delay(key, 1).get()
    assert fake.served() == []
    ledger = Ledger(backend_url)
    [attempt] = ledger.attempts()
    assert attempt.state == "released"
    assert "LEAKCH" not in (attempt.note or "")
    assert "LEAKCH" not in (ledger.operation("own:1").error or "")
    assert ledger.balance("team").held == 0


def test_a_header_refused_inside_the_guarded_transport_releases_its_hold(
    app: Any, fake: FakeProvider, backend_url: str
) -> None:
    with pytest.raises(openai.APIConnectionError):
        app.jobs["gateway"].delay().get()
    assert fake.served() == []
    ledger = Ledger(backend_url)
    [attempt] = [a for a in ledger.attempts() if a.label is not None]  # the transport's
    assert attempt.state == "released"
    assert "Illegal header value b'[redacted]'" in (attempt.note or "")
    assert "LEAKCHECK" not in (attempt.note or "")


@pytest.mark.parametrize("builder", ["guarded", "plain"])
@pytest.mark.parametrize("key", [KEY + "\n", KEY + " ", "sk-é" + KEY])
def test_a_key_no_header_may_carry_is_refused_as_the_client_is_built(
    builder: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from budget_tasks.providers.registry import openai_client

    build = guarded_openai_client if builder == "guarded" else openai_client
    with pytest.raises(UnusableApiKey) as refused:
        build(api_key=key, base_url="http://127.0.0.1:9/v1")
    assert "LEAKCHECK" not in str(refused.value)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    with pytest.raises(UnusableApiKey, match="OPENAI_API_KEY"):
        build(base_url="http://127.0.0.1:9/v1")


@pytest.mark.parametrize(
    "key", ["line\nbreak", "carriage\rreturn", "tab\there", "résumé", "esc\x1b[2J"]
)
def test_an_idempotency_key_no_header_or_log_line_may_carry_is_refused_before_any_hold(
    app: Any, backend_url: str, key: str
) -> None:
    with pytest.raises(ValueError, match="idempotency key must be printable ASCII"):
        app.jobs["keyed"].delay(key).get()
    ledger = Ledger(backend_url)
    assert ledger.attempts() == [] and ledger.operations() == []


@pytest.mark.parametrize("label", ["two\nlines", "café"])
def test_a_label_no_header_or_log_line_may_carry_is_refused_before_its_hold(
    app: Any, backend_url: str, label: str
) -> None:
    with pytest.raises(ValueError, match="label must be printable ASCII"):
        app.jobs["labelled"].delay(label).get()
    ledger = Ledger(backend_url)
    assert [a.label for a in ledger.attempts() if a.label is not None] == []
    assert ledger.balance("team").held == 0


def test_the_widest_printable_ascii_key_is_accepted(app: Any, backend_url: str) -> None:
    key = "".join(chr(c) for c in range(0x20, 0x7F)).strip()
    assert app.jobs["keyed"].delay(key).get() == key
    assert Ledger(backend_url).operation(key).status == "succeeded"


def test_the_ledger_stores_no_credential_whoever_writes_the_note(backend_url: str) -> None:
    """The ledger's own boundary: a note or an error written through its API (a team's
    own mark_unknown, an operator's resolve, a refusal) is stored redacted, in the
    attempt and in the journal."""
    ledger = Ledger(backend_url)
    ledger.create_budget("team", 1_000)
    ledger.calls.reserve("team", "k1", 10)
    ledger.calls.mark_sending("k1")
    ledger.calls.mark_unknown("k1", f"Illegal header value b'Bearer {KEY}\\n'")
    assert "LEAKCHECK" not in (ledger.attempt("k1").note or "")
    ledger.resolve_attempt("k1", 5, note=f"invoice says api_key={KEY}", by="operator")
    note = str(ledger.attempt("k1").note)
    with ledger.engine.connect() as conn:
        journal = [str(r[0]) for r in conn.execute(text("SELECT note FROM journal"))]
    assert "LEAKCHECK" not in note + " ".join(journal)
    assert "[redacted]" in note and any("[redacted]" in n for n in journal)
