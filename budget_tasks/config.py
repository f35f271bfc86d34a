"""Which ledger an app uses, read once per process, and the per-process registry of
open ledgers.

The task, the beat jobs, the metrics server and the CLI all find their ledger here, so
none of them imports another to learn it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .errors import LedgerUnavailable
from .ledger import Ledger

#: The Celery setting that names the ledger, and the environment variable it falls
#: back to.
LEDGER_URL_SETTING = "budget_ledger_url"
#: The size cap of one stored result or answer, in bytes (see Ledger).
MAX_STORED_SETTING = "budget_max_stored_bytes"
LEDGER_URL_ENV = "BUDGET_TASKS_LEDGER_URL"

_ledgers: dict[tuple[str, int | None], Ledger] = {}
_ledgers_lock = threading.Lock()


def ledger_url_of(app: Any) -> str:
    """The ledger URL a Celery app is configured with (``budget_ledger_url``, else env
    ``BUDGET_TASKS_LEDGER_URL``). None configured raises LedgerUnavailable: nothing may
    be sent without a ledger."""
    url = app.conf.get(LEDGER_URL_SETTING) or os.environ.get(LEDGER_URL_ENV)
    if not url:
        raise LedgerUnavailable(
            f"no ledger configured: set {LEDGER_URL_SETTING} (env {LEDGER_URL_ENV})"
        )
    return str(url)


def ledger_for(url: str, max_stored_bytes: int | None = None) -> Ledger:
    """One Ledger per URL (and size cap) per process (its connections survive fork
    safely)."""
    with _ledgers_lock:
        ledger = _ledgers.get((url, max_stored_bytes))
        if ledger is None:
            ledger = Ledger(url, max_stored_bytes=max_stored_bytes)
            if url.startswith("sqlite"):
                ledger.create_schema()  # the embedded default needs no migration step
            _ledgers[(url, max_stored_bytes)] = ledger
        return ledger


def ledger_of(app: Any) -> Ledger:
    """The ledger of a Celery app (see :func:`ledger_url_of`), with its size cap of
    stored results (``budget_max_stored_bytes``)."""
    cap = app.conf.get(MAX_STORED_SETTING)
    return ledger_for(ledger_url_of(app), None if cap is None else int(cap))


def close_ledgers() -> None:
    """Close and forget this process's ledgers (tests that rebuild the database)."""
    with _ledgers_lock:
        ledgers = list(_ledgers.values())
        _ledgers.clear()
    for ledger in ledgers:
        ledger.dispose()
