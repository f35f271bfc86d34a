"""The alembic migrations and ``Ledger.create_schema()`` give the same database."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from budget_tasks import Ledger
from budget_tasks.ledger.schema import metadata
from budget_tasks.migrations import current, upgrade

from ..services import check_postgres, pg_conninfo, scratch_database


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
                    (fk["name"], tuple(fk["constrained_columns"]), fk["referred_table"])
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
                    (i["name"], tuple(i["column_names"]), i["unique"])
                    for i in insp.get_indexes(table)
                ),
            }
    finally:
        engine.dispose()
    with psycopg.connect(pg_conninfo(url)) as conn:
        shape["triggers"] = conn.execute(
            "SELECT tgname, tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE NOT tgisinternal ORDER BY tgname"
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
        assert set(a) == {
            "attempts",
            "budget_periods",
            "budgets",
            "journal",
            "operations",
            "side_effects",
            "triggers",
            "functions",
        }
        assert a["journal"]["checks"], "the comparison must see check constraints"
        assert a["triggers"], "the append-only trigger must exist"
        assert a == b
        assert current(migrated) == "0005"


def test_autogenerate_sees_no_difference_after_upgrade() -> None:
    check_postgres()
    with scratch_database() as url:
        upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), metadata
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
        assert "revision 0005" in done.stdout
        ledger = Ledger(url)
        ledger.create_budget("acme", 10)
        assert ledger.reserve("acme", "k", 10).created
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
