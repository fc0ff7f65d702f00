"""The LLM lanes without an engine: the background cap (admission order, cancellation),
prefills in pieces, and the start-up sampling warm-up."""

from __future__ import annotations

import asyncio
import threading

import pytest

from voicebot.config import LlmConfig
from voicebot.engines.contracts import Lane
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.engines.llm.lanes import BackgroundQueueFull
from voicebot.errors import EngineError


def engine(limit: int) -> LlmEngine:
    return LlmEngine(LlmConfig(background_concurrency=limit), model_path="unused")


async def test_freed_slots_go_to_waiters_in_arrival_order() -> None:
    e = engine(1)
    order: list[int] = []

    async def worker(i: int, rounds: int) -> None:
        for _ in range(rounds):
            await e._enter_background()
            order.append(i)
            await asyncio.sleep(0)
            e._leave_background()  # and straight back in line: must not jump the queue

    await asyncio.gather(*(worker(i, 3) for i in range(4)))
    assert order == [0, 1, 2, 3] * 3
    assert e.background_running == 0 and e.background_waiting == 0


async def test_cancelled_waiter_leaves_the_queue_and_no_slot_leaks() -> None:
    e = engine(1)
    await e._enter_background()
    waiter = asyncio.create_task(e._enter_background())
    await asyncio.sleep(0)
    assert e.background_waiting == 1
    waiter.cancel()
    await asyncio.wait([waiter])
    assert e.background_waiting == 0
    e._leave_background()
    assert e.background_running == 0


async def test_raising_the_limit_admits_waiters() -> None:
    e = engine(1)
    await e._enter_background()
    waiters = [asyncio.create_task(e._enter_background()) for _ in range(3)]
    await asyncio.sleep(0)
    e.background_limit = 3
    await asyncio.sleep(0)
    assert sum(w.done() for w in waiters) == 2 and e.background_running == 3
    for w in waiters:
        w.cancel()
    await asyncio.wait(waiters)


async def test_waiting_background_requests_are_bounded() -> None:
    e = LlmEngine(LlmConfig(background_concurrency=1, background_queue=2), model_path="unused")
    await e._enter_background()
    waiters = [asyncio.create_task(e._enter_background()) for _ in range(2)]
    await asyncio.sleep(0)
    assert e.background_waiting == 2
    with pytest.raises(BackgroundQueueFull) as info:
        await e._enter_background()  # refused at once, not queued
    assert info.value.code == "background_queue_full"
    assert e.background_waiting == 2 and e.background_running == 1
    e._leave_background()  # the first waiter gets the slot; there is room to wait again
    await asyncio.sleep(0)
    late = asyncio.create_task(e._enter_background())
    await asyncio.sleep(0)
    assert e.background_waiting == 2
    for w in [*waiters, late]:
        w.cancel()
    await asyncio.wait([*waiters, late])


async def test_an_engine_not_started_says_why() -> None:
    assert engine(1).dead_reason == "not started"


def test_background_prefills_are_kept_only_with_a_prefix_cache() -> None:
    # The session prefills in the background only when this says the cache keeps it.
    assert LlmEngine(LlmConfig(), model_path="unused").keeps_prefills
    assert not LlmEngine(LlmConfig(enable_prefix_caching=False), model_path="unused").keeps_prefills


async def test_a_cancelled_start_builds_nothing() -> None:
    e = engine(1)
    cancel = threading.Event()
    cancel.set()  # shutdown began before the build thread got going
    with pytest.raises(asyncio.CancelledError):
        await e.start(cancel)
    assert e.dead_reason == "not started" and e._engine is None


class PrefillLog(LlmEngine):
    """LlmEngine over a fake transport that records each request's prompt length; each
    takes ``step_s`` (an engine step that cannot be interrupted)."""

    def __init__(self, piece: int, step_s: float = 0.0) -> None:
        super().__init__(LlmConfig(block_size=32, warm_piece_tokens=piece), model_path="unused")
        self._engine = object()  # type: ignore[assignment]  # "started"
        self.step_s = step_s
        self.prompts: list[int] = []

    def _params(self, values: dict[str, object]) -> dict[str, object]:
        return values

    async def _stream(self, rid, prompt_ids, lane, st, params):  # type: ignore[no-untyped-def]
        from voicebot.engines.contracts import TextDelta

        self.prompts.append(len(prompt_ids))
        await asyncio.sleep(self.step_s)
        yield TextDelta("x", 1)


@pytest.mark.parametrize(("piece", "expected"), [(256, [256, 512, 700]), (300, [288, 576, 700]), (0, [700])])
async def test_a_long_prefill_goes_in_pieces_of_whole_blocks(piece: int, expected: list[int]) -> None:
    # A live turn arriving during a background prefill waits for the engine step in
    # flight: the 825 tokens of a compacted history were one step of 4.8 s on the 2-core
    # CPU default. Each piece starts with the last one's blocks, so the cache carries
    # them over and the whole is computed once.
    e = PrefillLog(piece)
    await e.warm(list(range(700)))
    assert e.prompts == expected
    await e.warm(list(range(200)))
    assert e.prompts[len(expected):] == [200], "a short one is one request"


async def test_a_prefill_sends_no_piece_that_would_cache_nothing() -> None:
    # The prefix cache keeps whole blocks only: a last piece that completes no block past
    # the one before it (520 tokens after a piece ending at 512, in blocks of 32) was one
    # more request, and at 256 callers every request counts (the LLM server's one API
    # process parses each: docs/gpu-results.md).
    e = PrefillLog(256)
    done: list[int] = []
    await e.warm(list(range(520)), on_piece=done.append)
    assert e.prompts == [256, 512] and done == [256, 512]
    await e.warm(list(range(20)))
    assert e.prompts[2:] == [], "less than a block: nothing to cache, no request"
    await e.warm(list(range(1200)), cached=1184)
    assert e.prompts[2:] == [], "its whole blocks are cached already"


async def test_cancelling_a_prefill_stops_it_between_pieces() -> None:
    e = PrefillLog(256, step_s=0.05)
    task = asyncio.create_task(e.warm(list(range(1000))))
    while not e.prompts:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    assert e.prompts == [256], "no piece after the cancellation"
    assert e.background_running == 0, "its slot is free"


async def test_a_prefill_starts_its_pieces_after_what_is_cached_and_says_each_one() -> None:
    # A request over cached blocks still recomputes its last block and samples a token
    # (~0.2 s on the 2-core CPU): the history after a reply, 1,200 tokens of which the
    # last 48 are new, went as 9 such requests before the one that computed anything.
    e = PrefillLog(128)
    done: list[int] = []
    await e.warm(list(range(1200)), cached=1170, on_piece=done.append)
    assert e.prompts == [1200] and done == [1200]
    await e.warm(list(range(1200)), cached=900, on_piece=done.append)
    assert e.prompts[1:] == [1024, 1152, 1200] and done[1:] == [1024, 1152, 1200]


class SamplingLog(LlmEngine):
    """LlmEngine over a fake transport that streams each request's ``max_tokens`` tokens, one
    per step, and records what each asked for and how many ran at once."""

    def __init__(self, rows: int, tool_grammar: str = "off") -> None:
        cfg = LlmConfig(warm_sampling_rows=rows, temperature=0.6, top_p=0.9, tool_grammar=tool_grammar)
        super().__init__(cfg, model_path="unused")
        self._engine = object()  # type: ignore[assignment]  # "started"
        self.asked: list[dict[str, object]] = []
        self.in_flight = 0
        self.sizes: list[int] = []  # requests in flight at each step
        self.greedy = 0  # greedy requests (temperature 0) in flight
        self.mixed_sizes: list[int] = []  # requests in flight at each step one of them was greedy
        self.fail_at: int | None = None  # a request of this many tokens fails

    def _params(self, values: dict[str, object]) -> dict[str, object]:
        return values

    async def _stream(self, rid, prompt_ids, lane, st, params):  # type: ignore[no-untyped-def]
        from voicebot.engines.contracts import TextDelta

        self.asked.append({"lane": lane, **params})
        self.in_flight += 1
        greedy = params.get("temperature") == 0.0
        self.greedy += greedy
        try:
            if params["max_tokens"] == self.fail_at:
                await asyncio.sleep(0)
                raise EngineError("the tier refused it")
            for _ in range(params["max_tokens"] if not params.get("structured_outputs") else 1):
                await asyncio.sleep(0)
                self.sizes.append(self.in_flight)
                if self.greedy:
                    self.mixed_sizes.append(self.in_flight)
                yield TextDelta("x", 1)
        finally:
            self.in_flight -= 1
            self.greedy -= greedy


async def test_start_up_samples_replies_at_every_batch_size_before_the_first_caller() -> None:
    # vLLM compiles its batched top-p/top-k sampler (Triton) at the first step that needs
    # each shape class (>= 8 rows, a multiple of 16). Under a burst of 256 callers that
    # first step held every request 2.6 s, twice (docs/gpu-results.md). At start-up the
    # engine now runs replies sampled as live ones are, as many at once as configured and
    # one fewer each step, so every batch size up to it is sampled once.
    e = SamplingLog(rows=32)
    await e._warm_sampling()
    sampled = [a for a in e.asked if a["temperature"] != 0.0]
    assert len(sampled) == 2 * 32, "twice: alone, then beside a greedy reply (test below)"
    lengths = sorted(a["max_tokens"] for a in sampled[:32])
    assert len(set(lengths)) == 32, "each stops a step after the one before"
    assert all(a["min_tokens"] == a["max_tokens"] for a in e.asked), "none may stop early at an end of text"
    assert all(a["temperature"] == 0.6 and a["top_p"] == 0.9 for a in sampled), "sampled as a reply is"
    assert {a["lane"] for a in e.asked} == {Lane.INTERACTIVE}
    assert set(range(1, 33)) <= set(e.sizes), "every batch size from 32 down to 1"
    assert e.requests_total == 0, "not replies: the totals (cache hit ratio) leave them out"
    assert e.sampling_warmed == 32


async def test_start_up_also_samples_every_batch_size_beside_a_greedy_reply() -> None:
    # vLLM 0.26 on an H200 samples a batch whose rows all sample with FlashInfer, and a batch
    # with any greedy row in it (our prefix warm-ups and background tasks run at temperature
    # 0) with its own Triton top-p kernel. A live burst has both kinds of batch. A warm-up of
    # sampled rows alone compiled only the first: the first burst still held every request
    # for the Triton compile (docs/gpu-results.md, 2026-11-30). So the sampled replies run a
    # second time beside one greedy reply that outlasts them all.
    e = SamplingLog(rows=32)
    await e._warm_sampling()
    greedy = [a for a in e.asked if a["temperature"] == 0.0]
    assert len(greedy) == 1
    assert greedy[0]["max_tokens"] > max(a["max_tokens"] for a in e.asked if a is not greedy[0])
    assert greedy[0]["min_tokens"] == greedy[0]["max_tokens"]
    assert set(range(1, 34)) <= set(e.mixed_sizes), "every batch size from 33 down to 1 with the greedy row in it"
    assert e.greedy == 0 and e.in_flight == 0
    assert e.sampling_warmed == 32 and e.sampling_warmed_tokens == 2 * sum(range(4, 36)) + 36


async def test_no_sampling_warm_up_unless_configured() -> None:
    e = SamplingLog(rows=0)
    await e._warm_sampling()
    assert e.asked == [] and e.sampling_warmed == 0


async def test_a_failing_warm_reply_fails_the_start_with_its_own_error_and_aborts_the_others() -> None:
    e = SamplingLog(rows=8)
    e.fail_at = 6
    with pytest.raises(EngineError, match="the tier refused it"):
        await e._warm_sampling()
    assert e.in_flight == 0, "the other warm replies were aborted, none left running"
    assert e.sampling_warmed == 0


async def test_with_tool_grammars_the_start_up_also_runs_one_constrained_reply() -> None:
    # vLLM on a GPU applies a structured output's grammar with a Triton kernel compiled at
    # the first constrained request (vllm/v1/worker/gpu/structured_outputs.py in 0.26): the
    # first tool call on a fresh server would hold every request in flight as the sampler
    # did. One constrained reply at start-up compiles it (its arguments are the vocabulary's
    # sizes: one specialisation). No min_tokens: a grammar that is done may only end.
    e = SamplingLog(rows=8, tool_grammar="always")
    await e._warm_sampling()
    constrained = [a for a in e.asked if a.get("structured_outputs") is not None]
    assert len(constrained) == 1 and len(e.asked) == 2 * 8 + 1 + 1
    assert not constrained[0]["min_tokens"]
    assert e.grammar_warmed
    plain = SamplingLog(rows=8)  # tool_grammar off: no constrained request is ever sent
    await plain._warm_sampling()
    assert all(a.get("structured_outputs") is None for a in plain.asked) and not plain.grammar_warmed
