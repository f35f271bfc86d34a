"""Every benchmark in one run, each figure beside its baseline measured in the same run;
prints a table and rewrites benchmarks/RESULTS.md.

    make bench                       # = .venv/bin/python -m benchmarks
    .venv/bin/python -m benchmarks [--quick] [--output PATH] [--json PATH] [--redis-db N]
                                   [--only N [N ...]]

1. Ledger reserve + mark sending + settle cycles/s against the same cycle in raw SQL,
   8 and 32 processes on one hot budget (ledger_bench.py).
2. BudgetTask against a plain Celery task making the same provider call: throughput and
   median enqueue-to-result latency through a real ``celery worker`` (task_overhead.py),
   once with the fake provider answering at once (the bookkeeping alone) and once with
   every call taking PROVIDER_DELAY seconds (what a user sees with a real call).
3. Replay: a message whose business key already completed (the ledger returns the
   stored result, no provider call) against a fresh plain task and against the first run.
4. Worker memory: VmRSS of the pool children after 10,000 BudgetTask tasks against after
   1,000 (a ratio near 1 means no leak).
5. One metrics scrape at 10,000 budgets and 100,000 open holds against the same gauges
   read by one hand-written query (scrape_bench.py).
6-7. Commits per task, and hot budgets (commit_count.py, hot_budgets.py).
8. The ledger over months: every per-call operation, the scrape, holds, each beat job
   and the incremental audit on 2 million finished calls against an empty ledger, then
   a retention run (ledger_growth.py).
9. Round trips and CPU (client and PostgreSQL) per first run and per replay, the
   statement path against one server-side call per transaction (round_trips.py).
10. Rate limits held across the fleet: a burst of 2,000 tasks on 8 worker processes
    against the fake provider's 600 requests a minute, the same limits held in the
    ledger against none (rate_fleet.py).

Needs PostgreSQL (scratch databases, user postgres on 127.0.0.1:5432, or env
BUDGET_TASKS_TEST_PG_URL) and Redis on 127.0.0.1:6379 (database 10, flushed). The machine
is shared and noisy: compare the ratios, not the absolute figures, between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402

from benchmarks import (  # noqa: E402
    commit_count,
    hot_budgets,
    ledger_bench,
    ledger_growth,
    rate_fleet,
    rate_world,
    round_trips,
    scrape_bench,
    task_overhead,
)
from benchmarks.task_overhead import Services, latency, run_all_of, services  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
#: Seconds the fake provider takes per call in the second half of section 2: about a
#: short real completion (the same in --quick, where only the sizes shrink).
PROVIDER_DELAY = 0.25


@dataclass(frozen=True)
class Sizes:
    ledger_procs: tuple[int, ...]
    ledger_seconds: float
    ledger_rounds: int
    ledger_warmup: float
    tasks: int  # per throughput round
    rounds: int
    latency_samples: int
    delay_tasks: int  # per throughput round, each call taking PROVIDER_DELAY
    delay_rounds: int
    delay_latency_samples: int
    replay_samples: int
    replay_tasks: int
    memory_checkpoints: tuple[int, int]
    memory_batch: int
    concurrency: int
    scrape_budgets: int
    scrape_holds: int
    commit_tasks: int
    hot_procs: tuple[int, ...]
    hot_seconds: float
    hot_rounds: int
    growth_calls: int
    growth_budgets: int
    growth_samples: int
    trips_runs: int
    trips_rounds: int
    rate: rate_fleet.Shape
    world: rate_world.WorldShape
    fleet: rate_world.FleetShape
    share: rate_world.ShareShape


FULL = Sizes(
    ledger_procs=(8, 32),
    ledger_seconds=5.0,
    ledger_rounds=2,
    ledger_warmup=2.0,
    tasks=300,
    rounds=2,
    latency_samples=60,
    delay_tasks=24,
    delay_rounds=3,
    delay_latency_samples=20,
    replay_samples=60,
    replay_tasks=300,
    memory_checkpoints=(1_000, 10_000),
    memory_batch=500,
    concurrency=2,
    scrape_budgets=10_000,
    scrape_holds=100_000,
    commit_tasks=100,
    hot_procs=(8, 32),
    hot_seconds=4.0,
    hot_rounds=2,
    growth_calls=2_000_000,
    growth_budgets=1_000,
    growth_samples=50,
    trips_runs=2_000,
    trips_rounds=2,
    rate=rate_fleet.FULL,
    world=rate_world.WORLD_FULL,
    fleet=rate_world.FLEET_FULL,
    share=rate_world.SHARE_FULL,
)
QUICK = Sizes(
    ledger_procs=(2,),
    ledger_seconds=0.5,
    ledger_rounds=1,
    ledger_warmup=0.5,
    tasks=10,
    rounds=1,
    latency_samples=3,
    delay_tasks=4,
    delay_rounds=1,
    delay_latency_samples=2,
    replay_samples=3,
    replay_tasks=10,
    memory_checkpoints=(20, 100),
    memory_batch=50,
    concurrency=2,
    scrape_budgets=200,
    scrape_holds=2_000,
    commit_tasks=5,
    hot_procs=(2,),
    hot_seconds=0.5,
    hot_rounds=1,
    growth_calls=5_000,
    growth_budgets=50,
    growth_samples=3,
    trips_runs=50,
    trips_rounds=1,
    rate=rate_fleet.QUICK,
    world=rate_world.WORLD_QUICK,
    fleet=rate_world.FLEET_QUICK,
    share=rate_world.SHARE_QUICK,
)


@dataclass
class Figure:
    """One measured figure beside its baseline; ``ratio`` is measured / baseline."""

    section: int
    what: str
    unit: str
    baseline_name: str
    baseline: float
    name: str
    value: float
    reading: str

    @property
    def ratio(self) -> float:
        return self.value / self.baseline


@dataclass
class Report:
    sizes: Sizes
    quick: bool
    command: str
    machine: dict[str, str]
    started: datetime
    figures: list[Figure] = field(default_factory=list)
    notes: dict[int, list[str]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    total_seconds: float = 0.0
    #: the sections run (all unless --only)
    only: tuple[int, ...] = ()

    def note(self, section: int, text: str) -> None:
        self.notes.setdefault(section, []).append(text)


# -- the machine -----------------------------------------------------------------------


def _proc_field(path: str, name: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        return None
    return None


def machine(admin_url: str) -> dict[str, str]:
    ram_kb = _proc_field("/proc/meminfo", "MemTotal")
    ram = f"{int(ram_kb.split()[0]) / 2**20:.1f} GiB" if ram_kb else "unknown"
    with psycopg.connect(admin_url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        pg = str(row[0]) if row else "unknown"
    info = redis.Redis(task_overhead.REDIS_HOST, task_overhead.REDIS_PORT).info("server")
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "unknown"
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": str(os.cpu_count()),
        "ram": ram,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "celery": celery.__version__,
        "postgresql": pg,
        "redis": str(info.get("redis_version", "unknown")),
        "load average at start (1, 5, 15 min)": load,
        "git commit": _git_commit(),
    }


def _git_commit() -> str:
    head = ROOT / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            target = ROOT / ".git" / ref[5:]
            if target.exists():
                return target.read_text().strip()[:12]
            for line in (ROOT / ".git" / "packed-refs").read_text().splitlines():
                if line.endswith(ref[5:]):
                    return line.split()[0][:12]
            return "unknown"
        return ref[:12]
    except OSError:
        return "unknown"


def command_line() -> str:
    """The command as typed, with paths inside the project made relative to it."""
    words = []
    for word in sys.orig_argv:
        path = Path(word)
        if path.is_absolute() and path.is_relative_to(ROOT):
            word = str(path.relative_to(ROOT))
        words.append(word)
    if words[1:3] == ["-m", "benchmarks.run_all"]:
        words[2] = "benchmarks"
    return shlex.join(words)


# -- the four sections -------------------------------------------------------------------


def ledger_section(report: Report, admin_url: str) -> None:
    s = report.sizes
    result = ledger_bench.run(
        admin_url,
        procs=list(s.ledger_procs),
        seconds=s.ledger_seconds,
        rounds=s.ledger_rounds,
        warmup=s.ledger_warmup,
        report=lambda row: print(
            f"  ledger, {row.procs} processes: raw {row.raw:.0f}/s, Ledger {row.ledger:.0f}/s",
            flush=True,
        ),
    )
    for row in result.rows:
        report.figures.append(
            Figure(
                1,
                f"reserve+settle cycles, {row.procs} processes, one hot budget",
                "cycles/s",
                "raw SQL",
                row.raw,
                "Ledger",
                row.ledger,
                f"higher is better; target >= {ledger_bench.TARGET}",
            )
        )
        raw = ", ".join(f"{v:.0f}" for v in row.raw_rounds)
        lib = ", ".join(f"{v:.0f}" for v in row.ledger_rounds)
        report.note(1, f"{row.procs} processes, each round (cycles/s): raw {raw}; Ledger {lib}")
        report.note(
            1,
            f"{row.procs} processes, client CPU per cycle (median of the rounds): raw "
            f"{row.raw_cpu_ms:.2f} ms, Ledger {row.ledger_cpu_ms:.2f} ms; all processes' "
            f"client CPU at those rates: raw {row.raw * row.raw_cpu_ms / 1000:.2f} cores, "
            f"Ledger {row.ledger * row.ledger_cpu_ms / 1000:.2f} cores",
        )
        report.note(
            1,
            f"{row.procs} processes, MultiXacts per cycle (vacuumed before each round): "
            f"raw {row.raw_multixacts:.2f}, Ledger {row.ledger_multixacts:.2f}",
        )
        report.note(
            1,
            f"{row.procs} processes, what the backends were doing (pg_stat_activity every "
            f"20 ms, last round): raw: {ledger_bench.describe_waits(row.raw_waits)}; "
            f"Ledger: {ledger_bench.describe_waits(row.ledger_waits)}",
        )
    report.note(1, f"ledger audit after the run: {'; '.join(result.audit) or 'clean'}")
    report.problems += [f"ledger bench audit: {finding}" for finding in result.audit]


def _overhead_figures(
    report: Report, result: task_overhead.OverheadResult, call: str, tp_reading: str
) -> None:
    report.figures += [
        Figure(
            2,
            f"task throughput, same provider call {call}",
            "tasks/s",
            "plain task",
            result.plain,
            "BudgetTask",
            result.budgeted,
            tp_reading,
        ),
        Figure(
            2,
            f"median latency, enqueue to result, call {call}",
            "ms",
            "plain task",
            result.plain_ms,
            "BudgetTask",
            result.budgeted_ms,
            "lower is better",
        ),
    ]
    plain = ", ".join(f"{v:.1f}" for v in result.plain_tp)
    budgeted = ", ".join(f"{v:.1f}" for v in result.budget_tp)
    report.note(2, f"call {call}, each round (tasks/s): plain {plain}; BudgetTask {budgeted}")
    report.note(
        2,
        f"call {call}: BudgetTask adds {result.budgeted_ms - result.plain_ms:+.1f} ms median "
        f"latency ({len(result.plain_lat)} samples each, alternating)",
    )


def overhead_section(report: Report, stack: Services) -> None:
    s = report.sizes
    result = task_overhead.run_overhead(
        stack.app, tasks=s.tasks, rounds=s.rounds, latency_samples=s.latency_samples
    )
    _overhead_figures(
        report, result, "answered at once", f"higher is better; target >= {task_overhead.TARGET}"
    )

    # The same comparison with every call held PROVIDER_DELAY at the fake (the request's
    # own x-fake-fault header, so each call of either kind waits exactly that long). The
    # worker is warm from the rounds above.
    t0 = time.perf_counter()
    delayed = task_overhead.run_overhead(
        stack.app,
        tasks=s.delay_tasks,
        rounds=s.delay_rounds,
        latency_samples=s.delay_latency_samples,
        delay=PROVIDER_DELAY,
        warm=False,
    )
    took = time.perf_counter() - t0
    call = f"taking {PROVIDER_DELAY * 1e3:.0f} ms"
    _overhead_figures(report, delayed, call, "higher is better; what a user sees")
    fault = f"delay={PROVIDER_DELAY:g}"
    # the guarded client sends each attempt's provider key: given back as attempt keys
    held = [r for r in stack.fake.served_as(stack.ledger) if r.fault == fault]
    plain_held = sum(1 for r in held if (r.idempotency_key or "").startswith("plain:"))
    budget_held = sum(1 for r in held if (r.idempotency_key or "").startswith("budgeted:"))
    expected = s.delay_rounds * s.delay_tasks + s.delay_latency_samples
    report.note(
        2,
        f"calls the fake held {PROVIDER_DELAY * 1e3:.0f} ms: plain {plain_held}, "
        f"BudgetTask {budget_held} (expected {expected} each); that part took {took:.0f} s",
    )
    if plain_held != expected or budget_held != expected or len(held) != 2 * expected:
        report.problems.append(
            f"delayed calls: plain {plain_held}, BudgetTask {budget_held} of {len(held)} "
            f"held, expected {expected} each"
        )


def replay_section(report: Report, stack: Services) -> None:
    s = report.sizes
    app = stack.app
    tag = uuid.uuid4().hex[:8]
    plain_lat, first_lat, replay_lat = [], [], []
    mismatches = 0
    for n in range(s.replay_samples):
        plain_lat.append(latency(app, "bench.plain", f"{tag}-lat-{n}")[0])
        took, first = latency(app, "bench.budgeted", f"{tag}-lat-{n}")
        first_lat.append(took)
        took, again = latency(app, "bench.budgeted", f"{tag}-lat-{n}")  # the same key
        replay_lat.append(took)
        mismatches += again != first
    keys = [f"{tag}-tp-{n}" for n in range(s.replay_tasks)]
    first_s, firsts = run_all_of(app, "bench.budgeted", keys)
    plain_s, _ = run_all_of(app, "bench.plain", [f"{tag}-tp-{n}" for n in range(s.replay_tasks)])
    replay_s, replays = run_all_of(app, "bench.budgeted", keys)
    mismatches += sum(a != b for a, b in zip(firsts, replays, strict=True))
    prefix = f"budgeted:{tag}-"
    served = stack.fake.served_as(stack.ledger)
    sends = sum(1 for r in served if (r.idempotency_key or "").startswith(prefix))
    resent = sends - (s.replay_samples + s.replay_tasks)
    ms = 1e3
    report.figures += [
        Figure(
            3,
            "median latency of a replayed delivery",
            "ms",
            "plain task, fresh",
            statistics.median(plain_lat) * ms,
            "BudgetTask replay",
            statistics.median(replay_lat) * ms,
            "lower is better",
        ),
        Figure(
            3,
            "median latency of a replayed delivery",
            "ms",
            "BudgetTask, first run",
            statistics.median(first_lat) * ms,
            "BudgetTask replay",
            statistics.median(replay_lat) * ms,
            "lower is better",
        ),
        Figure(
            3,
            "replay throughput",
            "tasks/s",
            "plain task, fresh",
            s.replay_tasks / plain_s,
            "BudgetTask replay",
            s.replay_tasks / replay_s,
            "higher is better",
        ),
    ]
    first_tp = s.replay_tasks / first_s
    report.note(3, f"first runs of the {s.replay_tasks} throughput keys: {first_tp:.1f} tasks/s")
    report.note(
        3,
        f"provider calls made by the {s.replay_samples + s.replay_tasks} replays: {resent}; "
        f"replayed results differing from the first run's: {mismatches}",
    )
    if resent or mismatches:
        report.problems.append(f"replays resent {resent} calls, {mismatches} results differ")


def rss_kib(pid: int, name: str = "VmRSS") -> int:
    """A memory field of a process (VmRSS, RssAnon), in KiB, from /proc/<pid>/status."""
    value = _proc_field(f"/proc/{pid}/status", name)
    if value is None:
        raise RuntimeError(f"no {name} for process {pid}")
    return int(value.split()[0])


def memory_section(report: Report, stack: Services) -> None:
    s = report.sizes
    worker = stack.start_worker("bench-mem", s.concurrency)
    children = sorted(worker.children())
    at_start = {pid: rss_kib(pid) for pid in children}
    tag = uuid.uuid4().hex[:8]
    done = 0
    readings: dict[int, dict[int, int]] = {}
    anon: dict[int, dict[int, int]] = {}
    started = time.perf_counter()
    for checkpoint in s.memory_checkpoints:
        while done < checkpoint:
            batch = [f"{tag}-{n}" for n in range(done, min(done + s.memory_batch, checkpoint))]
            run_all_of(stack.app, "bench.cheap", batch)
            done += len(batch)
        pids = sorted(worker.children())
        readings[checkpoint] = {pid: rss_kib(pid) for pid in pids}
        anon[checkpoint] = {pid: rss_kib(pid, "RssAnon") for pid in pids}
        print(f"  memory: {done} tasks, pool children VmRSS {readings[checkpoint]} KiB", flush=True)
    took = time.perf_counter() - started
    first, last = s.memory_checkpoints
    before, after = sum(readings[first].values()), sum(readings[last].values())
    report.figures.append(
        Figure(
            4,
            f"worker pool RSS (VmRSS, {len(children)} children summed), BudgetTask",
            "MiB",
            f"after {first:,} tasks",
            before / 1024,
            f"after {last:,} tasks",
            after / 1024,
            "about 1: no leak",
        )
    )

    def kib(values: dict[int, int]) -> str:
        return ", ".join(str(v) for v in values.values())

    report.note(
        4,
        f"VmRSS per pool child (KiB): at start {kib(at_start)}; after {first:,}: "
        f"{kib(readings[first])}; after {last:,}: {kib(readings[last])}",
    )
    report.note(
        4,
        f"RssAnon per pool child (KiB): after {first:,}: {kib(anon[first])}; "
        f"after {last:,}: {kib(anon[last])}",
    )
    per_task = (after - before) * 1024 / (last - first)
    report.note(4, f"VmRSS growth between the two readings: {per_task:+.1f} bytes per task")
    report.note(4, f"{last:,} tasks in {took:.0f} s ({last / took:.0f} tasks/s)")
    if set(readings[first]) != set(children) or set(readings[last]) != set(children):
        report.problems.append("a pool child was replaced during the memory run")
        report.note(4, "a pool child was replaced during the run: the ratio is not valid")
    worker.stop()
    stack.workers.remove(worker)


def scrape_section(report: Report, admin_url: str) -> None:
    s = report.sizes
    result = scrape_bench.run(admin_url, budgets=s.scrape_budgets, holds=s.scrape_holds)
    print(
        f"  scrape: {result.scrape * 1000:.0f} ms, raw SQL gauges {result.raw * 1000:.0f} ms",
        flush=True,
    )
    report.figures.append(
        Figure(
            5,
            f"one metrics scrape, {s.scrape_budgets:,} budgets and {s.scrape_holds:,} open holds",
            "ms",
            "raw SQL gauges",
            result.raw * 1000,
            "budget_tasks.metrics",
            result.scrape * 1000,
            f"lower is better; target: the scrape under {scrape_bench.TARGET_SECONDS:g} s",
        )
    )
    runs = ", ".join(f"{v * 1000:.0f}" for v in result.scrape_runs)
    raw = ", ".join(f"{v * 1000:.0f}" for v in result.raw_runs)
    report.note(5, f"each run (ms): scrape {runs}; raw SQL gauges {raw}")
    report.note(5, f"{result.lines:,} lines of Prometheus text per scrape")
    if result.scrape >= scrape_bench.TARGET_SECONDS:
        report.note(5, f"the scrape took {result.scrape:.2f} s: target NOT met")


def commits_section(report: Report) -> None:
    counts = commit_count.run(report.sizes.commit_tasks)
    for kind, value in counts.commits.items():
        target = commit_count.TARGETS[kind]
        statements = counts.statements[kind]
        print(
            f"  {kind}: {value:.2f} commits, {statements:.1f} statements per task "
            f"(target {target} commits)",
            flush=True,
        )
        report.figures.append(
            Figure(
                6,
                f"ledger commits per task, {kind}",
                "commits",
                "issue 15's target",
                float(target),
                "bench.summarize (eager)",
                value,
                "lower is better; ratio 1 meets the target",
            )
        )
        report.note(
            6,
            f"{kind}: {value:.2f} commits, {counts.rollbacks[kind]:.2f} rollbacks and "
            f"{statements:.1f} statements per task; PostgreSQL's own CPU "
            f"{counts.server_cpu_ms[kind]:.2f} ms per task",
        )
    report.note(
        6,
        f"{counts.tasks} tasks of each kind; the ledger's two new connections per kind "
        "(its pool, after the flush) cost about 2 commits more, spread over them",
    )


HOT_READINGS = {
    "under a parent": "higher is better; what escrow removes",
    "escrow": f"higher is better; target >= {hot_budgets.TARGET}",
    "escrow, grants of the need": "higher is better; the cost near a parent's cap",
    "one budget": "higher is better; what slices remove",
    "one budget in 8 slices": f"higher is better; target >= {hot_budgets.TARGET}",
}


def hot_section(report: Report) -> None:
    s = report.sizes

    def show(n: int, shape: str, rate: float, multixacts: float, cpu: float) -> None:
        print(f"  {n} processes, {shape}: {rate:.0f}/s", flush=True)

    result = hot_budgets.run(list(s.hot_procs), s.hot_seconds, s.hot_rounds, show)
    for row in result.rows:
        for shape, reading in HOT_READINGS.items():
            report.figures.append(
                Figure(
                    7,
                    f"reserve+settle cycles, {row.procs} processes, {shape}",
                    "cycles/s",
                    "each alone",
                    row.rate("alone"),
                    shape,
                    row.rate(shape),
                    reading,
                )
            )
        rounds = "; ".join(
            f"{shape} {', '.join(f'{v:.0f}' for v in values)}"
            for shape, values in row.rounds.items()
        )
        report.note(7, f"{row.procs} processes, each round (cycles/s): {rounds}")
        report.note(
            7,
            f"{row.procs} processes, MultiXacts per cycle and client CPU per cycle (last "
            "round): "
            + "; ".join(
                f"{shape} {row.multixacts[shape]:.2f}, {row.cpu_ms[shape]:.2f} ms"
                for shape in row.rounds
            ),
        )
    report.note(7, f"ledger audit after the run: {'; '.join(result.audit) or 'clean'}")
    report.problems += [f"hot budgets audit: {finding}" for finding in result.audit]


def growth_section(report: Report) -> None:
    s = report.sizes

    def show(line: str) -> None:
        print(line, flush=True)

    result = ledger_growth.run(s.growth_calls, s.growth_budgets, s.growth_samples, show)
    for name, (empty, large) in result.timings.items():
        report.figures.append(
            Figure(
                8,
                name,
                "ms",
                "empty ledger",
                empty,
                f"{s.growth_calls:,} calls",
                large,
                f"lower is better; target <= {ledger_growth.TARGET}",
            )
        )
    rows = "; ".join(
        f"{side}: {j:,} journal, {a:,} attempts, {o:,} operations"
        for side, (j, a, o) in result.rows.items()
    )
    report.note(8, f"rows: {rows}; both built in {result.build_seconds:.0f} s")
    j, a, o = result.rows_after
    report.note(
        8,
        f"retention run (window {ledger_growth.KEEP.days} days, batches of "
        f"{ledger_growth.RETAIN_BATCH:,}): archived {', '.join(result.archived) or 'nothing'} "
        f"in {result.retain_seconds:.0f} s; left {j:,} journal, {a:,} attempts, "
        f"{o:,} operations",
    )
    report.note(
        8,
        "table sizes before -> after the retention run and VACUUM (MiB): "
        + "; ".join(
            f"{t} {b / 2**20:,.0f} -> {result.sizes_after[t] / 2**20:,.0f}"
            for t, b in result.sizes_before.items()
        )
        + " (the journal's months leave as partitions; attempts and operations leave by "
        "DELETE, so their files keep the freed pages for new rows, not for the disk)",
    )
    report.note(8, f"ledger audits after the run: {'; '.join(result.audit) or 'clean'}")
    report.problems += [f"growth audit: {finding}" for finding in result.audit]


def trips_section(report: Report) -> None:
    s = report.sizes

    def show(mode: str, n: int, done: round_trips.Round) -> None:
        print(f"  round {n}, {mode}: {done.first_trips:.2f} round trips per first run", flush=True)

    result = round_trips.run(runs=s.trips_runs, rounds=s.trips_rounds, report=show)
    statements, functions = result.modes["statements"], result.modes["functions"]
    trips: dict[str, Callable[[round_trips.ModeFigures], float]] = {
        "first run": lambda m: m.first_trips,
        "replay": lambda m: m.replay_trips,
    }
    for kind, of in trips.items():
        target = round_trips.TARGETS[kind]
        report.figures.append(
            Figure(
                9,
                f"ledger round trips per {kind}",
                "round trips",
                "statements",
                of(statements),
                "server functions",
                of(functions),
                f"lower is better; target {'<=' if kind == 'first run' else '=='} {target}",
            )
        )
    report.figures.append(
        Figure(
            9,
            "ledger CPU per first run, client + PostgreSQL",
            "ms",
            "statements",
            statements.cpu_ms,
            "server functions",
            functions.cpu_ms,
            f"lower is better; target <= {round_trips.CPU_TARGET}",
        )
    )
    for m in result.modes.values():
        report.note(
            9,
            f"{m.mode}: round trips per first run, runs: "
            f"{round_trips.describe_counts(m.counts('first run'))} (admission "
            f"{m.usual('admission')}, settlement {m.usual('settlement')}); per replay: "
            f"{round_trips.describe_counts(m.counts('replay'))}; CPU per first run "
            f"{m.client_ms:.2f} ms client + {m.backend_ms:.2f} ms PostgreSQL, "
            f"{m.wall_ms:.2f} ms wall; CPU per replay {m.replay_cpu_ms:.2f} ms",
        )
    for what, value, met in result.targets():
        report.note(9, f"target {what}: {value}, {'met' if met else 'NOT met'}")
    report.note(9, f"ledger audit after the run: {'; '.join(result.audit) or 'clean'}")
    report.problems += [f"round trips audit: {finding}" for finding in result.audit]


def rate_section(report: Report, admin_url: str, redis_db: int) -> None:
    shape = report.sizes.rate
    held, free, audit = rate_fleet.run(shape, admin_url, redis_db)
    # the provider's bucket starts full and refills at the limit a minute: what passes
    # the first limit's worth, per second from the first request, is at most that rate
    for burst, name, reading in (
        (held, "held in the ledger", f"higher is better; target >= {rate_fleet.TARGET}"),
        (free, "not held", "higher is better"),
    ):
        report.figures.append(
            Figure(
                10,
                f"burst of {shape.tasks:,} tasks: requests answered a second past the "
                f"first {shape.requests}",
                "requests/s",
                f"the limit ({shape.requests}/min)",
                shape.requests / 60,
                name,
                (shape.tasks - shape.requests) / burst.span,
                reading,
            )
        )
    report.figures += [
        Figure(
            10,
            f"burst of {shape.tasks:,} tasks: requests sent per task (200s and 429s)",
            "requests",
            "one call per task",
            1.0,
            name,
            (burst.answered + burst.refused) / shape.tasks,
            "lower is better; 1: no 429",
        )
        for burst, name in ((held, "held in the ledger"), (free, "not held"))
    ]
    report.figures.append(
        Figure(
            10,
            f"burst of {shape.tasks:,} tasks: first task sent to last result back",
            "s",
            "held in the ledger",
            held.seconds,
            "not held",
            free.seconds,
            "lower is better",
        )
    )
    met = held.refused == 0 and held.failed == 0 and held.ratio >= rate_fleet.TARGET
    report.note(
        10,
        f"held in the ledger: {held.refused:,} 429s (target 0), {held.failed:,} tasks failed "
        f"(target 0); {held.span:.1f} s from the first request to the last answered, "
        f"ideal {shape.ideal:.0f} s: {held.ratio:.2f} of the limit (target >= "
        f"{rate_fleet.TARGET}); targets {'met' if met else 'NOT met'}; {held.seconds:.1f} s "
        f"from the first task sent to the last result; at most {held.most_booked} calls "
        f"seen waiting in the request window's line at once; {held.came_back:,} runs ended "
        "to come back at their turn (a turn past the task's patience in the process)",
    )
    report.note(
        10,
        f"not held: {free.refused:,} 429s, {free.released:,} attempts released and sent again "
        f"by budget-tasks ({free.retried:,} of {shape.tasks:,} tasks retried, "
        f"{free.released / max(1, free.retried):.1f} times each on average; "
        f"{free.came_back:,} runs ended by a retry), {free.failed:,} "
        f"tasks failed; {free.span:.1f} s from the first request to the last answered "
        f"({free.ratio:.2f} of the limit), {free.seconds:.1f} s from the first task sent "
        "to the last result",
    )
    report.note(
        10,
        f"tokens a call: the ledger took {held.tokens_asked:.0f} on admission (its upper "
        f"estimate of the prompt plus the output bound), the provider counted "
        f"{held.tokens_counted:.0f} (the prompt exactly plus the bound); "
        f"{shape.requests} calls a minute take {shape.requests * held.tokens_asked:,.0f} "
        f"of the {shape.tokens:,} tokens a minute: the "
        f"{'request' if shape.requests * held.tokens_asked < shape.tokens else 'token'} "
        "window binds",
    )
    report.note(10, f"ledger audit after the run: {'; '.join(audit) or 'clean'}")
    report.problems += [
        f"rate limits {what}: {burst.failed} of {shape.tasks} tasks failed"
        for burst, what in ((held, "held"), (free, "not held"))
        if burst.failed
    ]
    report.problems += [f"rate fleet audit: {finding}" for finding in audit]


# -- output ------------------------------------------------------------------------------


def _num(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def table(figures: list[Figure]) -> str:
    head = ("#", "figure", "unit", "baseline", "value", "measured", "value", "ratio")
    rows = [
        (
            str(f.section),
            f.what,
            f.unit,
            f.baseline_name,
            _num(f.baseline),
            f.name,
            _num(f.value),
            f"{f.ratio:.2f}",
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    right = {4, 6, 7}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])


def world_section(report: Report, admin_url: str, redis_db: int) -> None:
    found = rate_world.world(report.sizes.world, admin_url, redis_db)
    rate_world.say_world(found, lambda line: report.note(11, line.strip()))
    for phase, ratio in found.ratios.items():
        report.figures.append(
            Figure(
                11,
                f"calls sent {phase}, over what the provider allowed then",
                "share",
                "the provider's limit",
                1.0,
                "held in the ledger",
                ratio,
                f"higher is better; target >= {rate_world.THROUGHPUT_TARGET}",
            )
        )
    report.figures.append(
        Figure(
            11,
            "ledger admissions per task (a call that waits its turn is admitted twice: "
            "into the line, then to send)",
            "admissions",
            "one a task",
            1.0,
            "held in the ledger",
            found.admissions_per_task,
            f"lower is better; target <= {rate_world.ADMISSIONS_TARGET}",
        )
    )
    report.note(
        11,
        f"429s: {found.refused_after_lower} after the lowered limit, "
        f"{found.refused_after_spend} after the shared quota's burst (target: at most one "
        f"each); {found.overtaken} calls sent more than a second ahead of a call that came "
        f"before them (target 0); {found.failed} tasks failed (target 0)",
    )
    if found.failed:
        report.problems.append(f"the world changes: {found.failed} tasks failed")


def fleet_section(report: Report, admin_url: str, redis_db: int) -> None:
    found = rate_world.fleet(report.sizes.fleet, admin_url, redis_db)
    rate_world.say_fleet(found, lambda line: report.note(12, line.strip()))
    by = {(b.processes, b.mode): b for b in found}
    for processes in report.sizes.fleet.processes:
        ledger = by[(processes, "ledger")]
        if not report.sizes.fleet.baselines:
            report.figures.append(
                Figure(
                    12,
                    f"{processes} processes: the token limit used (616 tokens asked a call, "
                    "307 counted)",
                    "share",
                    "the provider's limit",
                    1.0,
                    "the ledger's windows",
                    ledger.ratio,
                    f"higher is better; target >= {rate_world.THROUGHPUT_TARGET}, no 429",
                )
            )
        for mode in ("celery rate_limit", "limits library") if report.sizes.fleet.baselines else ():
            other = by[(processes, mode)]
            report.figures.append(
                Figure(
                    12,
                    f"{processes} processes: the token limit used (616 tokens asked a call, "
                    "307 counted)",
                    "share",
                    mode,
                    other.ratio,
                    "the ledger's windows",
                    ledger.ratio,
                    f"higher is better; target >= {rate_world.THROUGHPUT_TARGET}, no 429",
                )
            )
    report.problems += [
        f"a fleet twice as large: {b.failed} tasks failed ({b.processes} processes, {b.mode})"
        for b in found
        if b.failed and b.mode == "ledger"
    ]


def share_section(report: Report, admin_url: str, redis_db: int) -> None:
    found = rate_world.shares(report.sizes.share, admin_url, redis_db)
    rate_world.say_shares(found, lambda line: report.note(13, line.strip()))
    for share in found:
        a, b = share.weights
        report.figures.append(
            Figure(
                13,
                f"weights {a}:{b}, tenant a sending 10x: its share of the sends while both wait",
                "share",
                "its weight's part",
                share.expected,
                "measured",
                share.share_a,
                f"1 is exact; target within {rate_world.SHARE_TOLERANCE} of its weight's part",
            )
        )
        if share.failed_b:
            report.problems.append(f"fair share {a}:{b}: {share.failed_b} of b's tasks failed")


SECTIONS = {
    1: (
        "Ledger: admit (reserve and grant) + settle, one hot budget",
        "Each process runs the cycle a BudgetTask runs per billable call, in two "
        "transactions (admit: attempt row inserted granted, hold journal entry, then the "
        "conditional UPDATE of the period row, COMMIT; settle: lock the attempt, charge "
        "journal entry, resolve, apply the actual to the period row, COMMIT) on one "
        "budget, through `Ledger` and as the same statements in the same order written by "
        "hand with psycopg (the ledger's own statement path, on one connection the process "
        "keeps). The two alternate in rounds (the median is shown); every process measures "
        "the same window after a warm-up, and its own CPU time; a sampler reads what the "
        "backends are doing. Reading it: on PostgreSQL `Ledger` sends each transaction as "
        "one call of a server-side function (section 9), so it makes two round trips per "
        "cycle where the hand-written statements make eleven, and the hot row's lock is "
        "held for the function's last steps and its commit, not across round trips: a "
        "ratio above 1 is what the functions save beyond the library's own client work. "
        "Its CPU per cycle is printed beside the raw client's. On two cores shared by every "
        "client and its backend, each client millisecond also delays the others, "
        "including the holder of the hot row's lock.",
    ),
    2: (
        "BudgetTask vs a plain Celery task, the same provider call",
        "One real `celery worker` (prefork, acks_late, prefetch 1), Redis broker and result "
        "backend, PostgreSQL ledger, the fake provider over HTTP through the official "
        "openai SDK, which sets TCP_NODELAY as a real provider's front end does (before "
        "it did, each answer waited ~40 ms for a delayed ACK, which hid most of the "
        "overhead in earlier figures). The comparison is made twice. *Call answered at "
        "once*: the fake answers with no delay, so these rows measure the bookkeeping "
        "alone, against the cheapest possible call; no real workload sees that ratio. "
        f"*Call taking {PROVIDER_DELAY * 1e3:.0f} ms*: every request of both kinds carries "
        f"`x-fake-fault: delay={PROVIDER_DELAY:g}`, so the fake holds each answer exactly "
        f"{PROVIDER_DELAY * 1e3:.0f} ms, about a short real completion; these rows are "
        "what a user sees with a real call, where the same added milliseconds are a small "
        "part of each task. Throughput: a batch sent at once, until every result is back; "
        "plain and BudgetTask rounds alternate. Latency: one task at a time, enqueue to "
        "result, alternating. `bench.budgeted` makes six short ledger transactions per "
        "task: operation lease, reserve, mark sending, the provider's request id and "
        "response id as they arrive (for reconciliation), settle + store the result.",
    ),
    3: (
        "Replay of a delivery whose business key already completed",
        "The same worker. Each sample sends a plain task, a BudgetTask (first run), then "
        "the BudgetTask again with the same arguments: its business key completed, so the "
        "ledger returns the stored result with no reservation and no provider call. This "
        "is what a redelivered message costs (the key comes from the arguments, not the "
        "task id). Throughput: a batch of keys run once, a batch of plain tasks, then "
        "the same keys again.",
    ),
    4: (
        "Worker memory over many BudgetTask tasks",
        "A fresh worker runs `bench.cheap`, a BudgetTask that reserves a tiny estimate, "
        "records a usage and settles without a provider call (the full ledger flow), sent "
        "in batches; VmRSS of its pool children is read from /proc/<pid>/status at each "
        "checkpoint (RssAnon, the private heap part, is in the notes). The children must "
        "be the same processes at both readings.",
    ),
    5: (
        "One metrics scrape at 10,000 budgets and 100,000 open holds",
        "A scratch database filled in bulk (budgets of every period kind, each with its "
        "current period, holds spread over them, their journal entries). The scrape is "
        "`generate_latest` of the registry `budget_tasks.metrics` serves: the ledger "
        "collector reads every budget's current period and oldest hold in one query. The "
        "baseline is the same five gauges per budget read by one hand-written query with "
        "psycopg; most of either is the Prometheus text format itself.",
    ),
    6: (
        "Ledger commits per task: a first run, a replay, a denial",
        "Commits counted by PostgreSQL: `pg_stat_database.xact_commit` of a scratch "
        "database that nothing else uses, read after the ledger's connections have exited "
        "(a backend writes its statistics as it exits); statements counted by the driver "
        "(a psycopg cursor class counting `execute` calls), and PostgreSQL's own CPU from "
        "its backends' /proc entries (the database on this host). A first run is one admission "
        "(replay check, operation and lease, attempt granted and described, its hold, the "
        "conditional UPDATE of the period) and one settlement (charge, ids, result, lease "
        "given back). A denial rolls its admission back and records the refusal in one "
        "statement. The tasks run in eager mode (the same "
        "operation manager a worker runs), each one call through the official openai "
        "SDK to the fake provider; a denial is a budget of 1. The baseline is the target "
        "issue 15 sets (2 commits for a first run, 1 for a replay or a denial).",
    ),
    7: (
        "Hot budgets: tenants under one parent, one budget shared by every process",
        "The cycle of section 1 (reserve granted + settle through `Ledger`), each process "
        "on its own budget alone (the baseline), as a tenant under one parent (every "
        "admission and settlement also writes the parent's period row), as an escrowed "
        "tenant under one parent (it draws grants from the parent and admits on its own "
        "row), as an escrowed tenant whose every grant is exactly what the admission "
        "needs (as near a parent's cap, where every admission draws), every process on "
        "one budget, and on one budget split into 8 slices. One scratch database, "
        "vacuumed before each round (autovacuum is off here); the shapes alternate in "
        "rounds and the median is shown.",
    ),
    8: (
        "The ledger over months: 90 days of history beside none",
        "Two scratch databases with the same 1,000 daily budgets and 3,000 calls in "
        "flight; one also holds 2 million finished calls over the 90 days before (an "
        "operation, a settled attempt, its hold and charge journal rows each, in the "
        "journal's month partitions), built in bulk by SQL, audited clean and vacuumed. "
        "Each operation runs once to warm up, then in three rounds alternating between "
        "the two ledgers; the median of the rounds' medians is shown. Then a retention "
        "run on the large one, and the sizes before and after.",
    ),
    9: (
        "Ledger round trips and CPU per delivery: statements against one call",
        "A first run is what a BudgetTask does per task whose call is answered at once: "
        "the delivery's admission (its main call reserved, granted and described in the "
        "same commit) and `finish_operation` (the call settled, the result stored, the "
        "lease given back); a replay is the same delivery once it finished. Each mode is "
        "a `Ledger` with one pooled connection: `server_functions=False` (statement by "
        "statement) and `server_functions=True` (one server-side call per transaction), "
        "on budgets of their own in one scratch database, alternating in rounds after a "
        "warm-up; the medians of the rounds are shown. Round trips are counted by libpq's "
        "protocol trace of that connection (each request answered by one ReadyForQuery), "
        "run by run; CPU in a second pass with the trace off: this process's and the "
        "PostgreSQL backend's (/proc/<pid>/stat), per run. Where the Ledger does not take "
        "`server_functions`, the statement path is shown against the targets.",
    ),
    10: (
        "Rate limits held across the fleet: a burst against the provider's limit",
        "One real `celery worker` (prefork, 8 processes), Redis broker, a scratch "
        "PostgreSQL ledger, the fake provider holding gpt-4o-mini to a limit of requests "
        "and tokens a minute as OpenAI does (token buckets refilled continuously, 429 "
        "with the vendor's headers and retry-after past them). The tasks (`bench.rated`) "
        "are sent at once; each makes one chat call through the guarded OpenAI client "
        "(a short prompt, an output bound of 48: every call takes from both limits, and "
        "the request limit binds) and allows no retry of its own. *Held in the ledger*: "
        "the same limits set in the ledger, whose windows the calls take from with "
        "their money; a full window puts the call in its line and the task waits (in "
        "the process while its turn is within 30 s, else its message comes back then). "
        "*Not held*: the ledger's limits cleared, the provider's the same (its buckets "
        "set afresh), the same number of new tasks: each 429 is released and the task retried by "
        "budget-tasks after the retry-after. Throughput is read from the fake's own "
        "record of when it received each request (`Served.at`): its bucket lets "
        "`limit + limit/60 * t` requests through by `t` seconds after the first, so the "
        "requests past the first limit's worth, over the time from the first request to "
        "the last one answered 200, are at most the limit's rate a second (the ratio: "
        "ideal time over actual). Before the first burst every process runs a few tasks "
        "with no limit set (not counted).",
    ),
    11: (
        "Rate limits when the world changes: a lowered limit and a shared quota mid-burst",
        "One real `celery worker` (prefork, 8 processes) and the `bench.rated` tasks of "
        "section 10, against the fake holding gpt-4o-mini to 120 requests a minute, the "
        "same limit set in the ledger. Mid-burst the provider lowers its limit to half "
        "(its buckets keep what they hold; the ledger is not told and learns it from the "
        "answers' headers), then other software sharing the quota spends a quarter "
        "minute of it at once (the next call meets a 429 with its retry-after). Each "
        "phase's calls are counted from the fake's record (`Served.at`) over what the "
        "provider let through in it (its bucket full at the start, refilled at the limit "
        "of the moment, less what the other software spent). Admissions are counted by "
        "PostgreSQL (`pg_stat_user_functions`, calls of `budget_tasks_admit`).",
    ),
    12: (
        "Rate limits on a fleet twice as large: 4, 8 and 16 processes",
        "A burst of `bench.rated_wide` tasks (a 400-byte prompt and an output bound of "
        "200: the ledger asks 616 tokens of the window, the provider counts 307) against "
        "300 requests and 30,000 tokens a minute (the token limit binds), on one worker "
        "of 4, 8, then 16 processes. *The ledger's windows*: the same limits set in the "
        "ledger. *Celery rate_limit*: none in the ledger; the task's `rate_limit` at the "
        "calls a minute the token limit allows at the provider's count (97/m). *limits "
        "library*: none in the ledger; before its call each task hits a moving window of "
        "requests and one of tokens (the call's strict bound, 616) on Redis with the "
        "`limits` library, sleeping until there is room. A refused call (429) is released "
        "and its task retried after the retry-after by budget-tasks in every run. The "
        "share of the token limit used is the provider's bucket's ideal time for the "
        "tokens it counted over the time from the first request to the last answered.",
    ),
    13: (
        "A fair share between tenants",
        "Two tenants (budgets) share gpt-4o-mini's window of 120 requests a minute, each "
        "with a worker of 4 processes on a queue of its own; tenant a sends ten times "
        "tenant b's tasks, all at once. The window's first minute is spent before the "
        "burst, so every call waits in line. At weights 1:1 and 3:1 (`ledger.rates."
        "set_weight`), tenant a's part of the calls sent until tenant b's last one.",
    ),
}


def markdown(report: Report) -> str:
    m = report.machine
    out = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/run_all.py`; do not edit by hand. Every figure is beside",
        "its baseline measured in the same run (ratio = measured / baseline): the machine",
        "is shared, so compare ratios between runs, not absolute figures.",
        "",
        f"- Command: `{report.command}`" + (" (via `make bench`)" if _via_make() else ""),
        f"- Date: {report.started:%Y-%m-%d %H:%M} UTC; the run took "
        f"{report.total_seconds / 60:.1f} min"
        + (" (**--quick smoke run: tiny sizes, not figures**)" if report.quick else ""),
        f"- CPU: {m['cpu']}, {m['cores']} cores; RAM {m['ram']}; {m['os']}",
        f"- Python {m['python']}, Celery {m['celery']}, PostgreSQL {m['postgresql']}, "
        f"Redis {m['redis']} (both on 127.0.0.1)",
        f"- Load average at start: {m['load average at start (1, 5, 15 min)']}; "
        f"HEAD at run time {m['git commit']}",
        "",
        "Re-run with `make bench` (about 50 minutes; `.venv/bin/python -m benchmarks --quick`",
        "is a smoke run). It needs PostgreSQL on 127.0.0.1:5432 (scratch databases) and",
        "Redis on 127.0.0.1:6379 (database 10, flushed).",
        "",
        "## Summary",
        "",
        "| # | figure | baseline | value | measured | value | ratio | reading |",
        "|---|---|---|--:|---|--:|--:|---|",
    ]
    for f in report.figures:
        out.append(
            f"| {f.section} | {f.what} ({f.unit}) | {f.baseline_name} | {_num(f.baseline)} "
            f"| {f.name} | {_num(f.value)} | {f.ratio:.2f} | {f.reading} |"
        )
    if report.problems:
        out += ["", "**Problems found in this run:**", ""]
        out += [f"- {p}" for p in report.problems]
    for section, (title, text) in SECTIONS.items():
        if report.only and section not in report.only:
            continue
        out += ["", f"## {section}. {title}", ""]
        out += _wrap(text)
        took = report.seconds.get(section)
        if section in report.notes or took is not None:
            out.append("")
        out += [f"- {n}" for n in report.notes.get(section, [])]
        if took is not None:
            out.append(f"- section time: {took:.0f} s")
    s = report.sizes
    out += [
        "",
        "## Sizes",
        "",
        f"ledger: {', '.join(map(str, s.ledger_procs))} processes, {s.ledger_seconds:g} s "
        f"x {s.ledger_rounds} rounds after {s.ledger_warmup:g} s warm-up; tasks: "
        f"{s.tasks} per throughput round x {s.rounds}, {s.latency_samples} latency "
        f"samples; with a {PROVIDER_DELAY * 1e3:.0f} ms call: {s.delay_tasks} per "
        f"throughput round x {s.delay_rounds}, {s.delay_latency_samples} latency samples; "
        f"replay: {s.replay_samples} samples, {s.replay_tasks} throughput "
        f"tasks; memory: checkpoints {s.memory_checkpoints[0]} and "
        f"{s.memory_checkpoints[1]}, batches of {s.memory_batch}; worker concurrency "
        f"{s.concurrency}; scrape: {s.scrape_budgets:,} budgets, {s.scrape_holds:,} holds; "
        f"commits: {s.commit_tasks} tasks of each kind; hot budgets: "
        f"{', '.join(map(str, s.hot_procs))} processes, {s.hot_seconds:g} s x "
        f"{s.hot_rounds} rounds; round trips: {s.trips_runs:,} first runs and replays "
        f"per mode x {s.trips_rounds} rounds; rate limits: {s.rate.tasks:,} tasks "
        f"against {s.rate.requests:,} requests and {s.rate.tokens:,} tokens a minute, "
        f"{s.rate.concurrency} worker processes, twice.",
        "",
    ]
    return "\n".join(out)


def _wrap(text: str, width: int = 88) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


def _via_make() -> bool:
    return "MAKELEVEL" in os.environ


def as_json(report: Report) -> dict[str, Any]:
    return {
        "command": report.command,
        "quick": report.quick,
        "date": report.started.isoformat(),
        "total_seconds": report.total_seconds,
        "machine": report.machine,
        "sizes": asdict(report.sizes),
        "figures": [{**asdict(f), "ratio": f.ratio} for f in report.figures],
        "notes": {str(k): v for k, v in report.notes.items()},
        "section_seconds": {str(k): v for k, v in report.seconds.items()},
        "problems": report.problems,
    }


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the markdown report")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--redis-db", type=int, default=task_overhead.REDIS_DB)
    parser.add_argument(
        "--only",
        type=int,
        nargs="+",
        choices=sorted(SECTIONS),
        metavar="N",
        help="run these sections alone (the report names only them)",
    )
    args = parser.parse_args(argv)
    if args.only and args.output == RESULTS:
        # RESULTS.md holds every section: one run alone must not replace it
        parser.error("--only needs --output PATH")

    admin_url = ledger_bench.ADMIN_URL
    report = Report(
        sizes=QUICK if args.quick else FULL,
        quick=args.quick,
        command=command_line(),
        machine=machine(admin_url),
        started=datetime.now(UTC),
        only=tuple(args.only or ()),
    )
    begun = time.perf_counter()

    def timed(section: int, fn: Callable[[], None]) -> None:
        if report.only and section not in report.only:
            return
        print(f"[{section}] {SECTIONS[section][0]}", flush=True)
        t0 = time.perf_counter()
        fn()
        report.seconds[section] = time.perf_counter() - t0

    timed(1, lambda: ledger_section(report, admin_url))
    if not report.only or {2, 3, 4} & set(report.only):
        with services(admin_url, args.redis_db) as stack:
            stack.start_worker("bench", report.sizes.concurrency)
            timed(2, lambda: overhead_section(report, stack))
            timed(3, lambda: replay_section(report, stack))
            stack.stop_workers()
            timed(4, lambda: memory_section(report, stack))
            audit = stack.ledger.audit()
        report.note(4, f"ledger audit after sections 2-4: {audit or 'clean'}")
        report.problems += [f"task ledger audit: {finding}" for finding in audit]
    timed(5, lambda: scrape_section(report, admin_url))
    timed(6, lambda: commits_section(report))
    timed(7, lambda: hot_section(report))
    timed(8, lambda: growth_section(report))
    timed(9, lambda: trips_section(report))
    timed(10, lambda: rate_section(report, admin_url, args.redis_db))
    timed(11, lambda: world_section(report, admin_url, args.redis_db))
    timed(12, lambda: fleet_section(report, admin_url, args.redis_db))
    timed(13, lambda: share_section(report, admin_url, args.redis_db))
    report.total_seconds = time.perf_counter() - begun

    print()
    print(table(report.figures))
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print(f"\n{len(report.figures)} figures in {report.total_seconds:.0f} s", end="")
    args.output.write_text(markdown(report))
    print(f"; wrote {args.output}", end="")
    if args.json:
        args.json.write_text(json.dumps(as_json(report), indent=2))
        print(f" and {args.json}", end="")
    print()
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
