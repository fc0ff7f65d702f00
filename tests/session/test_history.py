"""Conversation history with the real Qwen3 and Qwen2.5-style chat templates."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fakes import LONG_INSTRUCTIONS, call, make_engines, until
from transformers import AutoTokenizer

from voicebot.session import events as ev
from voicebot.session.history import Conversation


def test_prompts_extend_each_other_across_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    prompts = []
    for i in range(4):
        conv.append("user", f"Question {i}?")
        prompts.append(conv.prompt_ids())
        conv.append("assistant", f"Answer {i}.")
    for earlier, later in zip(prompts, prompts[1:], strict=False):
        assert later[: len(earlier)] == earlier
    assert conv.rebuilds == 1  # only the initial build


def test_speculative_prompt_equals_the_committed_one(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Hi.")
    conv.append("assistant", "Hello!")
    speculative = conv.prompt_ids(user_text="What time is it?")
    conv.append("user", "What time is it?")
    assert conv.prompt_ids() == speculative


def test_trim_drops_oldest_turns_and_keeps_the_budget(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=200, reply_tokens=20)
    for i in range(20):
        conv.append("user", f"This is user message number {i} with some words.")
        conv.append("assistant", f"This is reply number {i}.")
        conv.trim()
        assert conv.token_count + conv.reply_tokens <= conv.budget_tokens
    assert conv.messages[0].role == "user"
    assert conv.messages[-1].content == "This is reply number 19."
    assert len(conv.messages) < 40


def test_a_compaction_drops_what_a_trim_would_and_its_ids_are_the_history_after_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The session prefills compacted_ids() and then swaps in compact(): the two must be
    # the same tokens, or the swapped-in history misses the cache it was prefilled for.
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=300, reply_tokens=20)
    i = 0
    while not conv.near_budget():
        conv.append("user", f"This is user message number {i} with some words.", item_id=f"u{i}")
        conv.append("assistant", f"This is reply number {i}.", item_id=f"a{i}")
        i += 1
    assert not conv.over_budget() and i >= 3
    head = conv.trim_plan()
    assert head and head[0].item_id == "u0" and head[-1].role == "assistant"
    assert len(conv.messages) == 2 * i, "planning drops nothing"
    expected = conv.compacted_ids(head, " Talked about messages. ")
    assert conv.compact(head, " Talked about messages. ")
    assert conv.history_ids() == expected
    assert conv.summary == "Talked about messages." and conv.messages[0].role == "user"
    assert conv.token_count + conv.reply_tokens <= conv.budget_tokens * conv.trim_to
    # A head the history no longer starts with (a client deleted a message) is refused.
    stale = conv.trim_plan() or conv.messages[:2]
    assert conv.delete(stale[0].item_id)  # type: ignore[arg-type]
    assert conv.compacted_ids(stale, "x") is None and not conv.compact(stale, "x")


def test_a_reply_as_long_as_the_budget_leaves_the_call_its_memory(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The history kept room for a whole reply: with max_tokens at or above the budget
    # (Realtime allows 4096; the default budget is 1536) every append trimmed every
    # message, the user's question just committed included.
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=400, reply_tokens=4096)
    for i in range(3):
        conv.append("user", f"Question {i}: what is the weather like today?")
        conv.trim()
        conv.append("assistant", f"Answer {i}: sunny.")
        conv.trim()
    assert [m.content for m in conv.messages][-2:] == ["Question 2: what is the weather like today?", "Answer 2: sunny."]
    assert conv.token_count <= conv.budget_tokens // 2


def test_replace_and_delete_items(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Tell me a story.", item_id="u1")
    conv.append("assistant", "Once upon a time there was a king who", item_id="a1")
    assert conv.replace("a1", "Once upon a time")
    assert conv.messages[-1].content == "Once upon a time"
    assert "king" not in tokenizer.decode(conv.prompt_ids())
    assert conv.delete("u1")
    assert [m.item_id for m in conv.messages] == ["a1"]
    assert not conv.replace("missing", "x")


def test_summary_goes_into_the_system_message(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.set_summary("The caller asked about trains to Leeds.")
    text = tokenizer.decode(conv.prompt_ids())
    assert "Earlier in this call: The caller asked about trains to Leeds." in text


def test_a_finished_reply_is_stored_as_generated(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Hi.")
    prompt = conv.prompt_ids()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # A non-canonical split of " Hello there!" plus the end-of-turn token, as a model may emit it.
    generated = [*tokenizer.encode("Hello", add_special_tokens=False), *tokenizer.encode(" there!", add_special_tokens=False), end]
    conv.append("assistant", "Hello there!", token_ids=generated)
    conv.append("user", "Bye.")
    later = conv.prompt_ids()
    assert later[: len(prompt)] == prompt
    assert later[len(prompt) : len(prompt) + len(generated)] == generated
    assert later[len(prompt) + len(generated)] != end, "the closing token is not doubled"
    assert "Hello there!<|im_end|>\n<|im_start|>user\nBye." in tokenizer.decode(later)


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to tokenise."""

    def __init__(self, tok) -> None:  # type: ignore[no-untyped-def]
        self._tok = tok
        self.encoded_chars = 0

    def apply_chat_template(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._tok.apply_chat_template(*args, **kwargs)

    def encode(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
        self.encoded_chars += len(text)
        return self._tok.encode(text, **kwargs)


def long_conversation(tok, turns: int, budget: int = 100_000) -> Conversation:  # type: ignore[no-untyped-def]
    conv = Conversation(tok, "Be brief.", budget_tokens=budget, reply_tokens=20)
    for i in range(turns):
        conv.append("user", f"This is user message number {i} with a few more words in it.", item_id=f"u{i}")
        conv.append("assistant", f"This is reply number {i}, also a little longer than needed.", item_id=f"a{i}")
    return conv


def test_trims_and_summaries_do_not_retokenise_the_history(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Re-encoding the whole history on the event loop at every trim (once per dropped
    turn) and every summary stalled every session; only the system message may be."""
    counting = CountingTokenizer(tokenizer)
    conv = long_conversation(counting, 60)
    conv.budget_tokens = conv.token_count  # the next reply would overflow: trim
    history_chars = counting.encoded_chars
    counting.encoded_chars = 0
    dropped = conv.trim()
    assert dropped and dropped[0].item_id == "u0"
    conv.set_summary("The caller asked many numbered questions.")
    conv.set_system_prompt("Be very brief.")
    assert conv.replace(conv.messages[-1].item_id, "This is reply")  # type: ignore[arg-type]
    assert counting.encoded_chars < 400 < history_chars / 10, (counting.encoded_chars, history_chars)
    assert conv.rebuilds == 1


def test_edits_give_the_ids_of_a_fresh_encoding(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = long_conversation(tokenizer, 12)
    conv.budget_tokens = conv.token_count
    conv.trim()
    conv.set_summary("Numbered questions so far.")
    conv.replace("a11", "This is reply")
    conv.delete("u11")
    fresh = Conversation(tokenizer, "Be brief.", budget_tokens=100_000, reply_tokens=20)
    fresh.set_summary("Numbered questions so far.")
    for m in conv.messages:
        fresh.append(m.role, m.content, m.item_id)
    assert conv.prompt_ids() == fresh.prompt_ids()
    assert conv.token_count + conv.reply_tokens <= conv.budget_tokens


def test_prompts_extend_each_other_between_trims(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=300, reply_tokens=20)
    previous: list[int] | None = None
    trims = 0
    for i in range(30):
        conv.append("user", f"Question {i} about the weather in a faraway town?")
        if conv.trim():
            trims += 1
            conv.set_summary(f"Summary after trim {trims}.")
            previous = None  # a trim changes the prefix on purpose (one cache miss)
        prompt = conv.prompt_ids()
        if previous is not None:
            assert prompt[: len(previous)] == previous
        conv.append("assistant", f"Answer {i}: sunny.")
        previous = conv.prompt_ids()[: conv.token_count]
    assert trims >= 2


class CountingTemplates:
    """The real tokenizer, counting the messages its chat template renders."""

    def __init__(self, tok) -> None:  # type: ignore[no-untyped-def]
        self._tok = tok
        self.rendered = 0

    def apply_chat_template(self, messages, **kwargs):  # type: ignore[no-untyped-def]
        self.rendered += len(messages)
        return self._tok.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._tok, name)


def test_a_turn_renders_the_same_few_messages_however_long_the_call(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Rendering the whole history at every append and prompt cost ~4 ms of event-loop
    time per turn on long calls (most of the loop at hundreds of sessions)."""
    counting = CountingTemplates(tokenizer)
    conv = long_conversation(counting, 60)

    def one_turn() -> int:
        counting.rendered = 0
        conv.append("user", "And one more question?")
        conv.prompt_ids(user_text=None)
        conv.append("assistant", "And one more answer.")
        return counting.rendered

    assert one_turn() < 40, counting.rendered


def test_rendering_in_context_gives_the_ids_of_rendering_the_whole_history(tokenizer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def build() -> list[list[int]]:
        conv = long_conversation(tokenizer, 8)
        conv.replace("a3", "This is")
        conv.append("user", "Last question?")
        return [conv.prompt_ids(), conv.prompt_ids(user_text="And then?")]

    in_context = build()
    monkeypatch.setattr(Conversation, "_context", staticmethod(lambda history, message=None: history))
    assert build() == in_context


# ------------------------------------------------------------------ tool turns
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["qwen3-tokenizer", "qwen2.5-coder-0.5b-instruct"])
def any_tokenizer(request, bundle_dir: Callable[[str], str]):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(bundle_dir(request.param))


def test_tools_are_rendered_by_the_template_into_the_system_message(any_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(any_tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Hi.")
    before = conv.prompt_ids()
    conv.set_tools([WEATHER_TOOL])
    text = any_tokenizer.decode(conv.prompt_ids())
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text.index("get_weather") < text.index("Hi.")
    # The system message changed: the user turn and the generation prompt keep their ids.
    kept = len(before) - len(Conversation(any_tokenizer, "Be brief.", 10_000, 32)._system_ids)
    assert conv.prompt_ids()[-kept:] == before[-kept:]
    expected = any_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
        tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == expected


def test_a_tool_round_keeps_every_prompt_a_prefix_of_the_next(any_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = any_tokenizer
    conv = Conversation(tok, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.set_tools([WEATHER_TOOL])
    conv.append("user", "What's the weather in Paris?")
    first = conv.prompt_ids()
    generated = tok.encode(CALL_TEXT, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    conv.append("assistant", CALL_TEXT, "a1", token_ids=generated)
    conv.append("tool", '{"temp_c": 21, "sky": "sunny"}', call_id="call_1")
    second = conv.prompt_ids()
    # As generated: the first prompt, the call's tokens, then the result and a new prompt.
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + len(generated)] == generated
    history = second[: conv.token_count]  # the prompt without its generation prompt
    assert tok.decode(history).endswith(
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21, "sky": "sunny"}\n</tool_response><|im_end|>\n')
    conv.append("tool", "second result", call_id="call_2")  # two results in a row
    third = conv.prompt_ids()
    assert third[: len(history)] == history
    assert tok.decode(third).count("<tool_response>") == 2


def test_a_client_added_call_is_rendered_with_the_template(any_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(any_tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.set_tools([WEATHER_TOOL])
    conv.append("user", "Weather?")
    conv.append("assistant", "", "fc1", tool_calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}}],
                call_id="call_9")
    conv.append("tool", "cold", call_id="call_9")
    text = any_tokenizer.decode(conv.prompt_ids())
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\ncold\n</tool_response>" in text


def test_a_per_response_override_changes_only_the_system_message(any_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(any_tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Hi.")
    plain = conv.prompt_ids()
    override = conv.prompt_ids(system_prompt="Answer in French.", tools=[WEATHER_TOOL])
    text = any_tokenizer.decode(override)
    assert "Answer in French." in text and "get_weather" in text and "Be brief." not in text
    assert conv.prompt_ids() == plain  # the session's own prompt is untouched
    tail = len(plain) - len(conv._system_ids)
    assert override[-tail:] == plain[-tail:]


def test_trim_never_keeps_an_orphan_tool_result(tokenizer) -> None:  # type: ignore[no-untyped-def]
    conv = Conversation(tokenizer, "Be brief.", budget_tokens=300, reply_tokens=20)
    for i in range(12):
        conv.append("user", f"This is user message number {i} with some words.")
        conv.append("assistant", CALL_TEXT)
        conv.append("tool", f"result {i}", call_id=f"c{i}")
        conv.append("assistant", f"Reply {i}.")
        conv.trim()
    assert conv.messages[0].role == "user"


# Found in review (stop 20): the trim dropped the message just added when the system
# message alone was over its target.
def question(i: int) -> str:
    return f"Question number {i}: could you tell me what the weather will be like in town tomorrow?"


def answer(i: int) -> str:
    return f"Answer {i}: it will be sunny and warm with a light breeze from the west."


def test_trim_never_drops_the_message_just_added(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # a423f78 keeps at most half the budget for the next reply, but the trim target is
    # still budget * 0.6 - that: 921 - 768 = 153 tokens at the default budget (1536) with
    # a Realtime max_output_tokens of 4096 (any max_tokens >= 768). A system message
    # longer than the target (LONG_INSTRUCTIONS: 295 tokens; a Realtime client's
    # instructions and tools are often more) is never under it, so the trim loop drops
    # every message, the user's question just appended included.
    conv = Conversation(tokenizer, LONG_INSTRUCTIONS, budget_tokens=1536, reply_tokens=4096)
    for i in range(30):
        conv.append("user", question(i), item_id=f"u{i}")
        conv.trim()
        kept = [m.item_id for m in conv.messages]
        assert f"u{i}" in kept, (
            f"turn {i}: the trim dropped the question just asked (history now {kept}, "
            f"{conv.token_count} tokens of {conv.budget_tokens})"
        )
        conv.append("assistant", answer(i), item_id=f"a{i}")
        conv.trim()


async def test_a_reply_to_a_text_question_is_asked_that_question(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The same trim in a session: a client's text turn (Realtime conversation.item.create
    # then response.create; a function_call_output goes the same way) is appended, the
    # trim drops it, and the reply's prompt holds only the system message (and summary):
    # the model answers a question it was never asked.
    engines = make_engines(tokenizer, reply="Sure.")
    prompts: list[list[int]] = []
    generate = engines.llm.generate

    def recording(prompt_ids: list[int], **kw: Any) -> AsyncIterator[Any]:
        prompts.append(list(prompt_ids))
        return generate(prompt_ids, **kw)  # type: ignore[no-any-return]

    engines.llm.generate = recording  # type: ignore[method-assign]
    async with call(engines, turn_detection=False, system_prompt=LONG_INSTRUCTIONS, max_tokens=4096) as c:
        for i in range(30):
            c.session.add_text("user", question(i))
            c.session.create_response()
            await until(c.clock, lambda n=i + 1: len(c.of(ev.ResponseDone)) >= n, timeout=10)
            asked = tokenizer.decode(prompts[-1])
            assert question(i) in asked, f"turn {i}: the reply's prompt lacks its question:\n...{asked[-300:]}"


# Finals of the test clips and of spoken questions, with what tends to trip a tokeniser:
# numbers, contractions, quotes, marks inside and at the end.
FINALS = [
    "And so, my fellow Americans, ask not what your country can do for you, ask what you can do for your country.",
    "I'd like to book a table for 2 at 7:30 tonight, please; it's my wife's birthday!",
    "Go forward ten meters.",
    "What's the weather in \"New York\" on the 21st, and will it rain?",
    "Hmm… can you spell your name?",
]


def test_the_words_heard_so_far_start_the_prompt_of_the_finished_turn(any_tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The session prefills the turn while the caller speaks (user_prefix_ids of each
    # partial transcript); the finished turn's prompt must begin with those very ids, or
    # vLLM's prefix cache holds nothing of them. A partial ends where the speech heard so
    # far ends, often with a full stop Whisper put there: cut after every word, with and
    # without one.
    conv = Conversation(any_tokenizer, "Be brief.", budget_tokens=10_000, reply_tokens=32)
    conv.append("user", "Hi.")
    conv.append("assistant", "Hello! How can I help?")
    history = conv.history_ids()
    for final in FINALS:
        prompt = conv.prompt_ids(user_text=final)
        words = final.split()
        for k in range(1, len(words) + 1):
            for partial in (" ".join(words[:k]), " ".join(words[:k]).rstrip(".,;:!?…") + "."):
                ids = conv.user_prefix_ids(partial)
                assert len(ids) > len(history), partial
                assert prompt[: len(ids)] == ids, (
                    f"{partial!r} of {final!r}: {any_tokenizer.decode(ids[len(history):])!r} is not how "
                    f"the prompt goes on: {any_tokenizer.decode(prompt[len(history):len(ids) + 2])!r}"
                )
    assert conv.user_prefix_ids("  ") == history
    assert conv.history_ids() == history, "nothing is added to the history"
