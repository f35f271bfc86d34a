"""Round trips and CPU per first run and per replay of a delivery through ``Ledger`` on
PostgreSQL: the statement-by-statement path beside one call per transaction
(``server_functions=True``), in the same run.

    .venv/bin/python benchmarks/round_trips.py [--runs 2000] [--rounds 2] [--warmup 200]

A first run is what a BudgetTask does per task whose call is answered at once: the
delivery's admission (``ledger.calls.admit`` with its main call, described as a real
call is, and the plan a BudgetTask gives, so that the attempt is reserved, granted and
described in the same commit), then ``finish_operation`` (the call settled at its
actual, the result stored, the lease given back). A replay is the same delivery again
once it finished: its admission returns the stored result.

Round trips are counted by libpq, not by the library: the ledger's one pooled
connection (``pool_size=1``) traces its protocol (``PQtrace``) to a file, and every
round trip ends with one ``ReadyForQuery`` message from the server, counted after each
admission, settlement and replay. Each ledger is warmed up first (its connection and
session settings, the database clock, the budget chain and period, psycopg's prepared
statements), so none of that is counted; the ledger's check of the database clock
(a transaction of its own, once a minute) is counted where it falls, which is why the
mean may exceed the usual count of a run by a little.

CPU is measured in a second pass of as many first runs and replays with the trace off
(writing it costs the client some 10 %): this process's CPU (``time.process_time``) and
the PostgreSQL backend's (utime + stime in ``/proc/<pid>/stat``: the database on this
host), per run. The database is vacuumed before each such pass (autovacuum is off on
these machines). The modes alternate in rounds, each on a budget of its own in one
scratch database; the medians of the rounds are shown.

Targets of the one-call path: at most 2 round trips per first run, 1 per replay, and
CPU (client + PostgreSQL) per first run at most 0.5 x the statement path's.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlalchemy import Engine, event  # noqa: E402

from benchmarks.ledger_bench import ADMIN_URL, _vacuumed, scratch_database  # noqa: E402
from budget_tasks import CallFacts, Ledger  # noqa: E402
from budget_tasks._trust import Bound  # noqa: E402
from budget_tasks.delivery.calls import CallPath, CallSite  # noqa: E402
from budget_tasks.ledger.leases import owner_id  # noqa: E402
from budget_tasks.ledger.operations import Decision, OperationStart  # noqa: E402
from budget_tasks.ledger.records import (  # noqa: E402
    Answered,
    CallAdmission,
    CallAsk,
    CallEnd,
)
from budget_tasks.providers import estimates  # noqa: E402
from budget_tasks.providers.base import request_digest  # noqa: E402
from budget_tasks.providers.openai import LOOKUP_CHAT  # noqa: E402

#: round trips per first run and per replay, the one-call path's targets
TARGETS = {"first run": 2, "replay": 1}
#: the one-call path's CPU per first run (client + PostgreSQL) / the statement path's
CPU_TARGET = 0.5
#: the two modes: whether the Ledger is made with ``server_functions``
MODES = {"statements": False, "functions": True}
#: one connection per ledger, so that one backend and one trace see every round trip
POOL: dict[str, Any] = {"pool_size": 1, "max_overflow": 0}
WARMUP = 200

#: the delivery's settings as a BudgetTask's defaults give them
LEASE = timedelta(seconds=60)
MAX_RUNS = 5
TASK = "bench"
#: the call each first run makes, described as the openai transport describes it
MODEL = "gpt-4o-mini"
REQUEST = {
    "model": MODEL,
    "max_completion_tokens": 256,
    "messages": [{"role": "user", "content": "Summarise the quarterly report in three lines."}],
}
TIMEOUT_S = 600.0  # the openai SDK's default
#: the hint of the API key a call was sent with, as the ledger keeps it
HINT = "sk-proj-benchmark...abcd"
RESULT = {"content": "Revenue rose; costs fell; the outlook is steady.", "model": MODEL}

FLAGS = psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE
#: a request that the server answers with one ReadyForQuery (the extended protocol's
#: Sync, a simple Query), and that answer, as lines of the trace in regress mode
_EVENTS = re.compile(rb"^(?:F\t\d+\t(Sync|Query)|B\t\d+\t(ReadyForQuery))\b", re.MULTILINE)
_TICKS = os.sysconf("SC_CLK_TCK")


class Tracer:
    """libpq's protocol trace of a ledger's pooled connection, started as it connects
    (after the engine's own listener set the session up), into a new file per traced
    pass; ``count`` says how many round trips began since it was last called.

    libpq writes what it sends at once, but what it receives only at its next send (or
    at ``untrace``): a call's last answer is in the file only once the next call has
    begun. So a round trip is counted by its request: a Sync or a simple Query sent
    while no earlier one waits for its ReadyForQuery (requests sent before the answers,
    as in pipeline mode, share one round trip). Every ReadyForQuery is counted too, and
    the pass is checked to end with none missing."""

    def __init__(self, engine: Engine) -> None:
        self.pgconn: Any = None
        self.backend_pid = 0
        self.connections = 0
        #: this pass: requests sent, their ReadyForQuery answers read
        self.requests = 0
        self.answers = 0
        self._fd = -1
        self._reader: IO[bytes] | None = None
        self._partial = b""
        self._wanted = True
        event.listen(engine, "connect", self._connected)

    def _connected(self, dbapi_connection: Any, _record: Any) -> None:
        self.pgconn = dbapi_connection.pgconn
        self.backend_pid = int(dbapi_connection.info.backend_pid)
        self.connections += 1
        if self._wanted:
            self._attach()

    def _attach(self) -> None:
        if self._fd < 0:
            self._fd, path = tempfile.mkstemp(prefix="bt-round-trips-", suffix=".trace")
            self._reader = open(path, "rb")  # noqa: SIM115 -- read as it grows, until stop()
            os.unlink(path)  # gone once both ends are closed
            self.requests = self.answers = 0
        # PQtrace resets the flags: set them after it, each time
        self.pgconn.trace(self._fd)
        self.pgconn.set_trace_flags(FLAGS)

    def start(self) -> None:
        """Trace from here on (into a new file)."""
        self._wanted = True
        if self.pgconn is not None:
            self._attach()

    def count(self) -> int:
        """Round trips begun since the last call."""
        if self._reader is None:
            return 0
        data = self._partial + self._reader.read()
        lines, _, self._partial = data.rpartition(b"\n")
        trips = 0
        for found in _EVENTS.finditer(lines):
            if found[2] is not None:
                self.answers += 1
            else:
                trips += self.requests == self.answers  # none waiting: a new round trip
                self.requests += 1
        return trips

    def stop(self) -> int:
        """Stop tracing (libpq writes what it holds); the round trips not counted yet."""
        self._wanted = False
        if self.pgconn is not None:
            self.pgconn.untrace()
        rest = self.count()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._partial = b""
        return rest


def _backend_cpu(pid: int) -> float:
    """CPU seconds a PostgreSQL backend has used; NaN if it is not a process here."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime, in clock ticks


def _main_call(budget: str) -> CallAsk:
    """The main call of every delivery, as a BudgetTask asks it to be admitted: its
    estimate, the price table it came from, and what the call is (each delivery gives
    it its own fingerprint)."""
    estimate = estimates.openai_chat(REQUEST)
    facts = CallFacts(
        LOOKUP_CHAT, estimate.model, TIMEOUT_S, request_digest(REQUEST), Bound.of(estimate)
    )
    return CallAsk(budget, estimate.amount, None, estimate.price_version, facts)


@dataclass
class _Mode:
    """One mode's ledger, on its own budget and its own traced connection."""

    name: str
    ledger: Ledger
    tracer: Tracer
    call: CallAsk
    owner: str

    @staticmethod
    def plan(key: str, ask: CallAsk) -> Callable[[CallAdmission], tuple[str, str] | None]:
        """The plan a BudgetTask gives its main call (``CallPath.admit``): the attempt
        reserved and granted at once where nothing earlier is left at call 0."""

        def plan(here: CallAdmission) -> tuple[str, str] | None:
            site = CallSite(
                key,
                ask,
                0,
                run_reason=here.next_reason or "first",
                next_reason=here.next_reason,
            )
            return CallPath._at_once(site, here)

        return plan

    def admit(self, key: str, fingerprint: str) -> OperationStart:
        # the main call carries the delivery's fingerprint, as a BudgetTask's does
        ask = replace(self.call, fingerprint=fingerprint)
        return self.ledger.calls.admit(
            key,
            fingerprint=fingerprint,
            owner=self.owner,
            lease=LEASE,
            max_runs=MAX_RUNS,
            task=TASK,
            payload=None,
            call=ask,
            plan=self.plan(key, ask),
        )

    def finish(self, key: str, start: OperationStart) -> None:
        here = start.call
        if start.decision is not Decision.RUN or here is None or here.reservation is None:
            raise RuntimeError(f"{key}: not granted at once ({start.decision.value})")
        attempt = here.reservation.key
        actual = self.call.amount * 7 // 10
        # what a real answer says, written with the settlement as a task writes it
        said = Answered(
            f"req_{key}", f"chatcmpl-{key}", "openai", HINT, 120, 40, "gpt-4o-mini-2024-07-18"
        )
        ended = CallEnd(attempt, "settle", actual, answered=said)
        self.ledger.calls.finish_operation(
            start.operation_id, result=RESULT, call=ended, owner=self.owner
        )

    def replay(self, key: str, fingerprint: str) -> None:
        start = self.admit(key, fingerprint)
        if start.decision is not Decision.REPLAY or start.result != RESULT:
            raise RuntimeError(f"{key}: not replayed ({start.decision.value})")


def _keys(mode: str, label: str, runs: int) -> list[tuple[str, str]]:
    """Idempotency keys and fingerprints (a digest of the task's arguments)."""
    tag = uuid.uuid4().hex[:8]
    keys = [f"rt-{mode}-{label}-{tag}-{n}" for n in range(runs)]
    return [(key, hashlib.sha256(key.encode()).hexdigest()) for key in keys]


@dataclass
class Counted:
    """Round trips of each run of one traced pass, counted one by one."""

    admissions: list[int]
    settlements: list[int]
    replays: list[int]
    #: ReadyForQuery messages in the pass's trace: the round trips, unless requests
    #: were pipelined (several answered in one)
    answers: int

    @property
    def first_runs(self) -> list[int]:
        return [a + s for a, s in zip(self.admissions, self.settlements, strict=True)]


def _counted(mode: _Mode, runs: int) -> Counted:
    keys = _keys(mode.name, "counted", runs)
    tracer = mode.tracer
    connections = tracer.connections
    tracer.start()
    admissions, settlements, replays = [], [], []
    for key, fingerprint in keys:
        start = mode.admit(key, fingerprint)
        admissions.append(tracer.count())
        mode.finish(key, start)
        settlements.append(tracer.count())
    for key, fingerprint in keys:
        mode.replay(key, fingerprint)
        replays.append(tracer.count())
    if tracer.stop():
        raise RuntimeError("a round trip began after the pass ended")
    if tracer.requests != tracer.answers:
        raise RuntimeError(f"{tracer.requests} requests, {tracer.answers} ReadyForQuery")
    if tracer.connections != connections:
        raise RuntimeError(f"{mode.name}: the ledger's connection was replaced during a pass")
    return Counted(admissions, settlements, replays, tracer.answers)


@dataclass
class Timed:
    """CPU (ms) per run of one untraced pass, this process's and PostgreSQL's, and the
    wall time per first run."""

    client_ms: float
    backend_ms: float
    replay_client_ms: float
    replay_backend_ms: float
    wall_ms: float


def _timed(mode: _Mode, runs: int) -> Timed:
    keys = _keys(mode.name, "timed", runs)
    pid, connections = mode.tracer.backend_pid, mode.tracer.connections
    per_run = 1000.0 / runs
    wall, client, backend = time.perf_counter(), time.process_time(), _backend_cpu(pid)
    for key, fingerprint in keys:
        mode.finish(key, mode.admit(key, fingerprint))
    wall_ms = (time.perf_counter() - wall) * per_run
    client_ms = (time.process_time() - client) * per_run
    backend_ms = (_backend_cpu(pid) - backend) * per_run
    client, backend = time.process_time(), _backend_cpu(pid)
    for key, fingerprint in keys:
        mode.replay(key, fingerprint)
    replay_client_ms = (time.process_time() - client) * per_run
    replay_backend_ms = (_backend_cpu(pid) - backend) * per_run
    if mode.tracer.connections != connections:
        raise RuntimeError(f"{mode.name}: the ledger's connection was replaced during a pass")
    return Timed(client_ms, backend_ms, replay_client_ms, replay_backend_ms, wall_ms)


@dataclass
class Round:
    """One round of one mode: its traced pass and its untraced one."""

    counted: Counted
    timed: Timed

    @property
    def first_trips(self) -> float:
        return statistics.fmean(self.counted.first_runs)

    @property
    def pipelined(self) -> bool:
        """Whether some round trip carried several requests."""
        counted = self.counted
        return counted.answers != sum(counted.first_runs) + sum(counted.replays)

    @property
    def replay_trips(self) -> float:
        return statistics.fmean(self.counted.replays)


@dataclass
class ModeFigures:
    """One mode: each round, and the medians of the rounds."""

    mode: str
    rounds: list[Round] = field(default_factory=list)

    def _median(self, figure: Callable[[Round], float]) -> float:
        return statistics.median(figure(r) for r in self.rounds) if self.rounds else math.nan

    @property
    def first_trips(self) -> float:
        """Round trips per first run (mean of a round; the median of the rounds)."""
        return self._median(lambda r: r.first_trips)

    @property
    def replay_trips(self) -> float:
        return self._median(lambda r: r.replay_trips)

    @property
    def client_ms(self) -> float:
        """This process's CPU per first run."""
        return self._median(lambda r: r.timed.client_ms)

    @property
    def backend_ms(self) -> float:
        """The PostgreSQL backend's CPU per first run."""
        return self._median(lambda r: r.timed.backend_ms)

    @property
    def cpu_ms(self) -> float:
        return self.client_ms + self.backend_ms

    @property
    def replay_cpu_ms(self) -> float:
        return self._median(lambda r: r.timed.replay_client_ms + r.timed.replay_backend_ms)

    @property
    def wall_ms(self) -> float:
        return self._median(lambda r: r.timed.wall_ms)

    def counts(self, kind: str) -> Counter[int]:
        """How many runs of every round took each number of round trips: ``first run``,
        ``admission``, ``settlement`` or ``replay``."""
        found: Counter[int] = Counter()
        for r in self.rounds:
            found.update(
                {
                    "first run": r.counted.first_runs,
                    "admission": r.counted.admissions,
                    "settlement": r.counted.settlements,
                    "replay": r.counted.replays,
                }[kind]
            )
        return found

    @property
    def pipelined(self) -> bool:
        return any(r.pipelined for r in self.rounds)

    def usual(self, kind: str) -> int:
        """The number of round trips most runs took."""
        return self.counts(kind).most_common(1)[0][0]


@dataclass
class RoundTripsResult:
    runs: int
    rounds: int
    modes: dict[str, ModeFigures]
    audit: list[str]

    def ratio(self, figure: Callable[[ModeFigures], float]) -> float:
        """functions / statements of a figure."""
        return figure(self.modes["functions"]) / figure(self.modes["statements"])

    def targets(self) -> list[tuple[str, str, bool]]:
        """Each target of the one-call path: what it is, the figure, and whether met."""
        functions = self.modes["functions"]
        first, replay = functions.usual("first run"), functions.usual("replay")
        cpu = self.ratio(lambda m: m.cpu_ms)
        return [
            (
                f"round trips per first run <= {TARGETS['first run']}",
                f"{first} ({functions.first_trips:.2f} on average)",
                first <= TARGETS["first run"],
            ),
            (
                f"round trips per replay == {TARGETS['replay']}",
                f"{replay} ({functions.replay_trips:.2f} on average)",
                replay == TARGETS["replay"],
            ),
            (
                f"CPU per first run, functions / statements <= {CPU_TARGET}",
                f"{cpu:.2f}",
                cpu <= CPU_TARGET,
            ),
        ]


def _warm(mode: _Mode, runs: int) -> None:
    """Connect and fill what a worker caches (the database clock, the budget chain and
    period, psycopg's prepared statements): none of it is counted."""
    keys = _keys(mode.name, "warm", runs)
    for key, fingerprint in keys:
        mode.finish(key, mode.admit(key, fingerprint))
    for key, fingerprint in keys:
        mode.replay(key, fingerprint)
    mode.tracer.stop()


def run(
    admin_url: str = ADMIN_URL,
    *,
    runs: int = 2_000,
    rounds: int = 2,
    warmup: int = WARMUP,
    report: Callable[[str, int, Round], None] | None = None,
) -> RoundTripsResult:
    """Both modes in one scratch database, alternating for ``rounds`` rounds of
    ``runs`` first runs and as many replays (traced, then timed) each."""
    figures = {name: ModeFigures(name) for name in MODES}
    with scratch_database(admin_url) as url:
        setup = Ledger(url)
        setup.create_schema()
        for name in MODES:
            setup.create_budget(f"rt-{name}", 10**15)
        setup.dispose()
        modes: list[_Mode] = []
        try:
            for name, functions in MODES.items():
                ledger = Ledger(url, server_functions=functions, **POOL)
                tracer = Tracer(ledger.engine)  # before the ledger first connects
                modes.append(_Mode(name, ledger, tracer, _main_call(f"rt-{name}"), owner_id()))
                _warm(modes[-1], warmup)
            for n in range(rounds):
                for mode in modes:
                    counted = _counted(mode, runs)
                    _vacuumed(url)
                    done = Round(counted, _timed(mode, runs))
                    figures[mode.name].rounds.append(done)
                    if report is not None:
                        report(mode.name, n + 1, done)
        finally:
            for mode in modes:
                mode.tracer.stop()
                mode.ledger.dispose()
        audit = [str(finding) for finding in setup.audit()]
        setup.dispose()
    return RoundTripsResult(runs, rounds, figures, audit)


def describe_counts(counts: Counter[int]) -> str:
    """``16 x 1998, 19 x 2``: how many runs took each number of round trips."""
    return ", ".join(f"{trips} x {runs}" for trips, runs in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=2_000, help="first runs (and replays)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    args = parser.parse_args(argv)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL at {ADMIN_URL.rsplit('@', 1)[-1]}"
    )

    def show(mode: str, n: int, done: Round) -> None:
        t = done.timed
        print(
            f"round {n}, {mode:10s}: {done.first_trips:5.2f} round trips per first run, "
            f"{done.replay_trips:4.2f} per replay; CPU per first run {t.client_ms:.2f} ms "
            f"client + {t.backend_ms:.2f} ms PostgreSQL, {t.wall_ms:.2f} ms wall",
            flush=True,
        )

    result = run(runs=args.runs, rounds=args.rounds, warmup=args.warmup, report=show)
    print(f"\n{result.runs} first runs and {result.runs} replays per mode and round")
    for name, m in result.modes.items():
        print(f"{name}:")
        print(
            f"  round trips per first run {m.first_trips:.2f} "
            f"(runs: {describe_counts(m.counts('first run'))}; admission "
            f"{m.usual('admission')}, settlement {m.usual('settlement')})"
        )
        print(
            f"  round trips per replay    {m.replay_trips:.2f} "
            f"(runs: {describe_counts(m.counts('replay'))})"
        )
        if m.pipelined:
            print("  some round trips carried several requests (more ReadyForQuery than trips)")
        print(
            f"  CPU per first run: client {m.client_ms:.2f} ms + PostgreSQL "
            f"{m.backend_ms:.2f} ms = {m.cpu_ms:.2f} ms ({m.wall_ms:.2f} ms wall); "
            f"per replay {m.replay_cpu_ms:.2f} ms"
        )
    print("functions / statements:")
    for what, of in (
        ("round trips per first run", lambda m: m.first_trips),
        ("round trips per replay", lambda m: m.replay_trips),
        ("client CPU per first run", lambda m: m.client_ms),
        ("PostgreSQL CPU per first run", lambda m: m.backend_ms),
        ("CPU per first run", lambda m: m.cpu_ms),
    ):
        print(f"  {what:29s} {result.ratio(of):.2f}")
    missed = False
    for what, value, met in result.targets():
        missed = missed or not met
        print(f"target: {what}: {value}: {'met' if met else 'NOT met'}")
    print(f"audit after the run: {'; '.join(result.audit) or 'clean'}")
    return 1 if result.audit or missed else 0


if __name__ == "__main__":
    sys.exit(main())
