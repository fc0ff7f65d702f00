"""Replies worth hearing (issue 12 §3): the echo measure, and the prompt the default
model is asked with.

The echo and answer rates themselves are figures of benchmarks/echo_rate.py
(docs/benchmarks.md, "Reply quality"); here: its scoring on fixed replies, and that our
own prompt building gives the default model exactly the tokens its chat template does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from voicebot.config import load_config
from voicebot.session.history import Conversation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import echo_rate  # noqa: E402


# ------------------------------------------------------------------ echo scoring
@pytest.mark.parametrize(
    ("heard", "reply"),
    [
        ("What time do you open on Sundays?", "What time do you open on Sundays?"),
        ("What time do you open on Sundays?", "You want to know what time we open on Sundays."),
        ("Can you spell your name?", "Can you spell your name, please?"),
        ("I'd like to book a table for two tonight.", "You'd like to book a table for two tonight!"),
    ],
)
def test_repeating_the_caller_is_an_echo(heard: str, reply: str) -> None:
    assert echo_rate.is_echo(reply, heard)
    assert not echo_rate.is_answer(reply, heard)


@pytest.mark.parametrize(
    ("heard", "reply"),
    [
        ("What time do you open on Sundays?", "We open at nine on Sundays and close at five."),
        ("Can you spell your name?", "Sure, it's J, O, E: Joe."),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Yes.", "Great, I've booked it for seven o'clock."),
    ],
)
def test_an_answer_is_not_an_echo(heard: str, reply: str) -> None:
    assert not echo_rate.is_echo(reply, heard)
    assert echo_rate.is_answer(reply, heard)


def test_content_words_ignore_function_words_case_and_plurals() -> None:
    assert echo_rate.content_words("What time do YOU open on Sundays?") == ["time", "open", "sunday"]
    assert echo_rate.overlap("Sure, I can.", "Can you help?") is None  # no content word: no echo
    assert not echo_rate.is_echo("Sure, I can.", "Can you help?")
    assert not echo_rate.is_answer("", "Can you help?")


def test_summary_counts_rates_over_all_turns() -> None:
    turns = [
        echo_rate.Turn(0, 0, "a", "", heard="What is two plus two?", reply="Two plus two is four."),
        echo_rate.Turn(0, 1, "b", "", heard="What is two plus two?", reply="What is two plus two?"),
        echo_rate.Turn(0, 2, "c", "", heard="Why is the sky blue?", reply="Sunlight scatters off air molecules."),
        echo_rate.Turn(0, 3, "d", "", heard="Hello?", reply="", status="failed"),
    ]
    for t in turns:
        t.judge()
    s = echo_rate.summarise(turns)
    assert (s["turns"], s["echoes"], s["answered"]) == (4, 2, 1)  # "Two plus two is four.": 3 of 4 reused
    assert s["echo_rate"] == 0.5 and s["answer_rate"] == 0.25


def test_the_turn_set_is_large_enough() -> None:
    assert len(echo_rate.QUESTIONS) + len(list(echo_rate.SHARED_AUDIO.glob("*.wav"))) >= 30
    assert len(set(echo_rate.QUESTIONS)) == len(echo_rate.QUESTIONS)


# ------------------------------------------------- prompt building vs the template
@pytest.fixture(scope="module")
def default_tokenizer(bundle_dir: Callable[[str], str]):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(bundle_dir("qwen2.5-coder-0.5b-instruct"))


def _template_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:  # type: ignore[no-untyped-def]
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompts_are_token_identical_to_the_default_models_chat_template(default_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Conversation renders message by message and appends generated ids; every prompt
    it builds must still be exactly what apply_chat_template gives for the whole
    conversation, with the shipped default system prompt."""
    system = load_config("configs/default.yaml").session.system_prompt
    conv = Conversation(default_tokenizer, system, budget_tokens=4096, reply_tokens=96)
    messages = [{"role": "system", "content": system}]
    end = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [
        ("What time do you open on Sundays?", "We open at nine.", True),
        ("can you spell your name", "Sure: J, O, E.", False),  # stored as text (cut short)
        ("Yes.", "Great!\nAnything else?", True),
    ]
    for user, reply, as_generated in turns:
        # Speculative (the user turn not yet in the history), then committed.
        assert conv.prompt_ids(user_text=user) == _template_ids(default_tokenizer, [*messages, {"role": "user", "content": user}])
        conv.append("user", user)
        messages.append({"role": "user", "content": user})
        assert conv.prompt_ids() == _template_ids(default_tokenizer, messages)
        ids = [*default_tokenizer.encode(reply, add_special_tokens=False), end] if as_generated else None
        conv.append("assistant", reply, token_ids=ids)
        messages.append({"role": "assistant", "content": reply})
    assert conv.prompt_ids() == _template_ids(default_tokenizer, messages)


# --------------------------------------------------------------- the echo fix
def test_default_config_penalises_repetition_and_the_engine_passes_it() -> None:
    """Qwen2.5-Coder-0.5B echoed the caller in ~20% of replies (issue 12: 15 of 16 short phone
    prompts); prompts alone did not fix it, vLLM's repetition_penalty did (the rate is
    benchmarks/echo_rate.py's figure). Off with tools: a call repeats the tool's name."""
    from voicebot.engines.llm.inprocess import LlmEngine

    cfg = load_config("configs/default.yaml").llm
    assert cfg.repetition_penalty > 1.0
    engine = LlmEngine(cfg, "unused-model-path")
    assert engine._sampling(None, None, None, 0).repetition_penalty == cfg.repetition_penalty
    assert engine._sampling(None, None, None, 0, skip_special_tokens=False).repetition_penalty == 1.0
