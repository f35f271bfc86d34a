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
  they can account for (no more than what they hold, or the tokens of that measure
  they allow) is ``open``, for reconciliation to settle, not drift;
- settled attempts with no tokens recorded (settled by an operator, or before the
  ledger kept them) account for no more than the tokens of that measure their
  requests allowed: a difference within that is ``untold``, one beyond it drifts;
- two neighbouring windows whose differences cancel (within the thresholds) are
  ``shifted``: a call sent as one window ended, counted by the vendor in the next;
- a difference beyond both thresholds, the relative and the absolute, once what the
  open and untold attempts can account for is set aside, is ``drift``;
- each group and measure also has a ``total`` line over its final windows, judged the
  same way: a leak too small for any one window to show adds up there.

Keys are attributed by what the ledger recorded when a call was sent, its key's hint,
never by what the key is called now: a key rotated or deleted since moves nothing
(see :class:`_Groups`).

Tokens are compared per usage bucket (1m, 1h or 1d); money per day, the cost reports'
only bucket. This module reads; it never writes the ledger.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import DriftOff
from .ledger import Ledger
from .ledger.usage import UsageRow
from .providers.base import SNAPSHOT_SUFFIX, Vendor
from .providers.reports import (
    BUCKETS,
    GROUPINGS,
    CostLine,
    KeyInfo,
    ReportQuery,
    UsageLine,
    hints_match,
)

#: What a line compares.
MEASURES = ("input_tokens", "output_tokens", "cost")
#: What a line's comparison came to.
STATUSES = ("ok", "drift", "open", "shifted", "untold", "pending")
#: The group of a line not grouped.
ALL = "all"
#: The group of the traffic of keys the vendor does not list (deleted, or never listed):
#: the ledger's by their hints, the provider's by their ids, compared together.
UNLISTED = "(unlisted keys)"
#: The ledger's traffic whose key was not recorded, and the provider's named by no key.
NO_KEY_RECORDED = "(no key recorded)"
NO_KEY = "(no key)"
#: The project (Anthropic: the workspace) of a key that names none.
DEFAULT_PROJECT = "(default)"
_TOKENS = ("input_tokens", "output_tokens")
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
        """Whether two figures are apart by more than both thresholds (the relative one
        taken of the larger)."""
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
    #: (the money they hold, or the tokens of this measure they allow)
    open: int
    open_bound: int
    status: str
    #: a group's and measure's sum over its final windows (``start`` to ``end``)
    total: bool = False
    #: settled attempts with no tokens recorded, and the tokens of this measure their
    #: requests allowed
    untold: int = 0
    untold_bound: int = 0

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
            "untold": self.untold,
            "untold_bound": self.untold_bound,
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
    """One window's (or a total's) figures of one group and measure."""

    ledger: int = 0
    provider: int = 0
    open: int = 0
    #: what the open attempts can account for: the money they hold, or the tokens of
    #: this measure they allow
    open_bound: int = 0
    untold: int = 0
    #: the tokens of this measure the untold attempts' requests allowed
    untold_bound: int = 0
    #: open or untold attempts that recorded no bound: they allow any number
    unbounded: int = 0
    #: of a total: what such attempts accounted for in their own windows
    unbounded_excess: int = 0

    def excuse(self) -> int:
        """The most of the provider's excess the open and untold attempts can account
        for: what each allowed, in each measure apart. One that allowed any number
        accounts for its window's whole excess, and no other window's."""
        bounded = self.open_bound + self.untold_bound + self.unbounded_excess
        if self.unbounded:
            return max(bounded, self.provider - self.ledger)
        return bounded

    def add(self, window: _Sums) -> None:
        """Add ``window`` to this total."""
        self.ledger += window.ledger
        self.provider += window.provider
        self.open += window.open
        self.open_bound += window.open_bound
        self.untold += window.untold
        self.untold_bound += window.untold_bound
        self.unbounded_excess += window.excuse() - window.open_bound - window.untold_bound


class _Groups:
    """Names each side's lines by the grouping asked for.

    A key is named by what the ledger recorded when a call was sent with it, its hint:
    the hint names the keys of the vendor's list it matches, and the provider's lines
    name a key by its id. Keys one hint matches (two keys whose hints look alike) are
    one group. A key the list does not hold (deleted since, or never listed) cannot be
    told from another such key: the traffic of all of them, the ledger's and the
    provider's, is one group, :data:`UNLISTED`. So a key rotated or deleted moves its
    traffic on both sides at once, and nothing reads as drift for it."""

    def __init__(self, by: str | None, keys: Sequence[KeyInfo], hints: Iterable[str]) -> None:
        self.by = by
        self.keys = {key.id: key for key in keys}
        self._root: dict[str, str] = {}
        self._names: dict[str, list[str]] = {}
        for hint in set(hints):
            names = sorted({self._name(key) for key in keys if hints_match(hint, key.hint)})
            self._names[hint] = names
            for name in names:
                self._root.setdefault(name, name)
            for name in names[1:]:
                self._root[self._find(name)] = self._find(names[0])
        self._members: dict[str, set[str]] = defaultdict(set)
        for name in list(self._root):
            self._members[self._find(name)].add(name)

    def _name(self, key: KeyInfo) -> str:
        return key.id if self.by == "api_key" else key.project or DEFAULT_PROJECT

    def _find(self, name: str) -> str:
        root = self._root.get(name, name)
        return root if root == name else self._find(root)

    def _label(self, name: str) -> str:
        """A group's name: of one key (project), or of the keys one hint matched."""
        members = self._members.get(self._find(name), set())
        return " + ".join(sorted(members)) if len(members) > 1 else name

    def ambiguous(self) -> int:
        """How many of the ledger's hints match more than one listed key."""
        return sum(1 for names in self._names.values() if len(names) > 1)

    def ledger(self, row: UsageRow) -> str:
        if self.by is None:
            return ALL
        if self.by == "model":
            return model_family(row.model)
        if not row.credential:
            return NO_KEY_RECORDED
        names = self._names.get(row.credential)
        return self._label(names[0]) if names else UNLISTED

    def provider(self, model: str | None, api_key_id: str | None, project: str | None) -> str:
        if self.by is None:
            return ALL
        if self.by == "model":
            return model_family(model)
        if api_key_id is None:  # a report not grouped by key (Anthropic's costs)
            return NO_KEY if self.by == "api_key" else self._label(project or DEFAULT_PROJECT)
        key = self.keys.get(api_key_id)
        return UNLISTED if key is None else self._label(self._name(key))


def _status(measure: str, sums: _Sums, final: bool, threshold: Threshold) -> str:
    if not final:
        return "pending"
    if not threshold.beyond(measure, sums.ledger, sums.provider):
        return "ok"
    if sums.provider > sums.ledger and _accounted_for(measure, sums, threshold):
        return "open" if sums.open else "untold"
    return "drift"


def _accounted_for(measure: str, sums: _Sums, threshold: Threshold) -> bool:
    """Whether the provider's excess is within what the open and untold attempts can
    account for, give or take the thresholds: what is left beyond it drifts."""
    most = sums.ledger + sums.excuse()
    return sums.provider <= most or not threshold.beyond(measure, most, sums.provider)


def _line(
    measure: str,
    start: datetime,
    end: datetime,
    group: str,
    sums: _Sums,
    status: str,
    total: bool = False,
) -> DriftLine:
    return DriftLine(
        measure,
        start,
        end,
        group,
        sums.ledger,
        sums.provider,
        sums.open,
        sums.open_bound,
        status,
        total=total,
        untold=sums.untold,
        untold_bound=sums.untold_bound,
    )


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
        _line(
            measure,
            start,
            start + width,
            group,
            sums,
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
        _line(measure, first, last, group, total, _status(measure, total, True, threshold), True)
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


def _groups(
    vendor: Vendor, admin: Any, by: str | None, rows: Sequence[UsageRow], notes: list[str]
) -> _Groups:
    """How the lines are grouped: by key or project, from the vendor's key list and the
    hints the ledger recorded."""
    keys: list[KeyInfo] = []
    if by in ("api_key", "project"):
        listed = vendor.api_keys(admin)
        if listed is None:
            notes.append(f"{vendor.name} does not list its API keys: keys are not attributed")
        keys = listed or []
    groups = _Groups(by, keys, (row.credential for row in rows if row.credential))
    if groups.ambiguous():
        notes.append(
            f"{groups.ambiguous()} key hint(s) match more than one listed key: "
            "those keys are one group"
        )
    return groups


def _report_groups(by: str | None, groupings: Sequence[str]) -> tuple[str, ...]:
    """What a report is asked to group by: by project, by key too where it can (a key
    the vendor no longer lists is told apart from its project)."""
    if by is None:
        return ()
    if by == "project" and "api_key" in groupings:
        return ("project", "api_key")
    return (by,)


def _token_sums(
    usage: Sequence[UsageLine], rows: Sequence[UsageRow], groups: _Groups
) -> dict[str, dict[tuple[datetime, str], _Sums]]:
    """Each token measure's figures by window and group, the provider's and the
    ledger's, with what the ledger's open and untold attempts allowed of it."""
    tokens: dict[str, dict[tuple[datetime, str], _Sums]] = {m: defaultdict(_Sums) for m in _TOKENS}
    for line in usage:
        group = groups.provider(line.model, line.api_key_id, line.project)
        tokens["input_tokens"][(line.start, group)].provider += line.input_tokens
        tokens["output_tokens"][(line.start, group)].provider += line.output_tokens
    for row in rows:
        group = groups.ledger(row)
        for measure in _TOKENS:
            sums = tokens[measure][(row.start, group)]
            sums.ledger += getattr(row, measure)
            sums.open += row.open
            sums.untold += row.untold
            open_bound, untold_bound, unbounded = row.allowed(measure)
            sums.open_bound += open_bound
            sums.untold_bound += untold_bound
            sums.unbounded += unbounded
    return tokens


def _untold_notes(rows: Sequence[UsageRow]) -> list[str]:
    untold = sum(row.untold for row in rows)
    if not untold:
        return []
    note = (
        f"{untold} settled attempt(s) have no tokens recorded (settled by an operator, or "
        "before the ledger kept them): their windows are judged on the most their "
        "requests allowed"
    )
    if any(row.unbounded_input or row.unbounded_output for row in rows):
        note += "; attempts with no bound recorded allow any number in their own window"
    return [note]


def _money_sums(
    costs: Sequence[CostLine], rows: Sequence[UsageRow], groups: _Groups
) -> dict[tuple[datetime, str], _Sums]:
    money: dict[tuple[datetime, str], _Sums] = defaultdict(_Sums)
    for cost in costs:
        group = groups.provider(cost.model, cost.api_key_id, cost.project)
        money[(cost.start, group)].provider += cost.amount
    for row in rows:
        sums = money[(row.start, groups.ledger(row))]
        sums.ledger += row.charged
        sums.open += row.open
        sums.open_bound += row.held
    return money


def _costs(
    vendor: Vendor, admin: Any, query: ReportQuery, by: str | None, notes: list[str]
) -> list[CostLine] | None:
    """The vendor's cost report over ``query``, where it can be grouped as asked."""
    if by is not None and by not in vendor.cost_groupings:
        notes.append(
            f"{vendor.name}'s cost report cannot be grouped by {by}: money is not compared"
        )
        return None
    costs = vendor.cost_report(admin, query)
    if costs is None:
        notes.append(f"{vendor.name} has no cost report: money is not compared")
    return costs


def _unlisted_money(vendor: Vendor, money: dict[tuple[datetime, str], _Sums]) -> list[str]:
    """What the notes say where the ledger's money of unlisted keys has no counterpart:
    a cost report that names no key keeps it under its project."""
    if "api_key" in vendor.cost_groupings or all(group != UNLISTED for _, group in money):
        return []
    return [
        f"{vendor.name}'s cost report names no key: the money of keys it does not list is "
        f"under their project there, and under {UNLISTED} in the ledger"
    ]


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
    start, end = _floor(since, width), until
    cost_start = _floor(since, BUCKETS["1d"])
    sent = ledger.views.provider_usage(vendor.name, start=start, end=end, bucket=bucket)
    charged = ledger.views.provider_usage(vendor.name, start=cost_start, end=end, bucket="1d")
    notes: list[str] = []
    groups = _groups(vendor, admin, by, [*sent, *charged], notes)

    tokens: dict[str, dict[tuple[datetime, str], _Sums]] = {m: {} for m in _TOKENS}
    asked = _report_groups(by, GROUPINGS)
    usage = vendor.usage_report(admin, ReportQuery(start, end, bucket, asked))
    if usage is None:
        notes.append(f"{vendor.name} has no usage report: tokens are not compared")
    else:
        tokens = _token_sums(usage, sent, groups)
        notes += _untold_notes(sent)
    asked = _report_groups(by, vendor.cost_groupings)
    costs = _costs(vendor, admin, ReportQuery(cost_start, end, "1d", asked), by, notes)
    money = {} if costs is None else _money_sums(costs, charged, groups)
    notes += _unlisted_money(vendor, money)

    settled_by = min(now - settle, end)
    cost_settled_by = min(now - cost_settle, end)
    lines = [
        *_lines("input_tokens", tokens["input_tokens"], width, settled_by, threshold),
        *_lines("output_tokens", tokens["output_tokens"], width, settled_by, threshold),
        *_lines("cost", money, BUCKETS["1d"], cost_settled_by, threshold),
    ]
    return DriftReport(vendor.name, start, end, by, bucket, lines, notes)
