"""Alembic environment: online migrations only, against the configured ledger URL."""

from __future__ import annotations

from alembic import context

from budget_tasks.ledger.engine import build_engine
from budget_tasks.ledger.schema import metadata

config = context.config
connection = config.attributes.get("connection")

if connection is not None:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = build_engine(config.attributes["ledger_url"])
    try:
        with engine.connect() as conn:
            context.configure(
                connection=conn,
                target_metadata=metadata,
                render_as_batch=conn.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()
