import re

import pytest

from voicebot.session.clauses import ClauseChunker


def feed(chunker: ClauseChunker, pieces: list[str]) -> list[str]:
    out: list[str] = []
    for p in pieces:
        out.extend(chunker.push(p))
    rest = chunker.flush()
    return out + ([rest] if rest else [])


def test_sentences_are_cut_at_punctuation_followed_by_space() -> None:
    c = ClauseChunker()
    pieces = ["The capital", " of France", " is Paris", ".", " It is", " lovely in", " spring", "."]
    assert feed(c, pieces) == ["The capital of France is Paris.", "It is lovely in spring."]


def test_never_cuts_mid_word() -> None:
    c = ClauseChunker(first_clause_words=2)
    # "Par" + "is" arrive as two tokens: no cut may fall between them.
    assert c.push("Hello Par") == []
    assert c.push("is") == []
    assert c.push(" now ") == ["Hello Paris"]
    assert c.flush() == "now"


def test_first_clause_is_cut_early_at_a_comma() -> None:
    c = ClauseChunker(first_clause_words=6, max_clause_words=24)
    assert c.push("Well, I think ") == ["Well,"]
    assert c.push("so, ") == []  # "I think so," is too short for a later comma cut



def test_later_clauses_need_more_words_before_a_comma_cut() -> None:
    c = ClauseChunker(first_clause_words=6, max_clause_words=24)
    assert c.push("Yes. ") == ["Yes."]
    assert c.push("Red, green and blue, ") == []  # "Red," is too short for a later clause
    assert c.push("and then some more words, ok ") == ["Red, green and blue, and then some more words,"]


def test_forced_cut_without_punctuation() -> None:
    c = ClauseChunker(first_clause_words=4, max_clause_words=6)
    out = c.push("one two three four five six seven ")
    assert out == ["one two three four"]
    out = c.push("eight nine ten eleven twelve ")
    assert out == ["five six seven eight nine ten"]


def test_flush_returns_remaining_text_once() -> None:
    c = ClauseChunker()
    assert c.push("No punctuation here") == []
    assert c.flush() == "No punctuation here"
    assert c.flush() is None


def test_decimal_numbers_are_not_sentence_ends() -> None:
    c = ClauseChunker()
    assert c.push("It costs 3.50 dollars") == []


def test_first_clause_is_cut_before_a_phrase_once_it_has_two_words() -> None:
    c = ClauseChunker(first_clause_words=4, max_clause_words=24)
    assert c.push("We close at") == []  # "at" may still be "attention"
    assert c.push(" six this evening") == ["We close"]
    assert c.flush() == "at six this evening"


def test_phrase_cut_needs_two_words_and_applies_to_the_first_clause_only() -> None:
    c = ClauseChunker(first_clause_words=4, max_clause_words=24)
    assert c.push("Boil the water and ") == ["Boil the water"]  # never before "of" or an article
    assert c.push("pour it over the tea bag and wait ") == []  # later clauses: no phrase cut
    assert c.flush() == "and pour it over the tea bag and wait"


def test_phrase_cut_does_not_take_a_word_that_only_starts_like_one() -> None:
    c = ClauseChunker(first_clause_words=6, max_clause_words=24)
    assert c.push("It needs attention now ") == []
    assert c.push("please. ") == ["It needs attention now please."]


def test_first_clause_does_not_wait_for_the_token_after_its_punctuation() -> None:
    c = ClauseChunker(first_clause_words=4, max_clause_words=24)
    assert c.push("Sure") == []
    assert c.push(".") == ["Sure."]
    assert c.push(" We close at six.") == []  # later clauses wait for the whitespace
    assert c.push(" Bye") == ["We close at six."]


@pytest.mark.parametrize("text", ["Mr.", "It costs 3.", "Try e.g.", "In the U.S.", "It's"])
def test_first_clause_waits_where_the_mark_may_not_end_anything(text: str) -> None:
    assert ClauseChunker(first_clause_words=6).push(text) == []


@pytest.mark.parametrize(
    ("pieces", "clauses"),
    [
        # Seen in the voice loop (2026-11-28): "Mr." went to TTS alone, spoken as a sentence
        # of its own ("Mister." and a pause), then "Dashwood was indeed ...".
        (["Mr", ".", " Dashwood", " was", " kind", "."], ["Mr. Dashwood was kind."]),
        (["You can see", " Dr", ". Smith", " at", " nine", ". Bye", "."], ["You can see Dr. Smith", "at nine.", "Bye."]),
        (["It", " is", " near", " St", ". Louis", " and", " Mt", ". Hood", "."], ["It is near St. Louis", "and Mt. Hood."]),
        (["Ask", " for", " J", ". K", ". Rowling", " please", "."], ["Ask for J. K. Rowling please."]),
        (["Room", " No", ". 5", " is", " free", "."], ["Room No. 5 is free."]),
        # Titles the first clause's early cut (at the mark, before the next text) did
        # not know: "Prof." and "Capt." were cut alone there.
        (["Prof", ".", " Smith", " is", " in", "."], ["Prof. Smith is in."]),
        (["Capt", ".", " Hook", " sails", " today", "."], ["Capt. Hook sails today."]),
        # Still sentences: a plain word, "No." before a word, "etc." at the end of one.
        (["No", ". I", " am", " sorry", "."], ["No.", "I am sorry."]),
        (["We", " sell", " pens", ", ink", ", etc", ". Anything", " else", "?"],
         ["We sell pens,", "ink, etc.", "Anything else?"]),
    ],
)
def test_an_abbreviation_or_an_initial_does_not_end_a_clause(pieces: list[str], clauses: list[str]) -> None:
    assert feed(ClauseChunker(first_clause_words=8, max_clause_words=24), pieces) == clauses


def test_later_clauses_are_whole_sentences_while_audio_is_ahead() -> None:
    c = ClauseChunker(first_clause_words=4, max_clause_words=24, running_low=lambda: False)
    words = "Sure. The weather will be warm and sunny in the morning with a light breeze from the west."
    assert feed(c, [w + " " for w in words.split()]) == [
        "Sure.", "The weather will be warm and sunny in the morning with a light breeze from the west."
    ]


def test_later_clauses_are_cut_early_while_the_audio_runs_low() -> None:
    # The first clause plays for ~0.3 s while the model writes the next sentence at ~1.5x
    # the voice's pace: waiting for its full stop left seconds of silence.
    c = ClauseChunker(first_clause_words=4, max_clause_words=24, running_low=lambda: bool(out))
    out: list[str] = []
    for w in "Sure. The weather will be warm and sunny in the morning, with a light breeze".split():
        out += c.push(w + " ")
    out += [c.flush() or ""]
    assert out == [
        "Sure.",
        "The weather will be warm",  # nothing to cut at: 5 words
        "and sunny",  # before a phrase, from 2 words
        "in the morning,",  # a comma from 2 words
        "with a light breeze",
    ]


def test_the_first_clause_does_not_depend_on_the_audio_ahead() -> None:
    for low in (True, False):
        c = ClauseChunker(first_clause_words=4, max_clause_words=24, running_low=lambda low=low: low)  # type: ignore[misc]
        assert c.push("The weather looks warm today ") == ["The weather looks warm"]


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("My name is John and I can help", "My name is John"),
        ("To boil an egg you need water", "To boil an egg"),
        ("The distance between the Earth and", "The distance between the Earth"),  # 2 words more at most
        ("A large pizza costs ten", "A large pizza"),
        ("I'm glad I could help you", "I'm glad I could help"),
    ],
)
def test_a_cut_forced_by_length_does_not_end_on_a_word_the_phrase_goes_on_from(text: str, first: str) -> None:
    # Spoken as a sentence, "My name is" / "To boil an" ends in mid-air and the rest
    # starts as a new sentence.
    c = ClauseChunker(first_clause_words=3, max_clause_words=24)
    assert feed(c, [w + " " for w in text.split()])[0] == first


# ------------------------------------------ scripts without spaces, and text without any
def test_a_chinese_reply_is_cut_at_its_own_punctuation_as_it_streams() -> None:
    # Full-width marks end a clause with no space after them: the first clause is spoken
    # while the rest is still being written, not when the reply ends.
    c = ClauseChunker(first_clause_words=6, max_clause_words=24)
    assert c.push("好的，") == ["好的，"]
    assert c.push("今天北京天气晴朗") == []
    assert c.push("，气温二十度。明") == ["今天北京天气晴朗，气温二十度。"]
    assert c.push("天会下雨。") == ["明天会下雨。"]
    assert c.flush() is None


def test_japanese_sentence_ends_cut_without_whitespace() -> None:
    c = ClauseChunker()
    assert feed(c, ["こんにちは。", "元気", "ですか？", "はい"]) == ["こんにちは。", "元気ですか？", "はい"]


def test_a_long_clause_without_punctuation_is_cut_between_characters() -> None:
    # No mark for a long while: cut between two characters (each may end a word in these
    # scripts) once the clause is as long as a forced cut allows in words.
    c = ClauseChunker(first_clause_words=6, max_clause_words=24)
    out = c.push("我们今天下午三点在公司门口见面然后一起去")
    assert out and all(len(o) <= 14 for o in out), out
    assert "".join(out) + (c.flush() or "") == "我们今天下午三点在公司门口见面然后一起去"


def test_text_that_never_has_whitespace_is_cut_anyway() -> None:
    # A run no word is this long (a model writing pieces with no space): cut, not held
    # to the end of the reply, so its audio starts.
    c = ClauseChunker()
    run = "ꙮ" * 100
    out = c.push(run)
    assert out and "".join(out) + (c.flush() or "") == run
    assert max(len(o) for o in out) <= 40


def test_latin_text_keeps_its_cuts() -> None:
    # Unchanged for a spaced script: no cut inside a long English word or a number.
    c = ClauseChunker()
    assert c.push("Antidisestablishmentarianism") == []
    assert c.push(" 3.50") == []


# ------------------------------------------------------------------ ordered lists
def words_of(text: str) -> list[str]:
    """Pieces as a model streams them: each word with the whitespace before it."""
    return re.findall(r"\s*\S+", text)


@pytest.mark.parametrize(
    ("text", "clauses"),
    [
        # A small model asked for steps: the marker went to TTS as a clause of its own
        # ("two." and a pause), its item as the next.
        ("Sure! 1. Mix the flour. 2. Knead the dough. 3. Bake it.",
         ["Sure!", "1. Mix the flour.", "2. Knead the dough.", "3. Bake it."]),
        ("Here are the steps:\n\n1. Mix the flour.\n2. Knead the dough.",
         ["Here are the steps:", "1. Mix the flour.", "2. Knead the dough."]),
        ("1. Mix the flour. 2.", ["1. Mix the flour.", "2."]),  # a list cut off: the reply's end
        # A number ending a sentence still ends it.
        ("Yes. The shop opens at 5. Then it closes.", ["Yes.", "The shop opens at 5.", "Then it closes."]),
        ("Yes. Call 911. They will come.", ["Yes.", "Call 911.", "They will come."]),
        ("Yes. It has 21. 22 is more.", ["Yes.", "It has 21.", "22 is more."]),
    ],
)
def test_a_list_marker_does_not_end_a_clause(text: str, clauses: list[str]) -> None:
    assert feed(ClauseChunker(first_clause_words=8, max_clause_words=24), words_of(text)) == clauses
