"""LocalAgreement-2 policy and transcript text helpers (pure, no model)."""

from __future__ import annotations

import pytest

from voicebot.engines.asr.agreement import (
    LocalAgreement,
    continuation_after,
    join_text,
    normalize_word,
)


def feed(policy: LocalAgreement, hypothesis: str) -> list[str]:
    """Feed a full hypothesis the way the engine does: only the part after the confirmed words."""
    words = hypothesis.split()
    confirmed = policy.confirmed
    assert [normalize_word(w) for w in words[: len(confirmed)]] == [
        normalize_word(w) for w in confirmed
    ], "the engine forces confirmed words as the decode prefix"
    return policy.update(words[len(confirmed) :])


def test_first_hypothesis_confirms_nothing() -> None:
    policy = LocalAgreement()
    assert feed(policy, "and mister john") == []
    assert policy.confirmed == []
    assert policy.tentative_text == "and mister john"


def test_common_prefix_of_two_hypotheses_is_confirmed_except_the_last_word() -> None:
    policy = LocalAgreement()
    feed(policy, "And Mr. John Dax.")
    assert feed(policy, "And Mr. John Dashwood had") == ["And", "Mr.", "John"]
    assert policy.tentative == ["Dashwood", "had"]
    # Both agree on "had", but it is the newest hypothesis's last word: held back.
    assert feed(policy, "And Mr. John Dashwood had") == ["Dashwood"]
    assert policy.confirmed_text == "And Mr. John Dashwood"


def test_case_and_punctuation_do_not_break_agreement_and_newer_spelling_wins() -> None:
    policy = LocalAgreement()
    feed(policy, "He was not. An")
    assert feed(policy, "he was not an ill disposed") == ["he", "was", "not", "an"]


def test_disagreement_confirms_nothing_and_confirmed_words_survive_any_hypothesis() -> None:
    policy = LocalAgreement()
    feed(policy, "he was not an")
    feed(policy, "he was not an old")
    assert policy.confirmed == ["he", "was", "not", "an"]
    assert policy.update(["a", "totally", "different", "thing"]) == []
    assert policy.update([]) == []
    assert policy.confirmed == ["he", "was", "not", "an"]
    assert policy.tentative == []


def test_confirmed_is_monotonic_over_a_random_hypothesis_sequence() -> None:
    import random

    rng = random.Random(7)
    vocab = ["a", "b", "c", "d", "e."]
    policy = LocalAgreement()
    history: list[list[str]] = []
    for _ in range(500):
        policy.update([rng.choice(vocab) for _ in range(rng.randint(0, 6))])
        history.append(policy.confirmed)
    for before, after in zip(history, history[1:], strict=False):
        assert after[: len(before)] == before


def test_punctuation_only_tokens_agree_only_when_identical() -> None:
    policy = LocalAgreement(hold_back=0)
    policy.update([",", "who"])
    assert policy.update([".", "who"]) == []
    policy.update([",", "who"])
    assert policy.update([",", "who"]) == [",", "who"]
    assert policy.confirmed_text == ", who"


def test_reset_and_bad_hold_back() -> None:
    policy = LocalAgreement()
    feed(policy, "a b c")
    feed(policy, "a b c")
    assert policy.confirmed
    policy.reset()
    assert policy.confirmed == [] and policy.tentative == []
    with pytest.raises(ValueError):
        LocalAgreement(hold_back=-1)
    with pytest.raises(ValueError):
        LocalAgreement(n=1)


@pytest.mark.parametrize(
    ("left", "right", "joined"),
    [
        ("", "", ""),
        ("And Mr.", "", "And Mr."),
        ("", "John", "John"),
        ("And Mr.", "John", "And Mr. John"),
        ("young man", ".", "young man."),
        ("John", "'s house", "John's house"),
        ("Dashwood", ", who was", "Dashwood, who was"),
        (" a ", " b ", "a b"),
    ],
)
def test_join_text(left: str, right: str, joined: str) -> None:
    assert join_text(left, right) == joined


@pytest.mark.parametrize(
    ("decoded", "prefix", "rest"),
    [
        (" He was not an old man.", "", "He was not an old man."),
        (" He was not an old man.", "He was not", "an old man."),
        (" He was not an old man.", "He was not an old man", "."),
        (" He was not, who", "He was not", ", who"),
        (" And then leisurely.", "And then leisure", "ly."),  # never rewrites "leisure"
        ("", "He was", ""),  # segment dropped as no-speech: nothing new
        (" he WAS not an", "He was", "not an"),  # did not round-trip: align on words
        (" Something else", "He was", ""),
    ],
)
def test_continuation_after_forced_prefix(decoded: str, prefix: str, rest: str) -> None:
    assert continuation_after(decoded, prefix) == rest


def test_local_agreement_3_needs_three_hypotheses_in_a_row() -> None:
    policy = LocalAgreement(n=3)
    feed(policy, "how do you")
    assert feed(policy, "how do you marry") == []
    assert feed(policy, "had he married a") == []  # breaks the run
    assert feed(policy, "had he married a more") == []
    assert feed(policy, "had he married a more amiable") == ["had", "he", "married", "a"]
    assert policy.tentative == ["more", "amiable"]
    assert feed(policy, "had he married a more amiable woman") == ["more"]
    # "woman" is in only the last two hypotheses.
    assert feed(policy, "had he married a more amiable woman he") == ["amiable"]
