"""Drift: what the ledger says a vendor was sent, against what the vendor's own usage
and cost reports say it served and billed.

The ledger is what this project believes it spent; the vendor's bill is the truth.
Where they differ, money went somewhere the ledger did not see: traffic that bypassed
it, a wrong price, a settlement lost, a reconciliation that guessed wrong. Each line
compares one measure (input tokens, output tokens or cost) over one window and group
(a model, an API key, a project, or all):

- ``difference`` is the vendor's figure less the ledger's: above 0, the vendor billed
  more than the ledger knows of;
- a window whose report may still grow (it ended less than ``settle`` ago) is
  ``pending``, never drift: the vendors' reports lag;
- attempts still open (sent, their outcome unknown) are shown apart: a difference
  they can account for (no more than what they hold, or the tokens they allow) is
  ``open``, for reconciliation to settle, not drift;
- two neighbouring windows whose differences cancel (within the thresholds) are
  ``shifted``: a call sent as one window ended, counted by the vendor in the next;
- a token line whose settled attempts include some with no tokens recorded (settled
  by an operator, or before the ledger kept them) is ``untold``: not comparable;
- a difference beyond both thresholds, the relative and the absolute, is ``drift``;
- each group and measure also has a ``total`` line over its final windows, judged the
  same way: a leak too small for any one window to show adds up there.

Tokens are compared per usage bucket (1m, 1h or 1d); money per day, the cost reports'
only bucket. This module reads; it never writes the ledger.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import DriftOff
from .ledger import Ledger
from .ledger.usage import UsageRow
from .providers.base import SNAPSHOT_SUFFIX, Vendor
from .providers.reports import BUCKETS, GROUPINGS, KeyInfo, ReportQuery, key_for

#: What a line compares.
MEASURES = ("input_tokens", "output_tokens", "cost")
#: What a line's comparison came to.
STATUSES = ("ok", "drift", "open", "shifted", "untold", "pending")
#: The group of a line not grouped.
ALL = "all"
#: How long after a window ends its report is taken as final, by default: usage, and
#: the daily costs (which the vendors take longer to count).
DEFAULT_SETTLE = timedelta(hours=1)
DEFAULT_COST_SETTLE = timedelta(hours=12)


def model_family(model: str | None) -> str:
    """A model's name without its snapshot (``gpt-4o-mini-2024-07-18`` ->
    ``gpt-4o-mini``): the ledger keeps the model asked for, the reports the snapshot
    that answered."""
    if not model:
        return "(no model)"
    return SNAPSHOT_SUFFIX.sub("", model)


@dataclass(frozen=True, slots=True)
class Threshold:
    """Drift is a difference beyond both: more than ``relative`` of the larger figure,
    and more than the absolute (``tokens``, or ``money`` in micro-USD)."""

    relative: float = 0.02
    tokens: int = 1_000
    money: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.relative < 1:
            raise ValueError(f"relative threshold must be in [0, 1), not {self.relative}")
        if self.tokens < 0 or self.money < 0:
            raise ValueError("absolute thresholds are not negative")

    def beyond(self, measure: str, ledger: int, provider: int) -> bool:
        difference = abs(provider - ledger)
        absolute = self.money if measure == "cost" else self.tokens
        return difference > absolute and difference > self.relative * max(ledger, provider)


#: The thresholds a check uses unless told.
DEFAULT_THRESHOLD = Threshold()


@dataclass(frozen=True, slots=True)
class DriftLine:
    """One measure of one window and group (see the module)."""

    measure: str
    start: datetime
    end: datetime
    group: str
    ledger: int
    provider: int
    #: attempts of this window and group still open, and what they could account for
    #: (the money they hold, or the tokens they allow)
    open: int
    open_bound: int
    status: str
    #: a group's and measure's sum over its final windows (``start`` to ``end``)
    total: bool = False

    @property
    def difference(self) -> int:
        return self.provider - self.ledger

    def as_json(self) -> dict[str, Any]:
        return {
            "measure": self.measure,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "group": self.group,
            "ledger": self.ledger,
            "provider": self.provider,
            "difference": self.difference,
            "open": self.open,
            "open_bound": self.open_bound,
            "status": self.status,
            "total": self.total,
        }


@dataclass(frozen=True)
class DriftReport:
    """A drift check of one vendor over ``[start, end)``."""

    provider: str
    start: datetime
    end: datetime
    by: str | None
    bucket: str
    lines: list[DriftLine]
    #: what could not be compared, and why
    notes: list[str] = field(default_factory=list)

    @property
    def drifted(self) -> list[DriftLine]:
        return [line for line in self.lines if line.status == "drift"]

    def differences(self) -> dict[tuple[str, str], int]:
        """Each group's and measure's difference summed over the final windows (what
        the ``budget_tasks_provider_drift`` gauge shows)."""
        found: dict[tuple[str, str], int] = {}
        for line in self.lines:
            if line.status != "pending" and not line.total:
                slot = (line.group, line.measure)
                found[slot] = found.get(slot, 0) + line.difference
        return found

    def totals(self, measure: str, *, final_only: bool = True) -> tuple[int, int]:
        """The ledger's and the provider's sum of ``measure`` over the final lines."""
        lines = [
            line
            for line in self.lines
            if line.measure == measure
            and not line.total
            and not (final_only and line.status == "pending")
        ]
        return sum(line.ledger for line in lines), sum(line.provider for line in lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "by": self.by,
            "bucket": self.bucket,
            "drifted": len(self.drifted),
            "lines": [line.as_json() for line in self.lines],
            "notes": self.notes,
        }


def _floor(at: datetime, width: timedelta) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((at - epoch) // width) * width


@dataclass
class _Sums:
    ledger: int = 0
    provider: int = 0
    open: int = 0
    open_bound: int = 0
    untold: int = 0

    def add(self, other: _Sums) -> None:
        self.ledger += other.ledger
        self.provider += other.provider
        self.open += other.open
        self.open_bound += other.open_bound
        self.untold += other.untold


class _Groups:
    """Names each side's lines by the grouping asked for."""

    def __init__(self, by: str | None, keys: Sequence[KeyInfo]) -> None:
        self.by = by
        self.keys = keys

    def _key(self, credential: str | None) -> KeyInfo | None:
        return key_for(credential, self.keys) if credential else None

    def ledger(self, row: UsageRow) -> str:
        if self.by is None:
            return ALL
        if self.by == "model":
            return model_family(row.model)
        key = self._key(row.credential)
        if key is None:  # the hint is not named: a group is a metric's label
            return "(unlisted key)" if row.credential else "(no key recorded)"
        return key.id if self.by == "api_key" else key.project or "(default)"

    def provider(self, model: str | None, api_key_id: str | None, project: str | None) -> str:
        if self.by is None:
            return ALL
        if self.by == "model":
            return model_family(model)
        if self.by == "api_key":
            return api_key_id or "(no key)"
        return project or "(default)"


def _status(measure: str, sums: _Sums, final: bool, threshold: Threshold) -> str:
    if not final:
        return "pending"
    if not threshold.beyond(measure, sums.ledger, sums.provider):
        return "ok"
    if sums.open and 0 < sums.provider - sums.ledger <= sums.open_bound:
        return "open"
    if sums.untold and measure != "cost":
        return "untold"
    return "drift"


def _lines(
    measure: str,
    table: dict[tuple[datetime, str], _Sums],
    width: timedelta,
    settled_by: datetime,
    threshold: Threshold,
) -> list[DriftLine]:
    """The windows' lines of ``measure``, by group then time, and each group's total
    over its final windows."""
    lines = [
        DriftLine(
            measure,
            start,
            start + width,
            group,
            sums.ledger,
            sums.provider,
            sums.open,
            sums.open_bound,
            _status(measure, sums, start + width <= settled_by, threshold),
        )
        for (group, start), sums in sorted(
            ((group, start), sums) for (start, group), sums in table.items()
        )
    ]
    totals: dict[str, tuple[datetime, datetime, _Sums, int]] = {}
    for (start, group), sums in table.items():
        if start + width > settled_by:
            continue
        first, last, total, count = totals.get(group, (start, start + width, _Sums(), 0))
        total.add(sums)
        totals[group] = (min(first, start), max(last, start + width), total, count + 1)
    return _shifted(lines, threshold) + [
        DriftLine(
            measure,
            first,
            last,
            group,
            total.ledger,
            total.provider,
            total.open,
            total.open_bound,
            _status(measure, total, True, threshold),
            total=True,
        )
        for group, (first, last, total, count) in sorted(totals.items())
        if count > 1  # one window's total is that window
    ]


def _shifted(lines: list[DriftLine], threshold: Threshold) -> list[DriftLine]:
    """``lines`` (by group, then time) where two neighbouring windows of a group drift
    apart by amounts that cancel: a call counted by the ledger as it was sent, by the
    vendor in the next window (latency, or its own clock)."""
    found = list(lines)
    for i in range(len(found) - 1):
        one, two = found[i], found[i + 1]
        if (
            one.status == two.status == "drift"
            and one.group == two.group
            and one.end == two.start
            and (one.difference > 0) != (two.difference > 0)
            and not threshold.beyond(
                one.measure, one.ledger + two.ledger, one.provider + two.provider
            )
        ):
            found[i] = dataclasses.replace(one, status="shifted")
            found[i + 1] = dataclasses.replace(two, status="shifted")
    return found


def check_drift(
    ledger: Ledger,
    vendor: Vendor,
    *,
    since: datetime,
    until: datetime | None = None,
    by: str | None = None,
    bucket: str = "1h",
    settle: timedelta = DEFAULT_SETTLE,
    cost_settle: timedelta = DEFAULT_COST_SETTLE,
    threshold: Threshold | None = None,
    admin: Any = None,
    timeout: float = 30.0,
    now: datetime | None = None,
) -> DriftReport:
    """Compare the ledger with ``vendor``'s usage and cost reports from ``since`` to
    ``until`` (default: now), by ``by`` (``model``, ``api_key``, ``project``, or
    None), tokens per ``bucket``. ``admin``: the SDK client that reads the reports
    (default: the vendor's, from its admin key variable; none set raises DriftOff).
    ``now`` (default: the ledger's clock) is when the check is made: a window is final
    once it ended ``settle`` before it (a day's costs, ``cost_settle``), and by
    ``until``. A report that cannot be read raises (ReportUnreadable, or the SDK's
    error)."""
    if by is not None and by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, not {by!r}")
    threshold = threshold or Threshold()
    now = now or ledger.views.now()
    until = until or now
    if admin is None:
        admin = vendor.admin_client(timeout)
        if admin is None:
            raise DriftOff(vendor.name, vendor.admin_key_env or "no variable (none named)")
    width = BUCKETS[bucket]
    day = BUCKETS["1d"]
    start, end = _floor(since, width), until
    notes: list[str] = []
    keys: list[KeyInfo] = []
    if by in ("api_key", "project"):
        listed = vendor.api_keys(admin)
        if listed is None:
            notes.append(f"{vendor.name} does not list its API keys: keys are not attributed")
        keys = listed or []
    groups = _Groups(by, keys)
    settled_by = min(now - settle, end)
    group_by = (by,) if by else ()
    untold = 0

    tokens: dict[str, dict[tuple[datetime, str], _Sums]] = {
        "input_tokens": defaultdict(_Sums),
        "output_tokens": defaultdict(_Sums),
    }
    usage = vendor.usage_report(admin, ReportQuery(start, end, bucket, group_by))
    if usage is None:
        notes.append(f"{vendor.name} has no usage report: tokens are not compared")
    else:
        for line in usage:
            group = groups.provider(line.model, line.api_key_id, line.project)
            tokens["input_tokens"][(line.start, group)].provider += line.input_tokens
            tokens["output_tokens"][(line.start, group)].provider += line.output_tokens
        for row in ledger.views.provider_usage(vendor.name, start=start, end=end, bucket=bucket):
            group = groups.ledger(row)
            for measure in ("input_tokens", "output_tokens"):
                sums = tokens[measure][(row.start, group)]
                sums.ledger += getattr(row, measure)
                sums.open += row.open
                sums.open_bound += row.open_tokens
                sums.untold += row.untold
            untold += row.untold
        if untold:
            notes.append(
                f"{untold} settled attempt(s) have no tokens recorded (settled by an "
                "operator, or before the ledger kept them): their windows' tokens are untold"
            )

    money: dict[tuple[datetime, str], _Sums] = defaultdict(_Sums)
    cost_start = _floor(since, day)
    if by is not None and by not in vendor.cost_groupings:
        notes.append(
            f"{vendor.name}'s cost report cannot be grouped by {by}: money is not compared"
        )
        costs = None
    else:
        costs = vendor.cost_report(admin, ReportQuery(cost_start, end, "1d", group_by))
        if costs is None:
            notes.append(f"{vendor.name} has no cost report: money is not compared")
    if costs is not None:
        for cost in costs:
            group = groups.provider(cost.model, cost.api_key_id, cost.project)
            money[(cost.start, group)].provider += cost.amount
        for row in ledger.views.provider_usage(vendor.name, start=cost_start, end=end, bucket="1d"):
            sums = money[(row.start, groups.ledger(row))]
            sums.ledger += row.charged
            sums.open += row.open
            sums.open_bound += row.held

    cost_settled_by = min(now - cost_settle, end)
    lines = [
        *_lines("input_tokens", tokens["input_tokens"], width, settled_by, threshold),
        *_lines("output_tokens", tokens["output_tokens"], width, settled_by, threshold),
        *_lines("cost", money, day, cost_settled_by, threshold),
    ]
    return DriftReport(vendor.name, start, end, by, bucket, lines, notes)
