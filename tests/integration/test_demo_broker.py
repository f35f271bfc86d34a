"""The embedded SQLite broker under two threads of one worker process: the main thread
takes messages while another puts messages back (what the pool's result handler does
for a killed process's message under acks_late)."""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection

from budget_tasks import _sqla_broker as broker

PUTS = 300


def _race(url: str) -> tuple[list[BaseException], list[int]]:
    """One thread puts PUTS messages while another takes them; what each raised, and
    what was taken."""
    errors: list[BaseException] = []
    taken: list[int] = []
    with Connection(url) as conn:
        channel = conn.default_channel
        channel._new_queue("jobs")
        done = threading.Event()

        def put() -> None:
            try:
                for n in range(PUTS):
                    channel._put("jobs", {"n": n})
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        def take() -> None:
            idle = 0
            while idle < 200:
                try:
                    taken.append(channel._get("jobs")["n"])
                    idle = 0
                except Empty:
                    if done.is_set():
                        idle += 1
                except BaseException as exc:
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=put), threading.Thread(target=take)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return errors, taken


def test_a_message_put_back_by_another_thread_is_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu.transport import sqlalchemy as sqla

    monkeypatch.setattr(sqla.Channel, "session", sqla.Channel.session)  # undone after
    broker.install()
    errors, taken = _race(f"sqla+sqlite:///{tmp_path}/broker.db")
    assert errors == []
    assert sorted(taken) == list(range(PUTS))  # each taken once, none lost


def test_configure_installs_it_only_for_that_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery
    from kombu.transport import sqlalchemy as sqla

    from budget_tasks import configure

    before = sqla.Channel.session
    monkeypatch.setattr(sqla.Channel, "session", before)  # undone after
    redis_app = configure(Celery("r", set_as_current=False, broker="redis://127.0.0.1:1/0"))
    redis_app.conf.broker_url  # noqa: B018 - reading the config wires the app
    assert sqla.Channel.session is before
    sqlite_app = configure(Celery("s", set_as_current=False, broker="sqla+sqlite:///x.db"))
    sqlite_app.conf.broker_url  # noqa: B018
    assert sqla.Channel.session is not before
