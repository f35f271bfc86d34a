"""The ledger's three faces, each the API of one kind of caller, over one core:

- :class:`Ledger`, the operator's: budgets, balances, holds and attempts, operations,
  resolving an outcome, the audit;
- :class:`CallLedger` (``ledger.calls``), what sends billable calls uses: hold, grant,
  describe and settle an attempt (the hold API of a ledger used without Celery), and
  the protocol a delivery runs on (admit a call, end it, end the run, side effects);
- :class:`Upkeep` (``ledger.upkeep``), what the beat jobs use: open periods, flag stale
  holds, adopt what dead runs left, claim unknown outcomes for reconciliation and
  resolve them, purge old payloads;
- :class:`Views` (``ledger.views``), what a dashboard reads: the reports, spend over
  time, settled attempts against their estimates, open attempts, an attempt's journal
  and operations' attempts (reads only: writes go through the operator's face).

Each face offers its methods of the core (:class:`~.core.LedgerCore`) as they are:
the same signature and docstring, looked up on the core at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from sqlalchemy import Engine

from .base import Clock
from .core import LedgerCore

__all__ = ["CallLedger", "Ledger", "Upkeep", "Views"]

P = ParamSpec("P")
R = TypeVar("R")


class _Face:
    """One caller's view of a ledger core."""

    def __init__(self, core: LedgerCore) -> None:
        self._core = core

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._core.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.url!r})"


class _Offer(Generic[P, R]):
    """A method of the core as a face offers it."""

    def __init__(self, method: Callable[Concatenate[LedgerCore, P], R]) -> None:
        self._name = method.__name__
        self.__doc__ = method.__doc__
        self.__wrapped__ = method

    @overload
    def __get__(self, face: None, owner: type | None = None) -> _Offer[P, R]: ...
    @overload
    def __get__(self, face: _Face, owner: type | None = None) -> Callable[P, R]: ...
    def __get__(self, face: _Face | None, owner: type | None = None) -> Any:
        if face is None:
            return self
        # Looked up at each call, so the core's own method is what runs.
        return getattr(face._core, self._name)


class CallLedger(_Face):
    """What sends billable calls uses (``ledger.calls``): an attempt's hold, its one
    grant of a send, what it is, and its settlement; and the delivery's protocol."""

    now = _Offer(LedgerCore.now)
    provider_key = _Offer(LedgerCore.provider_key)
    # one attempt: hold, grant, describe, settle
    reserve = _Offer(LedgerCore.reserve)
    mark_sending = _Offer(LedgerCore.mark_sending)
    describe_attempt = _Offer(LedgerCore.describe_attempt)
    record_call = _Offer(LedgerCore.record_call)
    record_request_id = _Offer(LedgerCore.record_request_id)
    settle = _Offer(LedgerCore.settle)
    release = _Offer(LedgerCore.release)
    mark_unknown = _Offer(LedgerCore.mark_unknown)
    # an operation's run: admit its calls, end them, end the run
    admit = _Offer(LedgerCore.admit)
    admit_call = _Offer(LedgerCore.admit_call)
    end_call = _Offer(LedgerCore.end_call)
    end_run = _Offer(LedgerCore.end_run)
    finish_operation = _Offer(LedgerCore.finish_operation)
    fail_operation = _Offer(LedgerCore.fail_operation)
    # once(): side effects that are not calls
    side_effect = _Offer(LedgerCore.side_effect)
    start_side_effect = _Offer(LedgerCore.start_side_effect)
    finish_side_effect = _Offer(LedgerCore.finish_side_effect)
    forget_side_effect = _Offer(LedgerCore.forget_side_effect)


class Upkeep(_Face):
    """What the beat jobs use (``ledger.upkeep``)."""

    now = _Offer(LedgerCore.now)
    provider_key = _Offer(LedgerCore.provider_key)
    open_period = _Offer(LedgerCore.open_period)
    flag_stale = _Offer(LedgerCore.flag_stale)
    return_grants = _Offer(LedgerCore.return_grants)
    audit_size = _Offer(LedgerCore.audit_size)
    mark_orphans_unknown = _Offer(LedgerCore.mark_orphans_unknown)
    claim_unknown = _Offer(LedgerCore.claim_unknown)
    resolve_attempt = _Offer(LedgerCore.resolve_attempt)
    distrust = _Offer(LedgerCore.distrust)
    conclude_operation = _Offer(LedgerCore.conclude_operation)
    purge_operations = _Offer(LedgerCore.purge_operations)
    make_partitions = _Offer(LedgerCore.make_partitions)
    retention = _Offer(LedgerCore.retention)
    retain = _Offer(LedgerCore.retain)


class Views(_Face):
    """What a dashboard reads (``ledger.views``): nothing here writes."""

    now = _Offer(LedgerCore.now)
    budgets = _Offer(LedgerCore.budgets)
    report = _Offer(LedgerCore.report)
    attempt = _Offer(LedgerCore.attempt)
    attempt_journal = _Offer(LedgerCore.attempt_journal)
    open_attempts = _Offer(LedgerCore.open_attempts)
    operations = _Offer(LedgerCore.operations)
    operation_history = _Offer(LedgerCore.operation_history)
    operation_attempts = _Offer(LedgerCore.operation_attempts)
    spend_series = _Offer(LedgerCore.spend_series)
    spend_since = _Offer(LedgerCore.spend_since)
    settled_stats = _Offer(LedgerCore.settled_stats)


class Ledger(_Face):
    """A budget ledger on PostgreSQL (``postgresql+psycopg://...``) or SQLite: the
    operator's API. ``calls`` is what sends billable calls uses; ``upkeep``, what the
    beat jobs use; ``views``, what a dashboard reads; all four share one engine.

    ``clock`` returns the current time as an aware datetime; tests pass their own to
    move between periods. ``max_stored_bytes`` caps what one stored result or answer
    may take (default: ``BUDGET_TASKS_MAX_STORED_BYTES``, else 1 MiB); past it only its
    digest and size are kept, and a replay of it is refused (AnswerNotKept). Other
    keyword arguments go to SQLAlchemy's ``create_engine``.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        max_stored_bytes: int | None = None,
        **engine_options: Any,
    ) -> None:
        super().__init__(
            LedgerCore(url, clock=clock, max_stored_bytes=max_stored_bytes, **engine_options)
        )
        self.calls = CallLedger(self._core)
        self.upkeep = Upkeep(self._core)
        self.views = Views(self._core)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for reads of your own; every write goes through the
        ledger's methods)."""
        return self._core.engine

    create_schema = _Offer(LedgerCore.create_schema)
    dispose = _Offer(LedgerCore.dispose)
    now = _Offer(LedgerCore.now)
    provider_key = _Offer(LedgerCore.provider_key)
    # budgets
    create_budget = _Offer(LedgerCore.create_budget)
    budget = _Offer(LedgerCore.budget)
    budgets = _Offer(LedgerCore.budgets)
    set_cap = _Offer(LedgerCore.set_cap)
    set_slices = _Offer(LedgerCore.set_slices)
    freeze = _Offer(LedgerCore.freeze)
    unfreeze = _Offer(LedgerCore.unfreeze)
    # balances
    balance = _Offer(LedgerCore.balance)
    report = _Offer(LedgerCore.report)
    # holds and attempts
    holds = _Offer(LedgerCore.holds)
    attempt = _Offer(LedgerCore.attempt)
    attempts = _Offer(LedgerCore.attempts)
    # operations
    operation = _Offer(LedgerCore.operation)
    operations = _Offer(LedgerCore.operations)
    operation_history = _Offer(LedgerCore.operation_history)
    actions = _Offer(LedgerCore.actions)
    reopen_operation = _Offer(LedgerCore.reopen_operation)
    # an outcome resolved by hand, a provider's correction
    resolve_attempt = _Offer(LedgerCore.resolve_attempt)
    adjust = _Offer(LedgerCore.adjust)
    # the counters against the journal
    audit = _Offer(LedgerCore.audit)
