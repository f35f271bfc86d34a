"""Rate limits when the world changes (issue 54): three bursts of BudgetTasks on real
``celery worker`` processes, each making one chat call through the guarded OpenAI client
to the fake provider, which holds gpt-4o-mini to its own limits and answers 429 past
them.

- **The world changes** (section 11): eight processes against 120 requests a minute;
  mid-burst the provider lowers its limit to half (the ledger is not told: it learns
  from the answers), then other software sharing the quota spends half a minute of it
  at once. 429s seen, calls sent out of their order of arrival, throughput in each
  phase as a share of what the provider allowed then, and admissions per task.
- **A fleet twice as large** (section 12): a burst at 4, 8 and 16 processes whose
  prompts' strict bound is twice what the provider counts (616 tokens asked, 307
  counted), the token window binding; the ledger's windows beside Celery's own
  ``rate_limit`` and the ``limits`` library on Redis, in the same run.
- **A fair share between tenants** (section 13): two tenants on one window, each with a
  worker of its own, one sending ten times the other's tasks; at weights 1:1 and 3:1,
  each tenant's share of the sends while both wait.

    .venv/bin/python benchmarks/rate_world.py [--quick] [--only 11 12 13]

Throughput is read from the fake's own record of each request (``Served.at``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_tasks import WIDE_OUTPUT_BOUND  # noqa: E402
from benchmarks.task_overhead import Services, services  # noqa: E402
from budget_tasks.ledger.records import RateAsk  # noqa: E402
from budget_tasks.testing.fake_provider import Served  # noqa: E402

PROVIDER, MODEL = "openai", "gpt-4o-mini"
#: Issue 54's targets.
THROUGHPUT_TARGET = 0.95
ADMISSIONS_TARGET = 1.1
SHARE_TOLERANCE = 0.05


# -- shared ------------------------------------------------------------------------------


def admissions(stack: Services) -> tuple[int, int]:
    """How many admissions the workers have asked of the ledger (a run's, a call's;
    granted, refused or put in a rate window's line), and how many calls had to wait
    their turn, as ``bench_tasks`` counts them in the broker's Redis (a refused
    admission rolls back: no row is left to count)."""
    counter = redis.Redis.from_url(stack.env["BENCH_COUNT_ADMISSIONS"])
    return int(counter.get("bench:admissions") or 0), int(counter.scard("bench:waited"))


def per_task(before: tuple[int, int], after: tuple[int, int], tasks: int) -> tuple[float, float]:
    """Admissions per task, and those past the floor (one a task, one more for each
    call that waited its turn: put in line, then sent), per task."""
    asked, waited = after[0] - before[0], after[1] - before[1]
    return asked / tasks, (asked - tasks - waited) / tasks


def count_admissions(stack: Services, redis_db: int) -> None:
    """Have the workers started after this count their admissions (:func:`admissions`)."""
    stack.env["BENCH_COUNT_ADMISSIONS"] = f"redis://127.0.0.1:6379/{redis_db}"


def results(sent: Sequence[AsyncResult], deadline: float) -> int:
    """Wait for every result; how many failed (or never came)."""
    failed = 0
    for result in sent:
        try:
            outcome = result.get(timeout=max(0.1, deadline - time.monotonic()))
        except (ResultTimeout, Exception):
            outcome = None
        failed += not (isinstance(outcome, int) and outcome > 0)
    return failed


def warm(stack: Services, task: str, processes: int, **options: object) -> None:
    """A few tasks on every process before any limit is set (not counted)."""
    tag = f"warm-{uuid.uuid4().hex[:6]}"
    sent = [stack.app.send_task(task, args=[f"{tag}-{n}"], **options) for n in range(processes * 2)]
    for result in sent:
        result.get(timeout=120)


def clear_ledger_limits(stack: Services) -> None:
    for scope in {w.scope for w in stack.ledger.rates.windows() if w.provider == PROVIDER}:
        stack.ledger.rates.clear_limit(PROVIDER, scope)


# -- 11: the world changes ---------------------------------------------------------------


@dataclass(frozen=True)
class WorldShape:
    """A burst against ``requests`` a minute, lowered to half at ``lower_at`` seconds
    after its first request; at ``spend_at``, other software spends ``spent`` requests
    of the quota at once."""

    tasks: int
    requests: int
    lower_at: float
    spend_at: float
    spent: int
    processes: int = 8


WORLD_FULL = WorldShape(tasks=220, requests=120, lower_at=20, spend_at=45, spent=30)
WORLD_QUICK = WorldShape(tasks=66, requests=60, lower_at=3, spend_at=6, spent=4)


@dataclass
class World:
    shape: WorldShape
    failed: int
    refused_after_lower: int
    refused_after_spend: int
    #: sends in each phase over what the provider allowed in it
    ratios: dict[str, float]
    #: calls that waited and were sent more than a second after one that joined the
    #: line after them
    overtaken: int
    admissions_per_task: float
    #: admissions per task past one a task and one more for each call that waited
    readmissions_per_task: float
    seconds: float


def world(shape: WorldShape, admin_url: str, redis_db: int) -> World:
    with services(admin_url, redis_db) as stack:
        count_admissions(stack, redis_db)
        stack.start_worker("bench-world", shape.processes)
        warm(stack, "bench.rated", shape.processes)
        fake, ledger = stack.fake, stack.ledger
        fake.set_limits(PROVIDER, MODEL, requests=shape.requests, tokens=10**7)
        ledger.rates.set_limit(PROVIDER, MODEL, "requests", shape.requests)
        mark = len(fake.served())
        before = admissions(stack)
        tag = uuid.uuid4().hex[:6]
        began = time.monotonic()
        sent = [stack.app.send_task("bench.rated", args=[f"{tag}-{n}"]) for n in range(shape.tasks)]
        first_post = _first_post_at(stack, mark)
        changes: list[float] = []

        def change_the_world() -> None:
            time.sleep(max(0.0, first_post + shape.lower_at - time.time()))
            fake.limits.change(PROVIDER, MODEL, requests=shape.requests // 2)
            changes.append(time.time())
            time.sleep(max(0.0, first_post + shape.spend_at - time.time()))
            fake.limits.spend(PROVIDER, MODEL, requests=shape.spent)
            changes.append(time.time())

        changer = threading.Thread(target=change_the_world, daemon=True)
        changer.start()
        failed = results(sent, time.monotonic() + 600)
        changer.join()
        seconds = time.monotonic() - began
        counts = per_task(before, admissions(stack), shape.tasks)
        posts = [s for s in fake.served_as(ledger)[mark:] if s.method == "POST"]
        overtaken = _overtaken(stack, posts)
    lowered, spent = changes
    ok = sorted(s.at for s in posts if s.status == 200)
    refused = [s.at for s in posts if s.status == 429]
    half = shape.requests / 2 / 60
    end = ok[-1]
    allowed = {
        "before the change": shape.requests + shape.requests / 60 * (lowered - first_post),
        "after the lowered limit": half * (spent - lowered),
        "after the shared quota's burst": max(1.0, half * (end - spent) - shape.spent),
    }
    sends = {
        "before the change": sum(at < lowered for at in ok),
        "after the lowered limit": sum(lowered <= at < spent for at in ok),
        "after the shared quota's burst": sum(at >= spent for at in ok),
    }
    return World(
        shape,
        failed,
        sum(lowered <= at < spent for at in refused),
        sum(at >= spent for at in refused),
        {phase: sends[phase] / allowed[phase] for phase in allowed},
        overtaken,
        *counts,
        seconds,
    )


def _first_post_at(stack: Services, mark: int) -> float:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        posts = [s for s in stack.fake.served()[mark:] if s.method == "POST"]
        if posts:
            return min(s.at for s in posts)
        time.sleep(0.01)
    raise RuntimeError("no request reached the provider")


def _overtaken(stack: Services, posts: Sequence[Served]) -> int:
    """Calls that waited their turn and were sent more than a second after a call that
    joined the line after them (a waiting call reads its turn every quarter second)."""
    counter = redis.Redis.from_url(stack.env["BENCH_COUNT_ADMISSIONS"])
    joined = {k.decode(): float(v) for k, v in counter.hgetall("bench:joined").items()}
    sent = {s.idempotency_key: s.at for s in posts if s.status == 200 and s.idempotency_key}
    order = sorted((at, sent[key]) for key, at in joined.items() if key in sent)
    overtaken, soonest_after = 0, float("inf")
    for _, sent_at in reversed(order):  # latest to join first
        if sent_at > soonest_after + 1.0:
            overtaken += 1
        soonest_after = min(soonest_after, sent_at)
    return overtaken


# -- 12: a fleet twice as large ----------------------------------------------------------


@dataclass(frozen=True)
class FleetShape:
    """A burst of ``tasks`` against ``requests`` and ``tokens`` a minute, at each of
    ``processes``; each call asks 616 tokens and is counted 307."""

    tasks: int
    requests: int
    tokens: int
    processes: tuple[int, ...]
    #: Celery's rate_limit and the limits library beside the ledger's windows
    baselines: bool = True

    def ideal(self, counted: float) -> float:
        """Seconds the provider's token bucket (full at the start) needs to let
        ``counted`` tokens through."""
        return max(0.0, counted - self.tokens) * 60 / self.tokens


FLEET_FULL = FleetShape(tasks=200, requests=300, tokens=30_000, processes=(4, 8, 16))
#: A smoke run: the ledger's windows only (Celery's rate_limit, which lets no burst
#: through, would take a minute for any burst the token bucket does not hold whole).
FLEET_QUICK = FleetShape(tasks=32, requests=300, tokens=9_000, processes=(4,), baselines=False)
#: The calls a minute the token limit allows at what the provider counts a call (the
#: best a careful user can set Celery's ``rate_limit`` to, knowing that count).
COUNTED_PER_CALL = 307
MODES = {
    "ledger": "bench.rated_wide",
    "celery rate_limit": "bench.rated_celery",
    "limits library": "bench.rated_limits",
}


@dataclass
class FleetBurst:
    mode: str
    processes: int
    failed: int
    refused: int
    answered: int
    counted: float  # tokens the provider counted (input as it tokenizes it, output bound)
    span: float  # first request to last answered 200
    ideal: float
    admissions_per_task: float
    readmissions_per_task: float

    @property
    def ratio(self) -> float:
        return self.ideal / self.span if self.span else 0.0


def fleet(shape: FleetShape, admin_url: str, redis_db: int) -> list[FleetBurst]:
    found = []
    for processes in shape.processes:
        with services(admin_url, redis_db) as stack:
            count_admissions(stack, redis_db)
            calls_a_minute = shape.tokens // COUNTED_PER_CALL
            stack.env.update(
                BENCH_CELERY_RATE_LIMIT=f"{calls_a_minute}/m",
                BENCH_LIMITS_STORAGE=f"redis://127.0.0.1:6379/{redis_db}",
                BENCH_LIMITS_REQUESTS=str(shape.requests),
                BENCH_LIMITS_TOKENS=str(shape.tokens),
            )
            stack.start_worker(f"bench-fleet-{processes}", processes)
            for mode, task in MODES.items():
                if mode != "ledger" and not shape.baselines:
                    continue
                warm(stack, task, processes)
                found.append(_fleet_burst(stack, shape, processes, mode, task))
    return found


def _fleet_burst(
    stack: Services, shape: FleetShape, processes: int, mode: str, task: str
) -> FleetBurst:
    fake, ledger = stack.fake, stack.ledger
    clear_ledger_limits(stack)
    fake.set_limits(PROVIDER, MODEL, requests=shape.requests, tokens=shape.tokens)
    if mode == "ledger":
        ledger.rates.set_limit(PROVIDER, MODEL, "requests", shape.requests)
        ledger.rates.set_limit(PROVIDER, MODEL, "tokens", shape.tokens)
    mark = len(fake.served())
    before = admissions(stack)
    tag = uuid.uuid4().hex[:6]
    sent = [stack.app.send_task(task, args=[f"{tag}-{n}"]) for n in range(shape.tasks)]
    failed = results(sent, time.monotonic() + 600)
    counts = per_task(before, admissions(stack), shape.tasks)
    posts = [s for s in fake.served()[mark:] if s.method == "POST"]
    ok = [s for s in posts if s.status == 200]
    tokens = sum(_input_tokens(s) + WIDE_OUTPUT_BOUND for s in ok)
    span = max(s.at for s in ok) - min(s.at for s in posts)
    return FleetBurst(
        mode,
        processes,
        failed,
        sum(s.status == 429 for s in posts),
        len(ok),
        tokens,
        span,
        shape.ideal(tokens),
        *counts,
    )


def _input_tokens(served: Served) -> int:
    return sum(int(b.usage.get("input_tokens", 0)) for b in served.bills)


# -- 13: a fair share between tenants ----------------------------------------------------


@dataclass(frozen=True)
class ShareShape:
    """Tenant b sends ``tasks``, tenant a ten times as many, each on a worker of
    ``processes`` of its own, against ``requests`` a minute."""

    tasks: int
    requests: int
    processes: int = 4
    weights: tuple[tuple[int, int], ...] = ((1, 1), (3, 1))


SHARE_FULL = ShareShape(tasks=40, requests=120)
SHARE_QUICK = ShareShape(tasks=4, requests=60, processes=2, weights=((1, 1),))


@dataclass
class Share:
    weights: tuple[int, int]
    #: tenant a's part of the sends while both had calls waiting
    share_a: float
    sends: int
    failed_b: int

    @property
    def expected(self) -> float:
        return self.weights[0] / sum(self.weights)


def shares(shape: ShareShape, admin_url: str, redis_db: int) -> list[Share]:
    return [_share(shape, weights, admin_url, redis_db) for weights in shape.weights]


def _share(shape: ShareShape, weights: tuple[int, int], admin_url: str, redis_db: int) -> Share:
    with services(admin_url, redis_db) as stack:
        fake, ledger = stack.fake, stack.ledger
        for tenant, weight in zip(("tenant-a", "tenant-b"), weights, strict=True):
            ledger.create_budget(tenant, 10**14)
            ledger.rates.set_weight(tenant, weight)
        stack.start_worker("bench-a", shape.processes, queues=("tenant-a",))
        stack.start_worker("bench-b", shape.processes, queues=("tenant-b",))
        for tenant in ("tenant-a", "tenant-b"):
            warm(stack, "bench.rated_wide", shape.processes, queue=tenant)
        fake.set_limits(PROVIDER, MODEL, requests=shape.requests, tokens=10**7)
        ledger.rates.set_limit(PROVIDER, MODEL, "requests", shape.requests)
        # the window's first minute goes to whoever comes first: spent before the burst
        fake.limits.spend(PROVIDER, MODEL, requests=shape.requests)
        taken = [ledger.rates.take(PROVIDER, MODEL, RateAsk(1, 0)) for _ in range(shape.requests)]
        assert all(t.granted for t in taken)
        mark = len(fake.served())
        tag = uuid.uuid4().hex[:6]

        def send(tenant: str, n: int) -> AsyncResult:
            return stack.app.send_task(
                "bench.rated_wide", args=[f"{tag}-{tenant}-{n}", tenant], queue=tenant
            )

        a = [send("tenant-a", n) for n in range(shape.tasks * 10)]
        b = [send("tenant-b", n) for n in range(shape.tasks)]
        failed_b = results(b, time.monotonic() + 600)
        posts = [s for s in fake.served_as(ledger)[mark:] if s.method == "POST" and s.status == 200]
        for result in a:
            result.revoke()  # tenant a's backlog is not measured
    last_b = max(s.at for s in posts if "tenant-b" in (s.idempotency_key or ""))
    during = [s for s in posts if s.at <= last_b]
    from_a = sum("tenant-a" in (s.idempotency_key or "") for s in during)
    del a
    return Share(weights, from_a / max(1, len(during)), len(during), failed_b)


# -- the command -------------------------------------------------------------------------


@dataclass
class Findings:
    world: World | None = None
    fleet: list[FleetBurst] = field(default_factory=list)
    shares: list[Share] = field(default_factory=list)


def say_world(found: World, say: Callable[[str], None] = print) -> None:
    ratios = ", ".join(f"{phase} {ratio:.2f}" for phase, ratio in found.ratios.items())
    say(
        f"  the world changes: {found.shape.tasks} tasks, {found.failed} failed; 429s after the "
        f"lowered limit {found.refused_after_lower}, after the shared quota's burst "
        f"{found.refused_after_spend}; throughput as a share of what the provider allowed: "
        f"{ratios}; {found.overtaken} calls sent out of their order of arrival; "
        f"{found.admissions_per_task:.2f} admissions per task "
        f"({found.readmissions_per_task:.2f} past one a task and one for each call that "
        f"waited); {found.seconds:.0f} s"
    )


def say_fleet(found: list[FleetBurst], say: Callable[[str], None] = print) -> None:
    for burst in found:
        say(
            f"  {burst.processes:>2} processes, {burst.mode}: {burst.ratio:.2f} of the token "
            f"limit ({burst.span:.1f} s for an ideal {burst.ideal:.1f} s), {burst.refused} "
            f"429s, {burst.failed} failed, {burst.admissions_per_task:.2f} admissions per task "
            f"({burst.readmissions_per_task:.2f} past the floor)"
        )


def say_shares(found: list[Share], say: Callable[[str], None] = print) -> None:
    for share in found:
        say(
            f"  weights {share.weights[0]}:{share.weights[1]}: tenant a sent "
            f"{share.share_a:.2f} of the {share.sends} calls while both waited (its weight's "
            f"part {share.expected:.2f}); tenant b's tasks failed: {share.failed_b}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.task_overhead import ADMIN_URL, REDIS_DB

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--only", type=int, nargs="+", choices=(11, 12, 13))
    parser.add_argument("--redis-db", type=int, default=REDIS_DB)
    args = parser.parse_args(argv)
    only = set(args.only or (11, 12, 13))
    if 11 in only:
        say_world(world(WORLD_QUICK if args.quick else WORLD_FULL, ADMIN_URL, args.redis_db))
    if 12 in only:
        say_fleet(fleet(FLEET_QUICK if args.quick else FLEET_FULL, ADMIN_URL, args.redis_db))
    if 13 in only:
        say_shares(shares(SHARE_QUICK if args.quick else SHARE_FULL, ADMIN_URL, args.redis_db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
