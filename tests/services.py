"""Where the tests find the real services, and what to do when one is missing.

Under CI (env CI=true) a missing service fails the test; on a developer's machine it
skips it with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

PG_ADMIN_URL = os.environ.get(
    "BUDGET_TASKS_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def missing(service: str, why: object) -> None:
    message = f"{service} is not reachable: {why}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def pg_conninfo(url: str) -> str:
    """psycopg takes libpq URLs; SQLAlchemy's have a +driver suffix."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


def check_redis() -> None:
    import redis

    try:
        redis.Redis(REDIS_HOST, REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        missing("Redis", exc)


def check_postgres() -> None:
    try:
        psycopg.connect(pg_conninfo(PG_ADMIN_URL), connect_timeout=3).close()
    except psycopg.Error as exc:
        missing("PostgreSQL", exc)


@contextmanager
def scratch_database(prefix: str = "bt_test") -> Iterator[str]:
    """A new, empty PostgreSQL database; its SQLAlchemy URL is yielded, dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_conninfo(PG_ADMIN_URL), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(pg_conninfo(PG_ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
