"""What the ledger keeps of users' content, and for how long: a size cap on what is
stored for replay, and a purge that removes every copy past its retention. The
official SDK calls a gateway (tests/hostile_gateway.py) over HTTP inside BudgetTask runs
(eager) on a real ledger (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import uuid
from datetime import timedelta
from typing import Any

import openai
import pytest
from celery import Celery
from sqlalchemy import text

from budget_tasks import AnswerNotKept, BudgetTask, Ledger, OperationFailed
from budget_tasks.beat import purge_expired_operations
from budget_tasks.ledger.records import NOT_KEPT, kept
from budget_tasks.transport import guarded_openai_client

from ..hostile_gateway import HostileGateway
from ..services import pg_conninfo

CAP = 4_096


@pytest.fixture
def app(backend_url: str, gateway: HostileGateway) -> Any:
    prefix = f"stored{uuid.uuid4().hex[:8]}"
    app = Celery("stored-tests", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        budget_ledger_url=backend_url,
        budget_max_stored_bytes=CAP,
    )
    client = guarded_openai_client(base_url=gateway.openai_base_url, api_key="x", timeout=5.0)
    failures: dict[str, int] = {}

    def ask(prompt: str, mode: str = "echo") -> str:
        answer = client.chat.completions.create(
            model="gpt-4o-mini",
            max_completion_tokens=16,
            messages=[{"role": "user", "content": prompt}],
            extra_headers={"x-hostile": mode},
        )
        return str(answer.choices[0].message.content)

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.work",
        budget="team",
        idempotency_key=lambda key, prompt, mode="echo", fail_once=False: key,
        estimate_cost=lambda key, prompt, mode="echo", fail_once=False: 0,
    )
    def work(
        self: BudgetTask, key: str, prompt: str, mode: str = "echo", fail_once: bool = False
    ) -> dict[str, Any]:
        answer = ask(prompt, mode)
        noted = self.once("note", lambda: f"noted {answer}")
        if fail_once and not failures.get(key):
            failures[key] = 1
            raise ValueError(f"the answer did not parse: {answer}")
        return {"answer": answer, "noted": noted}

    @app.task(
        base=BudgetTask,
        bind=True,
        name=f"{prefix}.long",
        budget="team",
        idempotency_key=lambda size: f"long:{size}",
        estimate_cost=lambda size: 0,
    )
    def long(self: BudgetTask, size: int) -> str:
        return "y" * size

    app.jobs = {"work": work, "long": long}
    Ledger(backend_url).create_budget("team", 10_000_000)
    return app


def everything(url: str) -> str:
    """Every row of every table, as the database itself dumps them."""
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return "\n".join(conn.iterdump())
    done = subprocess.run(
        ["pg_dump", "--no-owner", "--data-only", pg_conninfo(url)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_the_purge_leaves_no_copy_of_a_prompt_or_its_answer_anywhere(
    app: Any, gateway: HostileGateway, backend_url: str
) -> None:
    """Three operations hold a prompt and its answer in every place the ledger keeps
    content: a finished one (its result, a labelled call's stored answer, a once()
    result, its arguments), a failed one (its error quotes the answer) and one left
    unknown (its arguments; its call's answer never arrived). After the purge, a dump
    of the whole database holds neither, and the money is as it was."""
    mark = f"PROMPT-{uuid.uuid4().hex}"
    app.jobs["work"].delay("done", f"{mark} one").get()
    with pytest.raises(ValueError, match="did not parse"):
        app.jobs["work"].delay("failed", f"{mark} two", fail_once=True).get()
    with pytest.raises(openai.APIConnectionError):  # no answer: the outcome is unknown
        app.jobs["work"].delay("open", f"{mark} three", "reset").get()
    ledger = Ledger(backend_url)
    assert ledger.operation("open").status == "unknown"
    before = everything(backend_url)
    assert before.count(mark) >= 8  # arguments, results, answers, once(), the error
    assert f"ECHO:{mark}" in before
    with ledger.engine.connect() as conn:
        journal = conn.execute(text("SELECT * FROM journal ORDER BY id")).all()
    balance = ledger.balance("team")

    purged = purge_expired_operations(ledger, timedelta(0))

    assert (purged.operations, purged.unfinished) == (2, 1)
    # the calls' answers are stored as side effects; their attempts carry no content
    assert purged.side_effects >= 4
    after = everything(backend_url)
    assert mark not in after
    assert "ECHO:" not in after
    with ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT * FROM journal ORDER BY id")).all() == journal
    assert ledger.balance("team") == balance
    assert ledger.audit() == []
    assert ledger.operation("failed").error is None
    with pytest.raises(OperationFailed, match="purged after the retention period"):
        app.jobs["work"].delay("failed", f"{mark} two", fail_once=True).get()
    # a second purge finds nothing left to remove
    assert purge_expired_operations(ledger, timedelta(0)).total == 0
    # the finished operation still replays (its result gone: None), never resends
    posts = len(gateway.posts())
    assert app.jobs["work"].delay("done", f"{mark} one").get() is None
    assert len(gateway.posts()) == posts


def test_nothing_younger_than_the_retention_is_purged(app: Any, backend_url: str) -> None:
    app.jobs["work"].delay("recent", "PROMPT-recent").get()
    ledger = Ledger(backend_url)
    assert purge_expired_operations(ledger, timedelta(hours=1)).total == 0
    assert ledger.operation("recent").result["answer"] == "ECHO:PROMPT-recent"


def test_an_answer_past_the_cap_keeps_only_its_digest_and_its_replay_is_refused(
    app: Any, gateway: HostileGateway, backend_url: str
) -> None:
    """The first run gets the whole answer; what is stored is its sha256 and size. A
    later run that would replay that call is refused, and the call is not sent again."""
    size = 50_000
    with pytest.raises(ValueError, match="did not parse"):
        app.jobs["work"].delay("big", "a long one", f"huge={size}", fail_once=True).get()
    ledger = Ledger(backend_url)
    with ledger.engine.connect() as conn:
        stored = conn.execute(text("SELECT name, result FROM side_effects")).all()
    call = next(json.loads(r) for n, r in stored if n != "once:note")
    marker = call[NOT_KEPT]
    assert marker["bytes"] > size and marker["limit"] == CAP and len(marker["sha256"]) == 64
    assert all(len(r) < 1_000 for _, r in stored)
    ledger.reopen_operation("big", reason="try again", by="test")
    with pytest.raises(AnswerNotKept, match=f"past the size cap of {CAP}"):
        app.jobs["work"].delay("big", "a long one", f"huge={size}", fail_once=True).get()
    assert len(gateway.posts()) == 1  # paid for once, never sent again
    assert ledger.audit() == []


def test_a_result_past_the_cap_is_returned_once_and_its_replay_is_refused(
    app: Any, backend_url: str
) -> None:
    assert app.jobs["long"].delay(CAP * 3).get() == "y" * (CAP * 3)
    with pytest.raises(AnswerNotKept, match="only its sha256"):
        app.jobs["long"].delay(CAP * 3).get()
    ledger = Ledger(backend_url)
    assert NOT_KEPT in ledger.operation(f"long:{CAP * 3}").result


def test_a_result_exactly_at_the_cap_is_kept_one_byte_more_is_not(
    app: Any, backend_url: str
) -> None:
    at_cap = CAP - len(json.dumps(""))  # the JSON of the string is exactly CAP bytes
    assert len(json.dumps("y" * at_cap)) == CAP
    app.jobs["long"].delay(at_cap).get()
    assert app.jobs["long"].delay(at_cap).get() == "y" * at_cap  # replayed whole
    app.jobs["long"].delay(at_cap + 1).get()
    with pytest.raises(AnswerNotKept):
        app.jobs["long"].delay(at_cap + 1).get()


def test_kept_counts_bytes_not_characters() -> None:
    encoded = json.dumps("é" * 10, ensure_ascii=False)  # 22 bytes, 12 characters
    assert kept(encoded, 22) == encoded
    assert NOT_KEPT in json.loads(kept(encoded, 21))


def test_the_purge_reads_only_what_is_left_to_purge_and_commits_in_batches(
    pg_ledger: Ledger,
) -> None:
    """On a ledger whose history is 20,000 purged rows of each kind and whose content
    is 5 rows, each purge statement reads through its partial index (the plan
    PostgreSQL picks, after ANALYZE), and a purge of 5 operations in batches of 2
    commits three times."""
    from sqlalchemy import event

    from budget_tasks.ledger import statements as sql

    pg_ledger.create_budget("team", 10**12)
    period = pg_ledger.upkeep.open_period("team")
    history, content = 20_000, 5
    old = pg_ledger.now() - timedelta(days=30)
    with pg_ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO operations (key, fingerprint, status, runs, deliveries, replays,"
                " created_at, updated_at, completed_at, result)"
                " SELECT 'op-' || n, 'f', 'succeeded', 1, 1, 0, :old, :old, :old,"
                " CASE WHEN n <= :content THEN '\"answer\"' END"
                " FROM generate_series(1, :total) AS n"
            ),
            {"content": content, "total": history + content, "old": old},
        )
        conn.execute(
            text(
                "INSERT INTO side_effects (operation_id, name, state, result, created_at,"
                " completed_at) SELECT id, 'once:x', 'done',"
                " CASE WHEN key IN ('op-1','op-2','op-3','op-4','op-5') THEN '1' END,"
                " completed_at, completed_at FROM operations"
            )
        )
        conn.execute(
            text(
                "INSERT INTO attempts (key, budget_id, period_id, reason, amount, actual,"
                " state, created_at, resolved_at, note)"
                " SELECT o.key || '#1', b.id, p.id, 'first', 10, 10, 'settled',"
                " o.completed_at, o.completed_at,"
                " CASE WHEN o.result IS NOT NULL THEN 'billed, then an error' END"
                " FROM operations o, budgets b JOIN budget_periods p ON p.budget_id = b.id"
                " WHERE b.name = 'team' AND p.period_start = :start"
            ),
            {"start": period.period_start},
        )
        conn.execute(text("ANALYZE"))
        params = {"cutoff": pg_ledger.now(), "marker": "m", "batch": 1_000}
        for statement, index in (
            (sql.PURGE_OPERATIONS, "ix_operations_purgeable"),
            (sql.PURGE_UNFINISHED_PAYLOADS, "ix_operations_waiting_payload"),
            (sql.PURGE_SIDE_EFFECTS, "ix_side_effects_purgeable"),
            (sql.PURGE_ATTEMPTS, "ix_attempts_purgeable"),
        ):
            plan = "\n".join(r[0] for r in conn.execute(text("EXPLAIN " + statement), params))
            assert index in plan, plan

    commits: list[object] = []
    event.listen(pg_ledger.engine, "commit", lambda conn: commits.append(conn))
    purged = pg_ledger.upkeep.purge_operations(timedelta(days=1), batch=2)
    assert (purged.operations, purged.side_effects, purged.attempts) == (5, 5, 5)
    # operations 2+2+1, unfinished 0, side effects 2+2+1, attempts 2+2+1
    assert len(commits) == 3 + 1 + 3 + 3
    with pg_ledger.engine.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM operations WHERE result IS NOT NULL")
        ).scalar()
    assert left == 0
