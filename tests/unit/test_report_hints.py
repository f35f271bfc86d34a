"""The hint the ledger keeps of an API key (never the key), and how a vendor's hint of a
key is matched with it: the hints the fake provider lists as OpenAI and Anthropic show
them find their own key and no other."""

from __future__ import annotations

import pytest

from budget_tasks.providers.reports import KeyInfo, hint_of, hints_match, key_for
from budget_tasks.testing.fake_reports import partial_key_hint, redacted_value

OPENAI_KEY = "sk-proj-Xq3mT9vL2pR8wK4nY6bH1cJ5dF7gA0sE-Ab1C"
ANTHROPIC_KEY = "sk-ant-api03-R2Dx7Qm9Lp3Vt6Wk1Nz8Bc4Hj5Fg0Ys2Ue-igAA"


def test_a_keys_hint_is_at_most_its_first_sixteen_and_last_four_characters() -> None:
    assert hint_of(OPENAI_KEY) == "sk-proj-Xq3mT9v...Ab1C"  # 46 characters: a third
    assert hint_of(ANTHROPIC_KEY) == "sk-ant-api03-R2D...igAA"
    long_key = "sk-proj-" + "x" * 150 + "Ab1C"
    assert hint_of(long_key) == "sk-proj-xxxxxxxx...Ab1C"


@pytest.mark.parametrize(
    ("secret", "hint"),
    [
        ("", "..."),
        ("ab", "..."),  # a third of it is nothing
        ("abcde", "a..."),  # one character: the head only
        ("abcdef", "ab...f"),
        ("abcdefghijklmnopqr", "abcdef...pqr"),
        ("a" * 47 + "Z", "a" * 16 + "...aaaZ"),  # from 48 on: 16 and 4
    ],
)
def test_a_short_keys_hint_shows_at_most_a_third_of_it(secret: str, hint: str) -> None:
    assert hint_of(secret) == hint


@pytest.mark.parametrize("length", range(80))
def test_a_hint_shows_a_third_of_a_key_at_the_head_and_a_sixth_at_the_tail(length: int) -> None:
    """Never the key: its head is at most a third of it and its tail a sixth (so a key
    of 60 characters or more, as every real one is, shows at most a third)."""
    secret = "".join(chr(ord("A") + i % 26) for i in range(length))
    head, _, tail = hint_of(secret).partition("...")
    assert len(head) <= length // 3 and len(tail) <= length // 6
    assert len(head) + len(tail) < max(length, 1)
    if length >= 60:
        assert len(head) + len(tail) <= length // 3
    assert secret.startswith(head) and secret.endswith(tail)


def test_the_fakes_vendor_hints_match_their_own_key_and_no_other() -> None:
    """OpenAI's redacted value (6 and 4) and Anthropic's partial hint (16 and 4) are
    each the ledger's hint of the same key, and not of a key with another tail or
    head."""
    assert redacted_value(OPENAI_KEY) == "sk-pro...Ab1C"
    assert partial_key_hint(ANTHROPIC_KEY) == "sk-ant-api03-R2D...igAA"
    assert hints_match(hint_of(OPENAI_KEY), redacted_value(OPENAI_KEY))
    assert hints_match(hint_of(ANTHROPIC_KEY), partial_key_hint(ANTHROPIC_KEY))
    other_tail = OPENAI_KEY[:-4] + "zz9Q"
    assert not hints_match(hint_of(OPENAI_KEY), redacted_value(other_tail))
    assert not hints_match(hint_of(ANTHROPIC_KEY), partial_key_hint(ANTHROPIC_KEY[:-4] + "igAB"))
    assert not hints_match(hint_of(ANTHROPIC_KEY), redacted_value(OPENAI_KEY))
    # the ledger keeps 16 characters of the head, as Anthropic's hint does: past the
    # "sk-ant-api03-" every Anthropic key begins with, three tell two keys apart
    other_head = ANTHROPIC_KEY.replace("R2D", "R2E", 1)
    assert not hints_match(hint_of(ANTHROPIC_KEY), partial_key_hint(other_head))


@pytest.mark.parametrize(
    ("theirs", "matches"),
    [
        ("sk-pro...Ab1C", True),
        ("sk-proj-****...****Ab1C", True),  # masked: the stars say nothing
        ("sk-proj-Xq3mT9vL2pR8w...Ab1C", True),  # a head longer than ours
        ("sk-proj-Xq3m", True),  # a start only
        ("...Ab1C", True),  # an end only
        ("sk-pro...Ab1D", False),
        ("sk-ant...Ab1C", False),
        ("sk-proj-Xq3n...Ab1C", False),
        ("...", False),  # nothing shared: never a match
        ("****...****", False),
    ],
)
def test_a_vendor_hint_matches_where_both_ends_agree(theirs: str, matches: bool) -> None:
    assert hints_match(hint_of(OPENAI_KEY), theirs) is matches


def test_a_short_keys_empty_hint_matches_nothing() -> None:
    assert not hints_match(hint_of("ab"), "...")
    assert not hints_match(hint_of("ab"), "ab...")


def test_key_for_names_the_one_matching_key_and_never_guesses() -> None:
    mine = KeyInfo("key_1", redacted_value(OPENAI_KEY), "proj_a")
    other = KeyInfo("key_2", redacted_value(OPENAI_KEY[:-4] + "zz9Q"), "proj_b")
    assert key_for(hint_of(OPENAI_KEY), [mine, other]) == mine
    assert key_for(hint_of(OPENAI_KEY), [other]) is None
    assert key_for(hint_of(OPENAI_KEY), []) is None
    # OpenAI shows 6 and 4: two keys with the same last four are ambiguous, and an
    # ambiguous hint is attributed to neither
    twin = KeyInfo("key_3", redacted_value("sk-proj-another-key-entirely-Ab1C"), "proj_c")
    assert key_for(hint_of(OPENAI_KEY), [mine, twin]) is None
    # two Anthropic keys with the same last four are told apart by their heads (see
    # above); with the same head and tail too, they are ambiguous
    claude = KeyInfo("apikey_01a", partial_key_hint(ANTHROPIC_KEY), None)
    claude_other = KeyInfo(
        "apikey_01b", partial_key_hint(ANTHROPIC_KEY.replace("R2D", "R2E")), None
    )
    claude_twin = KeyInfo("apikey_01c", partial_key_hint(ANTHROPIC_KEY.replace("Qm9", "Qm8")), None)
    assert key_for(hint_of(ANTHROPIC_KEY), [claude]) == claude
    assert key_for(hint_of(ANTHROPIC_KEY), [claude, claude_other]) == claude
    assert key_for(hint_of(ANTHROPIC_KEY), [claude, claude_twin]) is None
    # a masked hint that shows less still finds the one key it can be
    masked = KeyInfo("key_4", "sk-proj-****...****Ab1C", None)
    assert key_for(hint_of(OPENAI_KEY), [masked, other]) == masked
