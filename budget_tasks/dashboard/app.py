"""The dashboard's routes: pages, their JSON and CSV, and the two writes."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from .._display import age, amount, units, usd
from ..errors import (
    BudgetTasksError,
    LedgerUnavailable,
    UnknownAttempt,
    UnknownBudget,
    UnknownOperation,
)
from ..ledger import Ledger
from ..ledger.states import OPERATION_STATUSES
from ..resolution import resolve_outcome
from . import charts, views
from .security import Guard, same_origin

TOKEN_ENV = "BUDGET_TASKS_DASHBOARD_TOKEN"  # noqa: S105 (the name of a variable)
#: The most rows a listing asks for.
MAX_LIMIT = 10_000
#: The longest spend window, in hours (what one series may return).
MAX_HOURS = 31 * 24
#: The hosts a page may be asked for by (a DNS-rebinding page cannot name itself these).
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1", "testserver")

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))
TEMPLATES.env.filters["usd"] = usd
TEMPLATES.env.filters["age"] = age
TEMPLATES.env.filters["units"] = units
TEMPLATES.env.filters["q"] = lambda text: quote(str(text), safe="")


class Refused(Exception):
    """A write refused before it touched the ledger (403)."""


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    try:
        value = default if raw is None else int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, not {raw!r}") from exc
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high}")
    return value


def _cell(value: Any) -> Any:
    """A CSV cell; text a spreadsheet would run as a formula is quoted as text."""
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _csv(rows: list[dict[str, Any]], name: str) -> Response:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition": f'attachment; filename="{name}.csv"'},
    )


def _ledger(request: Request) -> Ledger:
    ledger: Ledger = request.app.state.ledger
    return ledger


def _guard(request: Request) -> Guard:
    guard: Guard = request.app.state.guard
    return guard


def page(request: Request, name: str, **context: Any) -> Response:
    context.setdefault("status_code", 200)
    status = context.pop("status_code")
    return TEMPLATES.TemplateResponse(
        request,
        name,
        {"writable": _guard(request).writable, "csrf": _guard(request).csrf_for, **context},
        status_code=status,
    )


def listing(
    build: Callable[[Request], Any], csv_rows: Callable[[Any], list[dict[str, Any]]], name: str
) -> Callable[[Request], Response]:
    def endpoint(request: Request) -> Response:
        data = build(request)
        if request.query_params.get("format") == "csv":
            return _csv(csv_rows(data), name)
        return JSONResponse(data)

    return endpoint


# -- reads ---------------------------------------------------------------------


def status_param(request: Request) -> str | None:
    status = request.query_params.get("status") or None
    if status is not None and status not in OPERATION_STATUSES:
        raise ValueError(f"status must be one of {', '.join(OPERATION_STATUSES)}")
    return status


def spend_params(request: Request) -> tuple[str, str, int]:
    bucket = request.query_params.get("bucket", "hour")
    if bucket not in ("hour", "day"):
        raise ValueError("bucket must be hour or day")
    hours = _int_param(request, "hours", 24 if bucket == "hour" else 30 * 24, 1, MAX_HOURS)
    return request.query_params.get("budget", ""), bucket, hours


def api_budgets(request: Request) -> Any:
    return views.budgets_view(_ledger(request))


def api_spend(request: Request) -> Any:
    return views.spend_view(_ledger(request), *spend_params(request))


def api_holds(request: Request) -> Any:
    return views.holds_view(
        _ledger(request), _int_param(request, "limit", views.HOLDS_LIMIT, 1, MAX_LIMIT)
    )


def api_holds_summary(request: Request) -> Any:
    summary = views.holds_view(_ledger(request))["by_state_and_age"]
    return [{"state": state, **by_age} for state, by_age in summary.items()]


def api_worklist(request: Request) -> Any:
    return views.worklist_view(_ledger(request))


def api_rates(request: Request) -> Any:
    return views.rates_view(_ledger(request))


def api_attempt(request: Request) -> Any:
    return views.attempt_view(_ledger(request), request.query_params.get("key", ""))


def api_operations(request: Request) -> Any:
    limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
    return views.operations_view(_ledger(request), status_param(request), limit)


def flat_budgets(data: Any) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in r.items() if k != "burn"}, **_prefixed("burn_", r["burn"])}
        for r in data
    ]


def flat_operations(data: Any) -> list[dict[str, Any]]:
    return [
        {
            **{k: v for k, v in o.items() if k != "attempts"},
            "attempts": ";".join(a["attempt"] for a in o["attempts"]),
        }
        for o in data
    ]


def index(request: Request) -> Response:
    return page(
        request,
        "index.html",
        budgets=[{**b, "bar": charts.bar(b)} for b in views.budgets_view(_ledger(request))],
        holds=views.holds_view(_ledger(request)),
        worklist=views.worklist_view(_ledger(request)),
        age_classes=[name for _, name in views.AGE_CLASSES],
        rates=views.rates_view(_ledger(request)),
        done=request.query_params.get("done"),
    )


def budget_page(request: Request) -> Response:
    spend = views.spend_view(_ledger(request), *spend_params(request))
    return page(request, "budget.html", spend=spend, chart=charts.spend_chart(spend))


def holds_page(request: Request) -> Response:
    return page(request, "holds.html", holds=views.holds_view(_ledger(request)))


def attempt_page(request: Request) -> Response:
    view = views.attempt_view(_ledger(request), request.query_params.get("key", ""))
    return page(request, "attempt.html", view=view, done=request.query_params.get("done"))


def operations_page(request: Request) -> Response:
    status = status_param(request)
    return page(
        request,
        "operations.html",
        operations=views.operations_view(_ledger(request), status, 100),
        status=status,
        statuses=OPERATION_STATUSES,
        done=request.query_params.get("done"),
    )


# -- writes --------------------------------------------------------------------


async def form_of(request: Request) -> dict[str, str]:
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        raise Refused("a form post is application/x-www-form-urlencoded")
    body = (await request.body()).decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def check_write(request: Request, given_token: str | None) -> None:
    """Every write: from this site, by the token. Nothing is read or written
    before this passes."""
    if not _guard(request).writable:
        raise Refused(f"the dashboard is read-only: set {TOKEN_ENV} to allow writes")
    if not same_origin(request.headers, request.url.scheme):
        raise Refused("a cross-site request is refused")
    if not _guard(request).token_ok(given_token):
        raise Refused("wrong or missing token")


def do_resolve(
    ledger: Ledger, key: str, actual_given: object, note: str, by: str | None
) -> dict[str, Any]:
    # JSON's integer is micro-USD, as the API's; text is as a person types it: dollars
    # (0.04usd, $0.04) or whole micro-USD
    if isinstance(actual_given, int) and not isinstance(actual_given, bool):
        actual = actual_given
    elif isinstance(actual_given, str):
        actual = amount(actual_given)
    else:
        raise ValueError(f"actual must be micro-USD or an amount such as 0.04usd: {actual_given!r}")
    if not note.strip():
        raise ValueError("a note is required: it is recorded in the journal")
    done = resolve_outcome(ledger, key, actual, note, by or None)
    return {
        "attempt": key,
        "from": done.before.state,
        "state": done.after.state,
        "actual": done.after.actual,
        "applied": done.done.applied,
        "operation": done.done.operation,
        "operation_status": done.done.operation_status,
    }


def do_reopen(ledger: Ledger, key: str, reason: str, by: str | None) -> dict[str, Any]:
    if not reason.strip():
        raise ValueError("a reason is required: it is recorded with the operation")
    op = ledger.reopen_operation(key, reason=reason, by=by or None)
    return {"operation": op.key, "status": op.status}


async def resolve_form(request: Request) -> Response:
    form = await form_of(request)
    key = form.get("attempt", "")
    check_write(request, form.get("token"))
    if not _guard(request).csrf_ok(form.get("csrf"), "resolve", key):
        raise Refused("the form is not this page's (or has expired): reload it")
    done = await run_in_threadpool(
        do_resolve,
        _ledger(request),
        key,
        form.get("actual", ""),
        form.get("note", ""),
        form.get("by"),
    )
    message = f"{key}: {done['from']} -> {done['state']}, charged {usd(done['actual'])}"
    if not done["applied"]:
        message += " (already so: nothing changed)"
    query = urlencode({"key": key, "done": message})
    return RedirectResponse(f"/attempt?{query}", status_code=303)


async def reopen_form(request: Request) -> Response:
    form = await form_of(request)
    key = form.get("operation", "")
    check_write(request, form.get("token"))
    if not _guard(request).csrf_ok(form.get("csrf"), "reopen", key):
        raise Refused("the form is not this page's (or has expired): reload it")
    done = await run_in_threadpool(
        do_reopen, _ledger(request), key, form.get("reason", ""), form.get("by")
    )
    message = f"operation {key}: failed -> {done['status']}; enqueue it again to run it"
    return RedirectResponse(f"/operations?{urlencode({'done': message})}", status_code=303)


async def json_body(request: Request) -> dict[str, Any]:
    # a browser sends JSON cross-site only after a preflight this server never allows
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise Refused("the API takes application/json")
    auth = request.headers.get("authorization", "")
    check_write(request, auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None)
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise ValueError("the body is not JSON") from exc
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object")
    return {k: v if v is None else str(v) for k, v in body.items()}


async def api_resolve(request: Request) -> Response:
    body = await json_body(request)
    done = await run_in_threadpool(
        do_resolve,
        _ledger(request),
        body.get("attempt") or "",
        body.get("actual", ""),
        body.get("note") or "",
        body.get("by"),
    )
    return JSONResponse(done)


async def api_reopen(request: Request) -> Response:
    body = await json_body(request)
    done = await run_in_threadpool(
        do_reopen,
        _ledger(request),
        body.get("operation") or "",
        body.get("reason") or "",
        body.get("by"),
    )
    return JSONResponse(done)


# -- errors --------------------------------------------------------------------


def wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def error(request: Request, status: int, message: str) -> Response:
    if wants_json(request):
        return JSONResponse({"error": message}, status_code=status)
    return page(request, "error.html", message=message, status_code=status)


async def on_refused(request: Request, exc: Exception) -> Response:
    return error(request, 403, str(exc))


async def on_unknown(request: Request, exc: Exception) -> Response:
    return error(request, 404, str(exc))


async def on_unavailable(request: Request, exc: Exception) -> Response:
    return error(request, 503, str(exc))


async def on_bad(request: Request, exc: Exception) -> Response:
    # conflicts (resolved otherwise, cannot reopen, never sent) and bad input
    return error(request, 409 if isinstance(exc, BudgetTasksError) else 400, str(exc))


def create_app(
    ledger: Ledger, *, token: str | None = None, hosts: tuple[str, ...] = ()
) -> Starlette:
    """The dashboard over ``ledger``; writes need ``token`` (None: read-only). Requests
    are answered only for the local hosts and ``hosts`` (``*``: any)."""
    routes = [
        Route("/", index),
        Route("/budget", budget_page),
        Route("/holds", holds_page),
        Route("/attempt", attempt_page),
        Route("/operations", operations_page),
        Route("/resolve", resolve_form, methods=["POST"]),
        Route("/reopen", reopen_form, methods=["POST"]),
        Route("/api/budgets", listing(api_budgets, flat_budgets, "budgets")),
        Route("/api/spend", listing(api_spend, lambda d: d["points"], "spend")),
        Route("/api/holds", listing(api_holds, lambda d: d["holds"], "holds")),
        Route("/api/holds/summary", listing(api_holds_summary, lambda d: d, "holds-by-age")),
        Route("/api/worklist", listing(api_worklist, lambda d: d, "worklist")),
        Route("/api/rates", listing(api_rates, lambda d: d, "rate-limits")),
        Route("/api/attempt", listing(api_attempt, lambda d: d["journal"], "journal")),
        Route("/api/operations", listing(api_operations, flat_operations, "operations")),
        Route("/api/resolve", api_resolve, methods=["POST"]),
        Route("/api/reopen", api_reopen, methods=["POST"]),
        Route("/healthz", lambda request: PlainTextResponse("ok")),
    ]
    allowed = ["*"] if "*" in hosts else [*LOCAL_HOSTS, *hosts]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed)],
        exception_handlers={
            Refused: on_refused,
            UnknownAttempt: on_unknown,
            UnknownOperation: on_unknown,
            UnknownBudget: on_unknown,
            LedgerUnavailable: on_unavailable,
            BudgetTasksError: on_bad,
            ValueError: on_bad,
        },
    )
    app.state.ledger = ledger
    app.state.guard = Guard(token)
    return app


def _prefixed(prefix: str, data: dict[str, Any]) -> dict[str, Any]:
    return {prefix + k: v for k, v in data.items()}


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None
