"""The alembic migrations and ``Ledger.create_schema()`` give the same database."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from budget_tasks import Ledger
from budget_tasks.ledger.schema import metadata
from budget_tasks.ledger.store import Store
from budget_tasks.migrations import current, include_object, upgrade

from ..services import check_postgres, pg_conninfo, scratch_database

#: The latest revision: bumped by each new migration.
HEAD = "0023"


def describe(url: str) -> dict[str, Any]:
    """Tables, columns, keys, constraints, indexes and triggers, in comparable form."""
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        shape: dict[str, Any] = {}
        for table in sorted(t for t in insp.get_table_names() if t != "alembic_version"):
            shape[table] = {
                "columns": [
                    (c["name"], str(c["type"]), c["nullable"], c.get("default"))
                    for c in insp.get_columns(table)
                ],
                "pk": insp.get_pk_constraint(table),
                "fks": sorted(
                    (
                        fk["name"],
                        tuple(fk["constrained_columns"]),
                        fk["referred_table"],
                        tuple(sorted((fk.get("options") or {}).items())),  # deferred?
                    )
                    for fk in insp.get_foreign_keys(table)
                ),
                "uniques": sorted(
                    (u["name"], tuple(u["column_names"]))
                    for u in insp.get_unique_constraints(table)
                ),
                "checks": sorted(
                    (c["name"], c["sqltext"]) for c in insp.get_check_constraints(table)
                ),
                "indexes": sorted(
                    (
                        i["name"],
                        tuple(i["column_names"]),
                        i["unique"],
                        str(i.get("dialect_options", {}).get("postgresql_where")),  # partial?
                    )
                    for i in insp.get_indexes(table)
                ),
            }
    finally:
        engine.dispose()
    with psycopg.connect(pg_conninfo(url)) as conn:
        shape["triggers"] = conn.execute(
            "SELECT tgname, tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE NOT tgisinternal ORDER BY tgname, tgrelid::regclass::text"
        ).fetchall()
        shape["functions"] = conn.execute(
            "SELECT proname, prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'public' ORDER BY proname"
        ).fetchall()
    return shape


def test_migrations_and_create_schema_give_the_same_database() -> None:
    check_postgres()
    with scratch_database() as migrated, scratch_database() as created:
        upgrade(migrated)
        Ledger(created).create_schema()
        a, b = describe(migrated), describe(created)
        assert {t for t in a if not t.startswith("journal_")} == {
            "archived_periods",
            "archives",
            "audit_checkpoints",
            "audit_partitions",
            "audit_position",
            "attempts",
            "budget_periods",
            "budgets",
            "installation",
            "journal",
            "operation_events",
            "operations",
            "rate_shares",
            "rate_takes",
            "rate_windows",
            "side_effects",
            "triggers",
            "functions",
        }
        assert a["journal"]["checks"], "the comparison must see check constraints"
        # the journal's partitions: its two fixed ones, this month and the months ahead
        assert {"journal_none", "journal_default"} < set(a)
        assert len([t for t in a if t.startswith("journal_y")]) == 4
        assert a["triggers"], "the append-only trigger must exist"
        assert a == b
        assert current(migrated) == HEAD
        # each made its own installation id, once
        ids = [Store(url).installation_id() for url in (migrated, created)]
        assert ids[0] != ids[1] and all(len(i) == 32 for i in ids)


def test_autogenerate_sees_no_difference_after_upgrade() -> None:
    check_postgres()
    with scratch_database() as url:
        upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(
                    conn, opts={"compare_type": True, "include_object": include_object}
                ),
                metadata,
            )
        engine.dispose()
        assert diff == []


def test_cli_db_upgrade_then_the_ledger_works() -> None:
    check_postgres()
    with scratch_database() as url:
        done = subprocess.run(
            [sys.executable, "-m", "budget_tasks.cli", "db", "upgrade", "--ledger-url", url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"revision {HEAD}" in done.stdout
        ledger = Ledger(url)
        ledger.create_budget("acme", 10)
        assert ledger.calls.reserve("acme", "k", 10).created
        ledger.dispose()


def test_downgrade_removes_everything() -> None:
    check_postgres()
    from alembic import command

    from budget_tasks.migrations import alembic_config

    with scratch_database() as url:
        upgrade(url)
        command.downgrade(alembic_config(url), "base")
        shape = describe(url)
        assert shape == {"triggers": [], "functions": []}


REVISIONS = ["0001", "0002", "0003", "0004"]


def _fill(url: str, revision: str) -> None:
    """A ledger in use at ``revision``: budgets, periods, a settled, a held and a
    released attempt with their journal entries (counters matching), and from 0003 on
    an operation with a labelled call and a side effect."""
    from datetime import UTC, datetime

    from sqlalchemy import MetaData, insert

    engine = create_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    at = now.replace(tzinfo=None) if sqlite else now
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    epoch = epoch.replace(tzinfo=None) if sqlite else epoch
    meta = MetaData()
    meta.reflect(engine)
    t = meta.tables
    later = revision >= "0003"
    with engine.begin() as conn:
        conn.execute(
            insert(t["budgets"]),
            [
                {"id": 1, "name": "acme", "cap": 10_000, "period": "none", "renewal": "reset",
                 "frozen": False, "created_at": at},
                {"id": 2, "name": "team", "cap": 5_000, "period": "none", "renewal": "reset",
                 "frozen": False, "created_at": at, "parent_id": 1},
            ],
        )  # fmt: skip
        conn.execute(
            insert(t["budget_periods"]),
            [
                {"id": 1, "budget_id": 1, "period_start": epoch, "cap": 10_000, "spent": 70,
                 "held": 200, "opened_at": at},
                {"id": 2, "budget_id": 2, "period_start": epoch, "cap": 5_000, "spent": 70,
                 "held": 200, "opened_at": at},
            ],
        )  # fmt: skip
        if later:
            conn.execute(
                insert(t["operations"]),
                [{"id": 1, "key": "op", "fingerprint": "f", "status": "unknown", "runs": 0,
                  "deliveries": 1, "replays": 0, "created_at": at, "updated_at": at}],
            )  # fmt: skip
            conn.execute(
                insert(t["side_effects"]),
                [{"operation_id": 1, "name": "spend:step:1", "state": "done", "result": "1",
                  "created_at": at}],
            )  # fmt: skip
        rows = [
            ("settled", 100, 70, "settled"),
            ("held", 200, None, "unknown"),
            ("released", 50, 0, "released"),
        ]
        for n, (key, amount, actual, state) in enumerate(rows, start=1):
            row = {
                "id": n,
                "key": key,
                "budget_id": 2,
                "period_id": 2,
                "reason": "first",
                "amount": amount,
                "actual": actual,
                "state": state,
                "created_at": at,
            }
            if later:
                row |= {"operation_id": 1, "label": "step" if key == "held" else None}
            conn.execute(insert(t["attempts"]), [row])
            for period in (1, 2):
                entries = [("hold", amount, 0)]
                if actual is not None:
                    entries.append(("charge" if key == "settled" else "release", -amount, actual))
                for kind, held, spent in entries:
                    conn.execute(
                        insert(t["journal"]),
                        [{"attempt_id": n, "period_id": period, "kind": kind,
                          "held_delta": held, "spent_delta": spent, "created_at": at}],
                    )  # fmt: skip
        if not sqlite:  # rows given their ids: move the id sequences past them
            for table in t:
                if "id" in t[table].c and table != "alembic_version":
                    conn.execute(
                        text(
                            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                            f"(SELECT coalesce(max(id), 0) + 1 FROM {table}), false)"
                        )
                    )
    engine.dispose()


def _upgrade_with_data(url: str, revision: str) -> None:
    upgrade(url, revision)
    _fill(url, revision)
    upgrade(url)  # to head, over the data
    assert current(url) == HEAD
    ledger = Ledger(url)
    assert ledger.audit() == []
    assert [(a.key, a.state, a.actual) for a in ledger.attempts()] == [
        ("settled", "settled", 70),
        ("held", "unknown", None),
        ("released", "released", 0),
    ]
    bal = ledger.balance("team")
    assert (bal.spent, bal.held) == (70, 200)
    if revision >= "0003":  # a labelled call's first attempt was keyed by its position
        assert ledger.attempt("held").step == "held"
        assert ledger.operation("op").status == "unknown"
    # the upgraded ledger works: the unknown hold settles, a new one is admitted
    # the journal still refuses changes after the upgrade (SQLite's rebuilt table too)
    for statement in ("UPDATE journal SET note = 'x'", "DELETE FROM journal"):
        with pytest.raises(Exception, match="append-only"), ledger.engine.begin() as conn:
            conn.execute(text(statement))
    ledger.calls.settle("held", 150)
    ledger.calls.reserve("team", "new", 4_000)
    assert ledger.balance("team").available == 5_000 - 70 - 150 - 4_000
    assert ledger.audit() == []
    ledger.dispose()


@pytest.mark.parametrize("revision", REVISIONS)
def test_every_revision_upgrades_over_data_on_sqlite(tmp_path: Path, revision: str) -> None:
    _upgrade_with_data(f"sqlite:///{tmp_path}/ledger.db", revision)


@pytest.mark.parametrize("revision", REVISIONS)
def test_every_revision_upgrades_over_data_on_postgresql(revision: str) -> None:
    check_postgres()
    with scratch_database() as url:
        _upgrade_with_data(url, revision)


def test_two_upgrades_at_once_take_turns() -> None:
    """Two deploys run `budget-tasks db upgrade` on a fresh database at the same time:
    both succeed, one after the other; neither leaves a traceback."""
    check_postgres()
    with scratch_database() as url:
        command = [sys.executable, "-m", "budget_tasks.cli", "db", "upgrade", "--ledger-url", url]
        runs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(3)
        ]
        outcomes = [(p.wait(120), *p.communicate()) for p in runs]
        for code, out, err in outcomes:
            assert code == 0 and "Traceback" not in err, err
            assert f"revision {HEAD}" in out
        assert current(url) == HEAD
        ledger = Ledger(url)
        ledger.create_budget("after", 10)
        assert ledger.audit() == []
        ledger.dispose()


# -- an upgraded database is a fresh one -----------------------------------------------

VERSIONS = Path(__file__).resolve().parents[2] / "budget_tasks" / "migrations" / "versions"


def _revisions() -> list[str]:
    """Every revision, oldest first."""
    from alembic.script import ScriptDirectory

    from budget_tasks.migrations import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _functions(url: str) -> dict[str, str]:
    with psycopg.connect(pg_conninfo(url)) as conn:
        return dict(
            conn.execute(
                "SELECT proname, prosrc FROM pg_proc WHERE proname LIKE 'budget_tasks_%'"
            ).fetchall()
        )


def _partitions(url: str) -> list[str]:
    with psycopg.connect(pg_conninfo(url)) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'journal'::regclass ORDER BY c.relname"
            )
        ]


def assert_every_partition_refuses_truncate(url: str) -> None:
    """TRUNCATE of the journal and of each of its partitions (the month ones, journal_none
    and journal_default, and a month the partition-making code makes now) is refused."""
    from datetime import UTC, datetime

    from budget_tasks.testing import ManualClock

    later = Ledger(url, clock=ManualClock(datetime(2040, 1, 15, tzinfo=UTC)))
    assert later.upkeep.make_partitions(ahead=0) == ["journal_y2040m01"]
    later.dispose()
    names = _partitions(url)
    assert {"journal_none", "journal_default", "journal_y2040m01"} <= set(names)
    assert len([n for n in names if n.startswith("journal_y")]) >= 5
    with psycopg.connect(pg_conninfo(url)) as conn:
        for name in ["journal", *names]:
            refused = pytest.raises(psycopg.Error, match=r"append-only \(TRUNCATE refused\)")
            with refused, conn.transaction():
                conn.execute(f"TRUNCATE {name}")


def test_no_migration_imports_the_ledgers_code() -> None:
    """A migration carries the text it installs: it imports alembic, SQLAlchemy and the
    standard library only, never budget_tasks (whose code goes on changing)."""
    allowed = {"alembic", "sqlalchemy", *sys.stdlib_module_names}
    files = sorted(VERSIONS.glob("*.py"))
    assert len(files) >= 17
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import"
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def _frozen_functions() -> tuple[str, tuple[str, ...]]:
    """The latest migration that installs the server-side functions, and their text."""
    for path in sorted(VERSIONS.glob("*.py"), reverse=True):
        spec = importlib.util.spec_from_file_location(f"_revision_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if getattr(module, "FUNCTIONS_DDL", None):
            return path.name, module.FUNCTIONS_DDL
    raise AssertionError("no migration installs the functions")


def test_the_latest_migration_carries_todays_function_text() -> None:
    from budget_tasks.ledger.functions import FUNCTIONS_DDL

    name, frozen = _frozen_functions()
    assert frozen == FUNCTIONS_DDL, (
        f"budget_tasks/ledger/functions.py changed since {name} froze its text: until "
        f"{name} has landed, run `python -m tests.frozen_text "
        f"budget_tasks/migrations/versions/{name}`; after, add a migration"
    )


def test_upgrading_one_revision_at_a_time_gives_a_fresh_install() -> None:
    """A ledger made at 0001 with data in it, then upgraded one revision at a time, has
    the tables, keys, indexes, triggers and functions (their text) of a fresh install,
    works, and its journal and every partition refuse TRUNCATE. 0016's functions are
    the text frozen when it was written, not today's: 0017 brings later ones, 0023
    today's."""
    check_postgres()
    revisions = _revisions()
    assert revisions[0] == "0001" and revisions[-1] == HEAD
    assert revisions == [f"{n:04d}" for n in range(1, len(revisions) + 1)]
    with scratch_database() as migrated, scratch_database() as created:
        Ledger(created).create_schema()
        today = _functions(created)
        at: dict[str, dict[str, str]] = {}
        for revision in revisions:
            upgrade(migrated, revision)
            assert current(migrated) == revision
            if revision == "0001":
                _fill(migrated, revision)
            at[revision] = _functions(migrated)
        # each revision installed the text it was written with: 0001's append-only
        # function until 0015 replaced it, 0016's admission until 0017 replaced it
        guard, admit = "budget_tasks_journal_append_only", "budget_tasks_admit"
        assert at["0001"][guard] == at["0014"][guard] != today[guard]
        assert at["0015"][guard] == today[guard]
        assert set(at["0016"]) == set(today) == {guard, admit, "budget_tasks_finish"}
        assert at["0016"][admit] != today[admit]
        # 0019's settlement stores a labelled call's answer with the run's end; 0020's
        # writes what the answer said it used; 0022's gives back to the rate windows;
        # 0023's narrows them net of their lines
        finish = "budget_tasks_finish"
        assert at["0018"][finish] != at["0019"][finish] != at["0020"][finish]
        assert at["0020"][finish] != at["0022"][finish] != today[finish] == at["0023"][finish]
        assert at[HEAD] == today
        a, b = describe(migrated), describe(created)
        assert a["triggers"] and a["functions"] and "audit_partitions" in a
        assert a == b
        ledger = Ledger(migrated)
        assert ledger.audit() == []
        assert ledger.balance("team").spent == 70
        ledger.calls.settle("held", 150)
        assert ledger.audit() == []
        ledger.dispose()
        assert_every_partition_refuses_truncate(migrated)
        assert_every_partition_refuses_truncate(created)
