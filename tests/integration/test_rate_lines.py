"""A rate window's line when the world changes under it, on every path (SQLite,
PostgreSQL's statements, PostgreSQL's function): a booked call's turn is read from the
window each time it asks, so a 429, a lowered or raised limit, what a provider says
remains and tokens given back move every waiting call; every call gets a place,
however long the line; tenants who keep asking share a window by their weights."""

from __future__ import annotations

import contextlib

import pytest

from budget_tasks import Ledger
from budget_tasks.errors import RateWindowFull
from budget_tasks.ledger import CallFacts
from budget_tasks.ledger.records import Answered, RateAsk, RateClaim, RateSeen

from .test_rate_admission import MINI, level, now_ms, rated, send

__all__ = ["rated"]  # the fixture, shared with the admission's tests

#: A call whose strict bound of tokens is about twice what the provider counts.
BOUNDED = RateClaim(
    "openai", ("gpt-4o-mini", "*"), RateAsk(requests=1, tokens=616), own=("gpt-4o-mini",)
)


def advance(ledger: Ledger, seconds: float) -> None:
    ledger.clock.advance(seconds=seconds)  # type: ignore[attr-defined]


def booked(ledger: Ledger, key: str, claim: RateClaim = MINI, budget: str = "team") -> int:
    """Book ``key`` in its windows' line: its turn, in ms."""
    with pytest.raises(RateWindowFull) as full:
        ledger.calls.reserve(budget, key, 1, grant=CallFacts(model="gpt-4o-mini", rate=claim))
    assert full.value.key == key
    return full.value.wait_ms


def turn_ms(ledger: Ledger, key: str) -> int:
    turn = ledger.calls.rate_turn(key)
    assert turn is not None, key
    return round(turn * 1000)


def sent_now(ledger: Ledger, keys: list[str], budget: str = "team") -> list[str]:
    """Each of ``keys`` that sends when it comes back now, in that order."""
    sent = []
    for key in keys:
        with contextlib.suppress(RateWindowFull):
            ledger.calls.reserve(budget, key, 1, grant=CallFacts(model="gpt-4o-mini", rate=MINI))
            sent.append(key)
    return sent


def fill(ledger: Ledger, per_minute: int) -> None:
    ledger.rates.set_limit("openai", "gpt-4o-mini", "requests", per_minute)
    for n in range(per_minute):
        send(ledger, f"sent{n}", amount=1)
    assert level(ledger, "requests") == 0


def test_a_429_moves_every_booked_call_past_its_retry_after(rated: Ledger) -> None:
    fill(rated, 60)
    assert [booked(rated, f"b{n}") for n in range(1, 6)] == [1_000, 2_000, 3_000, 4_000, 5_000]
    # a quota other software shares: the provider answers one sent call 429, 30 s
    refused = RateSeen(now_ms(rated), wait_ms=30_000)
    rated.calls.release("sent0", "HTTP 429", seen=refused)
    # none of the five is sent inside the retry-after: each keeps its place after it
    assert [turn_ms(rated, f"b{n}") for n in range(1, 6)] == [
        31_000,
        32_000,
        33_000,
        34_000,
        35_000,
    ]
    assert booked(rated, "newcomer") == 36_000
    advance(rated, 30.999)
    assert sent_now(rated, [f"b{n}" for n in range(1, 6)]) == []
    advance(rated, 0.001)
    assert sent_now(rated, [f"b{n}" for n in range(1, 6)]) == ["b1"]


def test_a_lowered_limit_sends_the_booked_calls_at_the_new_rate(rated: Ledger) -> None:
    fill(rated, 60)
    keys = [f"b{n}" for n in range(1, 31)]
    assert [booked(rated, key) for key in keys] == [n * 1_000 for n in range(1, 31)]
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 6)
    # told 1 to 30 s, now 10 s apart: the new rate
    assert [turn_ms(rated, key) for key in keys] == [n * 10_000 for n in range(1, 31)]
    sent = []
    for _ in range(12):  # every call comes back every five seconds of the next minute
        advance(rated, 5)
        sent += sent_now(rated, [k for k in keys if k not in sent])
    assert sent == keys[:6]  # six in the minute, in their order


def test_a_raised_limit_brings_the_booked_calls_forward_ahead_of_any_newcomer(
    rated: Ledger,
) -> None:
    fill(rated, 6)
    keys = ["b1", "b2", "b3"]
    assert [booked(rated, key) for key in keys] == [10_000, 20_000, 30_000]
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 600)
    # at the new rate, in their order; a newcomer now waits behind them
    assert [turn_ms(rated, key) for key in keys] == [100, 200, 300]
    assert booked(rated, "newcomer") == 400
    advance(rated, 0.3)
    # a second newcomer finds no room the booked calls wait for: it waits too
    assert booked(rated, "second") == 200
    assert sent_now(rated, ["newcomer", "second", *keys]) == keys
    advance(rated, 0.2)
    assert sent_now(rated, ["second", "newcomer"]) == ["second", "newcomer"]
    # once the line is served, a newcomer with room is sent at once
    advance(rated, 1)
    send(rated, "third")


def test_tokens_given_back_bring_every_booked_call_forward(rated: Ledger) -> None:
    rated.rates.set_limit("openai", "*", "tokens", 30_000)
    sent = []
    while True:
        try:
            send(rated, f"s{len(sent)}", claim=BOUNDED, amount=1)
        except RateWindowFull:
            break
        sent.append(f"s{len(sent)}")
    line = [f"s{len(sent)}", *(f"w{n}" for n in range(4))]
    for key in line[1:]:
        booked(rated, key, BOUNDED)
    before = [turn_ms(rated, key) for key in line]
    assert before[0] < 618 < before[1]
    # the provider counted 307 of the 616 tokens each sent call took: 309 come back
    for n, key in enumerate(sent[:3]):
        rated.calls.settle(key, 1, answered=Answered(counted=RateAsk(1, 307)))
        after = [turn_ms(rated, k) for k in line]
        # 309 tokens at 30,000 a minute: each waiting call 618 ms sooner (a refill
        # is rounded up to the next millisecond), or its turn has come
        want = [max(0, b - 618 * (n + 1)) for b in before]
        assert all(abs(a - w) <= 1 for a, w in zip(after, want, strict=True)), (after, want)
    assert after[0] == after[1] == 0 < after[2]


def test_a_call_is_told_the_true_wait_and_gets_a_place_however_long_the_line(
    rated: Ledger,
) -> None:
    """A line owing more than an hour still takes a call (it used to be refused and
    told to come back in a millisecond), and a large call keeps its place ahead of
    the small ones that come after it."""
    rated.rates.set_limit("openai", "*", "tokens", 1_000)
    whole = RateClaim("openai", ("gpt-4o-mini", "*"), RateAsk(1, 1_000))
    small = RateClaim("openai", ("gpt-4o-mini", "*"), RateAsk(1, 10))
    send(rated, "first", claim=whole)
    waits = [booked(rated, f"b{n}", whole) for n in range(61)]
    assert waits == [(n + 1) * 60_000 for n in range(61)]  # the last: 61 minutes
    assert booked(rated, "large", whole) == 62 * 60_000
    assert booked(rated, "small", small) == 62 * 60_000 + 600
    advance(rated, 62 * 60 - 0.001)
    assert 0 < turn_ms(rated, "large") <= 2  # the last thousandth of a token
    with pytest.raises(RateWindowFull):
        send(rated, "small", claim=small)  # behind the large call, whatever its size
    advance(rated, 0.001)
    send(rated, "large", claim=whole)


def test_what_the_provider_says_remains_narrows_a_window_net_of_its_line(
    rated: Ledger,
) -> None:
    fill(rated, 60)
    keys = ["b1", "b2", "b3"]
    assert [booked(rated, key) for key in keys] == [1_000, 2_000, 3_000]
    advance(rated, 10)  # the ledger's window holds ten, three of them booked
    assert [turn_ms(rated, key) for key in keys] == [0, 0, 0]
    # the provider says two requests remain: the three booked calls have not reached
    # it, so they take those two and the third waits; a newcomer waits behind them
    seen = RateSeen(now_ms(rated), requests=2)
    rated.calls.settle("sent1", 1, answered=Answered(counted=RateAsk(1, 0), seen=seen))
    assert [turn_ms(rated, key) for key in keys] == [0, 0, 1_000]
    assert booked(rated, "newcomer") == 2_000
    assert sent_now(rated, ["newcomer", *keys]) == ["b1", "b2"]


def test_an_answer_stating_a_higher_limit_or_none_never_raises_a_window(
    rated: Ledger,
) -> None:
    """What the provider states is never read as a wider window, on every path: a
    limit higher than the window's, or none at all, leaves the limit as it is."""
    rated.rates.set_limit("openai", "gpt-4o-mini", "requests", 60)
    for key in ("a", "b", "c"):
        send(rated, key)
    # each answer says fewer remain than the window holds (57): the window narrows,
    # and its limit is what is in question
    higher = RateSeen(now_ms(rated), requests=50, requests_limit=10_000)
    rated.calls.settle("a", 1, answered=Answered(counted=RateAsk(1, 0), seen=higher))
    assert [(w.per_minute, w.available) for w in rated.rates.windows()] == [(60, 50)]
    none_stated = RateSeen(now_ms(rated), requests=40)
    rated.calls.settle("b", 1, answered=Answered(counted=RateAsk(1, 0), seen=none_stated))
    assert [(w.per_minute, w.available) for w in rated.rates.windows()] == [(60, 40)]
    lower = RateSeen(now_ms(rated), requests=30, requests_limit=30)
    rated.calls.settle("c", 1, answered=Answered(counted=RateAsk(1, 0), seen=lower))
    assert [(w.per_minute, w.available) for w in rated.rates.windows()] == [(30, 30)]


def book_as(ledger: Ledger, budget: str, key: str) -> int:
    return booked(ledger, key, MINI, budget=budget)


@pytest.mark.parametrize(("weight_a", "weight_b", "share_a"), [(None, None, 10), (3, 1, 15)])
def test_tenants_in_one_line_share_the_window_by_their_weights(
    rated: Ledger, weight_a: int | None, weight_b: int | None, share_a: int
) -> None:
    """Tenant a floods the line with 40 calls, then tenant b comes with 40: of the
    first 20 turns, a gets its weight's part (half by default, three quarters at 3:1),
    b the rest; within each tenant, its calls keep their order."""
    fill(rated, 60)
    for name, weight in (("a", weight_a), ("b", weight_b)):
        rated.create_budget(name, 1_000_000)
        if weight is not None:
            rated.rates.set_weight(name, weight)
    turns = {f"a{n}": book_as(rated, "a", f"a{n}") for n in range(40)}
    assert list(turns.values()) == [(n + 1) * 1_000 for n in range(40)]
    turns |= {f"b{n}": book_as(rated, "b", f"b{n}") for n in range(40)}
    turns = {key: turn_ms(rated, key) for key in turns}
    first = sorted(turns, key=turns.__getitem__)[:20]
    assert sum(key.startswith("a") for key in first) == share_a
    for tenant in "ab":
        own = [turns[f"{tenant}{n}"] for n in range(40)]
        assert own == sorted(own) and len(set(own)) == 40


@pytest.mark.parametrize(("weight_a", "sent_by_a"), [(None, 20), (3, 30)])
def test_a_flooding_tenant_takes_no_more_than_its_share_from_one_that_keeps_asking(
    rated: Ledger, weight_a: int | None, sent_by_a: int
) -> None:
    """Tenant a has 100 calls waiting; tenant b asks one call at a time, again as soon
    as the last is sent. Over 40 s of a 60-a-minute window, b gets half the sends (a
    quarter where a weighs 3), however many a queued: an idle tenant's part goes to
    the others, a tenant that keeps asking keeps its own."""
    fill(rated, 60)
    rated.create_budget("a", 1_000_000)
    rated.create_budget("b", 1_000_000)
    if weight_a is not None:
        rated.rates.set_weight("a", weight_a)
    waiting = [f"a{n}" for n in range(100)]
    for key in waiting:
        book_as(rated, "a", key)
    b_count = 0
    waiting.append("b0")
    book_as(rated, "b", "b0")
    sent: list[str] = []
    for _ in range(40):
        advance(rated, 1)
        for key in sorted(waiting, key=lambda k: turn_ms(rated, k)):
            if turn_ms(rated, key) > 0:
                break
            budget = key[0]
            rated.calls.reserve(budget, key, 1, grant=CallFacts(model="gpt-4o-mini", rate=MINI))
            waiting.remove(key)
            sent.append(key)
            if budget == "b":  # b asks again at once
                b_count += 1
                waiting.append(f"b{b_count}")
                with contextlib.suppress(RateWindowFull):
                    book_as(rated, "b", f"b{b_count}")
    assert len(sent) == 40
    assert sum(key.startswith("a") for key in sent) == sent_by_a
    assert [k for k in sent if k.startswith("a")] == [f"a{n}" for n in range(sent_by_a)]


def test_a_tenant_back_from_idling_hoards_no_place_in_the_line(rated: Ledger) -> None:
    """Tenant a has 40 calls in line; 20 of them are sent; tenant b, idle all along,
    then comes with 10: its calls take turns with a's from where the line stands, not
    all ten ahead of a's next call as if b had been in line since the start."""
    fill(rated, 60)
    rated.create_budget("a", 1_000_000)
    rated.create_budget("b", 1_000_000)
    for n in range(40):
        book_as(rated, "a", f"a{n}")
    advance(rated, 20)
    assert sent_now(rated, [f"a{n}" for n in range(40)], budget="a") == [f"a{n}" for n in range(20)]
    turns = {f"b{n}": book_as(rated, "b", f"b{n}") for n in range(10)}
    turns |= {f"a{n}": turn_ms(rated, f"a{n}") for n in range(20, 40)}
    first = sorted(turns, key=turns.__getitem__)[:10]
    assert sum(key.startswith("b") for key in first) == 5


def test_a_booked_call_that_asks_anew_leaves_its_place_and_the_line_moves_up(
    rated: Ledger,
) -> None:
    """A call that comes back asking something else than it booked (its request
    changed) gives its booking back whole and joins the line at its end: the calls
    behind it move up by what it had booked."""
    rated.rates.set_limit("openai", "*", "tokens", 6_000)
    send(rated, "first", claim=RateClaim("openai", ("gpt-4o-mini", "*"), RateAsk(1, 6_000)))
    sizes = {"b1": 3_000, "b2": 1_000, "b3": 1_000}
    claims = {k: RateClaim("openai", ("gpt-4o-mini", "*"), RateAsk(1, n)) for k, n in sizes.items()}
    assert [booked(rated, k, claims[k]) for k in sizes] == [30_000, 40_000, 50_000]
    other = RateClaim("openai", ("gpt-4o-mini", "*"), RateAsk(1, 2_000))
    assert booked(rated, "b1", other) == 40_000  # behind b2 and b3 now
    assert [turn_ms(rated, k) for k in ("b2", "b3", "b1")] == [10_000, 20_000, 40_000]
