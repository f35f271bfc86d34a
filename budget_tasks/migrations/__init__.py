"""Alembic migrations for the ledger; run them with ``budget-tasks db upgrade``."""

from __future__ import annotations

from alembic import command
from alembic.config import Config

from ..ledger.engine import normalise_url


def include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    """For autogenerate: the journal's partitions are the ledger's, made by beat, not
    tables the metadata is missing."""
    from ..ledger.partitions import is_partition

    return not (type_ == "table" and reflected and compare_to is None and is_partition(name))


def alembic_config(url: str) -> Config:
    """An alembic Config for the ledger at ``url``, using the packaged scripts."""
    config = Config()
    config.set_main_option("script_location", "budget_tasks:migrations")
    # Passed as an attribute, not an ini option: URLs may hold '%' (configparser syntax).
    config.attributes["ledger_url"] = normalise_url(url)
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the ledger schema at ``url`` up to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The revision the database is at (None if never migrated)."""
    from alembic.runtime.migration import MigrationContext

    from ..ledger.engine import build_engine

    engine = build_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision this release ships."""
    from alembic.script import ScriptDirectory

    found = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert found is not None  # the package ships its migrations
    return found
