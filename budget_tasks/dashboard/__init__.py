"""``budget-tasks dashboard``: the operator's web page over a ledger (the extra
``budget-tasks[dashboard]``: Starlette, uvicorn, Jinja2).

Only the CLI imports this package, and only when the command runs: a bare install
works without the extra. Pages are rendered on the server (inline SVG, no JavaScript
build); every page has a JSON endpoint behind it (docs/dashboard.md). Writes (resolving
an unknown outcome, reopening a failed operation) go through the same library calls as
the CLI's, and need the token of ``BUDGET_TASKS_DASHBOARD_TOKEN``.
"""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
