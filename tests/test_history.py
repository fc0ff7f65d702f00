"""Conversation history with the real Qwen3 and Qwen2.5-style chat templates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from voicebot.session.history import Conversation


@pytest.fixture(scope="module")
def tokenizer(bundle_dir: Callable[[str], str]):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(bundle_dir("qwen3-tokenizer"))


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
