"""Alembic environment: online migrations only, against the configured ledger URL."""

from __future__ import annotations

from typing import Any

from alembic import context

from budget_tasks.ledger.engine import build_engine
from budget_tasks.ledger.schema import metadata
from budget_tasks.migrations import include_object

#: The advisory lock that serialises migrations on PostgreSQL (any constant the
#: application does not use for something else).
MIGRATION_LOCK = 0x6275645F7461736B  # "bud_task"

config = context.config
connection = config.attributes.get("connection")

if connection is not None:
    context.configure(
        connection=connection, target_metadata=metadata, include_object=include_object
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = build_engine(config.attributes["ledger_url"])
    try:
        with engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            raw: Any = conn.connection.driver_connection
            if sqlite:
                # A batch migration rebuilds a table (copy, drop, rename) that the journal
                # references: with foreign keys enforced, the DROP fails on a ledger
                # holding data. SQLite's documented procedure: turn them off outside the
                # transaction, migrate, check them, turn them on. (pysqlite runs this
                # connection in autocommit: the pragma is not inside a transaction.)
                raw.execute("PRAGMA foreign_keys=OFF")
            context.configure(
                connection=conn,
                target_metadata=metadata,
                render_as_batch=sqlite,
                include_object=include_object,
            )
            with context.begin_transaction():
                if conn.dialect.name == "postgresql":
                    # Two upgrades at once (two deploys, a compose restart) take turns: the
                    # second waits here, then finds the schema at head and does nothing.
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
                context.run_migrations()
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"the migration broke foreign keys: {broken[:5]}")
            if sqlite:
                raw.execute("PRAGMA foreign_keys=ON")
    finally:
        engine.dispose()
