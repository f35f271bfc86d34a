"""kombu's SQLAlchemy transport (the embedded broker of the demo and the reference
app's defaults, on SQLite) with a database session per thread; ``configure(app)``
installs it when the app's broker is that transport.

kombu's channel keeps one session for every thread. In a prefork worker the main
thread polls the queue while the pool's result handler thread puts back the message
of a pool process that was killed (acks_late): sharing one session, the two leave it
"in 'prepared' state", the put is lost, and the job never runs again. A session per
thread (SQLite's own locking orders them) keeps both.
"""

from __future__ import annotations

import threading
from typing import Any

from kombu.transport import sqlalchemy as sqla


def _session_of_this_thread(channel: Any) -> Any:
    sessions = channel.__dict__.setdefault("_budget_tasks_sessions", threading.local())
    session = getattr(sessions, "session", None)
    if session is None:
        _, make_session = channel._open()
        session = sessions.session = make_session()
    return session


def install() -> None:
    """Give every channel of kombu's SQLAlchemy transport a session per thread."""
    sqla.Channel.session = property(_session_of_this_thread)  # type: ignore[assignment,method-assign]


def install_for(broker_url: object) -> bool:
    """Install it if ``broker_url`` names kombu's SQLAlchemy transport; True if so."""
    if not str(broker_url or "").startswith("sqla+"):
        return False
    install()
    return True
