"""Real ``celery worker`` processes for the integration tests (run from the project
root, with the test tasks loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import Worker as _Worker

ROOT = Path(__file__).resolve().parents[1]


class Worker(_Worker):
    """``celery -A workers.app worker -I <include>`` started from the project root."""

    def __init__(
        self,
        env: dict[str, str],
        name: str,
        log_dir: Path,
        concurrency: int = 1,
        include: str = "tests.integration.worker_tasks",
        **options: Any,
    ):
        options.setdefault("app", "workers.app")  # the top-level reference app
        super().__init__(env, name, log_dir, concurrency, include, cwd=ROOT, **options)


__all__ = ["ROOT", "Worker"]
