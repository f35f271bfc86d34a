"""What the ledger says one vendor was sent, by window: the tokens and money its
settled attempts' answers said, and the attempts whose outcome is still open
(``sending`` or ``unknown``) apart, with what they hold. Read by the drift check,
which compares it with the vendor's own reports."""

from __future__ import annotations

from dataclasses import dataclass
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
    open ones hold, ``open_tokens`` the most tokens they allowed."""

    start: datetime
    model: str | None
    credential: str | None
    sent: int
    open: int
    input_tokens: int
    output_tokens: int
    charged: int
    held: int
    open_tokens: int
    #: settled attempts whose answer's tokens were not recorded (settled before the
    #: ledger kept them, or by an operator)
    untold: int = 0


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

    def settled_sum(column: Any) -> Any:
        return func.coalesce(func.sum(case((settled, column), else_=0)), 0)

    query = (
        select(
            at,
            model,
            a.credential,
            func.count().label("sent"),
            func.coalesce(func.sum(case((is_open, 1), else_=0)), 0).label("open"),
            settled_sum(func.coalesce(a.input_tokens, 0)).label("input_tokens"),
            settled_sum(func.coalesce(a.output_tokens, 0)).label("output_tokens"),
            settled_sum(a.actual).label("charged"),
            func.coalesce(func.sum(case((is_open, a.amount), else_=0)), 0).label("held"),
            func.coalesce(
                func.sum(
                    case(
                        (
                            is_open,
                            func.coalesce(a.input_bound, 0) + func.coalesce(a.output_bound, 0),
                        ),
                        else_=0,
                    )
                ),
                0,
            ).label("open_tokens"),
            func.coalesce(
                func.sum(case((and_(settled, a.input_tokens.is_(None)), 1), else_=0)), 0
            ).label("untold"),
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
    return [
        UsageRow(
            as_utc(r.bucket),
            r.model,
            r.credential,
            int(r.sent),
            int(r.open),
            int(r.input_tokens),
            int(r.output_tokens),
            int(r.charged),
            int(r.held),
            int(r.open_tokens),
            int(r.untold),
        )
        for r in rows
    ]
