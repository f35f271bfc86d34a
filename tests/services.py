"""Where the tests find the real services, and what to do when one is missing.

Under CI (env CI=true) a missing service fails the test; on a developer's machine it
skips it with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

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


#: The Redis the tests use, and the first of the six databases they take on it (each
#: flushed by the suite that owns it). Two checkouts' suites on one machine each need
#: their own: BUDGET_TASKS_TEST_REDIS_URL=redis://127.0.0.1:6379/0 takes databases 0-5.
REDIS_URL = os.environ.get("BUDGET_TASKS_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
_redis = urlsplit(REDIS_URL)
REDIS_HOST, REDIS_PORT = _redis.hostname or "127.0.0.1", _redis.port or 6379
_FIRST_DB = int(_redis.path.strip("/") or 0)
#: Which database each suite takes, counted from the URL's.
_DBS = {
    "integration": 0,
    "first hour: broker": 1,
    "first hour: results": 2,
    "chaos: postgres outage": 2,  # never at once with the first hour: another folder
    "demo": 3,
    "benchmarks smoke": 4,
    "hosts": 5,
}
if not 0 <= _FIRST_DB <= 16 - len(set(_DBS.values())):
    raise RuntimeError(f"BUDGET_TASKS_TEST_REDIS_URL: database {_FIRST_DB} leaves no room for 6")


def redis_db(suite: str) -> int:
    """The database ``suite`` takes on the test Redis."""
    return _FIRST_DB + _DBS[suite]


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
