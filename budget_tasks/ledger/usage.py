"""What the ledger says one vendor was sent, by window: the tokens and money its
settled attempts' answers said, and the attempts whose outcome is still open
(``sending`` or ``unknown``) apart, with what they hold. Read by the drift check,
which compares it with the vendor's own reports."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, func, literal, or_, select

from .. import _validate as check
from .buckets import as_utc, bucket_start
from .schema import UTCDateTime, attempts
from .store import Store

#: Bucket widths (the vendors' names) and the unit each truncates a time to.
_TRUNCATE = {"1m": "minute", "1h": "hour", "1d": "day"}


@dataclass(frozen=True, slots=True)
class UsageRow:
    """The ledger's attempts of one window and group: ``sent`` is how many, of which
    ``open`` are still sending or unknown. The tokens and ``charged`` are the settled
    ones' (what their answers said and what they were charged); ``held`` is what the
    open ones hold. ``untold`` settled attempts have no tokens recorded (settled before
    the ledger kept them, or by an operator).

    What the open and the untold attempts could have used, each measure apart: the
    most input and output tokens their requests allowed; ``unbounded_*`` of them
    recorded no such bound (they could have used any number)."""

    start: datetime
    model: str | None
    credential: str | None
    sent: int
    open: int
    input_tokens: int
    output_tokens: int
    charged: int
    held: int
    untold: int = 0
    open_input: int = 0
    open_output: int = 0
    untold_input: int = 0
    untold_output: int = 0
    unbounded_input: int = 0
    unbounded_output: int = 0

    def allowed(self, measure: str) -> tuple[int, int, int]:
        """What the open and the untold attempts allowed of ``measure``
        (``input_tokens`` or ``output_tokens``), and how many of them allowed any
        number."""
        if measure == "input_tokens":
            return self.open_input, self.untold_input, self.unbounded_input
        if measure == "output_tokens":
            return self.open_output, self.untold_output, self.unbounded_output
        raise ValueError(f"measure must be input_tokens or output_tokens, not {measure!r}")


def provider_usage(
    store: Store, provider: str, start: datetime, end: datetime, bucket: str
) -> list[UsageRow]:
    """``provider``'s attempts sent in ``[start, end)``, by ``bucket`` ("1m", "1h" or
    "1d"), model (the one that answered, else the one asked for) and key hint. An
    attempt is the provider's where its run said so (with its end, an answer or an
    unknown outcome), or, where nothing was said (a run killed mid-call), where its
    lookup is the vendor's (``openai.chat``). Released attempts billed nothing and are
    left out."""
    check.text(provider, "provider", max_length=64)
    start, end = check.moment(start, "start"), check.moment(end, "end")
    if bucket not in _TRUNCATE:
        raise ValueError(f"bucket must be one of {', '.join(_TRUNCATE)}, not {bucket!r}")
    a = attempts.c
    at = bucket_start(store.dialect, _TRUNCATE[bucket], a.sending_at).label("bucket")
    # the model that answered (as the reports name it), else the one asked for
    model = func.coalesce(a.answered_by, a.model).label("model")
    is_open = a.state.in_(("sending", "unknown"))
    settled = a.state == "settled"
    untold = and_(settled, a.input_tokens.is_(None))

    def total(when: Any, value: Any = 1) -> Any:
        return func.coalesce(func.sum(case((when, value), else_=0)), 0)

    def bounds(name: str, bound: Any) -> list[Any]:
        """What the open and untold attempts allowed of one measure, and how many of
        them recorded no bound of it."""
        allowed = func.coalesce(bound, 0)
        return [
            total(is_open, allowed).label(f"open_{name}"),
            total(untold, allowed).label(f"untold_{name}"),
            total(and_(or_(is_open, untold), bound.is_(None))).label(f"unbounded_{name}"),
        ]

    query = (
        select(
            at,
            model,
            a.credential,
            func.count().label("sent"),
            total(is_open).label("open"),
            total(settled, func.coalesce(a.input_tokens, 0)).label("input_tokens"),
            total(settled, func.coalesce(a.output_tokens, 0)).label("output_tokens"),
            total(settled, a.actual).label("charged"),
            total(is_open, a.amount).label("held"),
            total(untold).label("untold"),
            *bounds("input", a.input_bound),
            *bounds("output", a.output_bound),
        )
        .where(a.sending_at >= literal(start, UTCDateTime()))
        .where(a.sending_at < literal(end, UTCDateTime()))
        .where(a.state.in_(("sending", "unknown", "settled")))
        .where(
            or_(
                a.provider == provider,
                and_(a.provider.is_(None), a.lookup.startswith(f"{provider}.", autoescape=True)),
            )
        )
        .group_by(at, model, a.credential)
        .order_by(at)
    )
    with store.driver.transaction() as cur:
        rows = cur.execute(query).all()
    counts = [f.name for f in fields(UsageRow)][3:]
    return [
        UsageRow(as_utc(r.bucket), r.model, r.credential, *(int(getattr(r, n)) for n in counts))
        for r in rows
    ]
