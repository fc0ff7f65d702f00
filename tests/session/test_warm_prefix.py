"""llm.warm_prefix: when the session prefills the conversation, and when it must not.

Fakes of our own interfaces only (tests/fakes.py's FakeLlm; LlmEngine with its transport
``_stream`` replaced, so the background lane's real cap and queue are in play). Each
test failed on the first version of the feature (40c13d5) for the reason in its name,
but the last, which pins the rule that a completed reply's own request is counted as
cached (tests/session/test_session.py has the basic cases; tests/engines/test_llm.py the real engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from fakes import (
    LONG_INSTRUCTIONS,
    FakeAsrStream,
    call,
    make_engines,
    until,
    with_session_cfg,
)

from voicebot.config import LlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.engines.llm.inprocess import LlmEngine
from voicebot.session import events as ev
from voicebot.session.clock import REAL_CLOCK


def exchange(session: Any, start: int, turns: int) -> None:
    for i in range(start, start + turns):
        session.add_text("user", f"Question number {i} about the weather in some faraway town?")
        session.add_text("assistant", f"Answer number {i}: it will be sunny and warm there.")


async def reply_that_trims(c: Any) -> None:
    """Client-side turns: a history just under its budget, then a reply that pushes it
    over: the reply's _finish trims (a summary starts) and then prefills. No compaction
    ahead of the budget: written while the reply plays, it would be swapped in at the
    budget instead of the trim."""
    conv = c.session.conversation
    conv.compact_at = 1.0
    exchange(c.session, 0, 3)
    c.session.add_text("user", "And what about tomorrow?")
    conv.budget_tokens = conv.token_count + conv.reply_tokens + 4  # the reply's words go over it
    c.session.create_response()
    await c.wait_for(ev.ResponseDone, timeout=10)


# ------------------------------------------------------------------ 1. summaries
async def test_a_trim_prefills_the_kept_history_first_and_swaps_its_summary_in_once_prefilled(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A reply that trims the history moves every kept token out of the prefix cache. Its
    # summary ran first and no prefill ran beside it, so the next reply prefilled the
    # whole kept history itself; then the summary landed and rewrote the system message
    # at once, and the reply after that did it again. Now the kept history is prefilled
    # first, the summary after it, and the summary is swapped in only once the history
    # with it is prefilled.
    engines = make_engines(tokenizer, clock=REAL_CLOCK, word_delay=0.0)
    engines.llm.summary_delay = 0.3  # type: ignore[attr-defined]
    llm = engines.llm
    order: list[tuple[str, list[int]]] = []
    warm, complete = llm.warm, llm.complete  # type: ignore[attr-defined]

    async def logged_warm(ids: list[int], **kw: Any) -> None:
        await warm(ids, **kw)
        order.append(("warm", list(ids)))

    async def logged_complete(ids: list[int], **kw: Any) -> str:
        order.append(("summary", list(ids)))
        return await complete(ids, **kw)  # type: ignore[no-any-return]

    llm.warm, llm.complete = logged_warm, logged_complete  # type: ignore[attr-defined]
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        conv = c.session.conversation
        swaps: list[bool] = []
        set_summary = conv.set_summary

        def logged_set_summary(text: str) -> None:
            set_summary(text)
            swaps.append(llm.warmed[-1] == conv.history_ids())  # type: ignore[attr-defined]

        conv.set_summary = logged_set_summary  # type: ignore[method-assign]
        await reply_that_trims(c)
        kept = conv.history_ids()
        assert conv.summary is None and conv.messages[0].content != "Question number 0 about the weather in some faraway town?", \
            "trimmed, its summary not in yet"
        await until(c.clock, lambda: conv.summary is not None)
    assert swaps == [True], "the summary swapped in before the history with it was prefilled"
    first_summary = next(i for i, (kind, _) in enumerate(order) if kind == "summary")
    assert ("warm", kept) in order[:first_summary], "the kept history prefilled before the summary ran"


async def ask(c: Any, i: int) -> None:
    c.session.add_text("user", f"Question number {i} about the weather in some faraway town?")
    c.session.create_response()
    await until(c.clock, lambda: len(c.of(ev.ResponseDone)) == i + 1, timeout=30)


def computed_before_each_reply(llm: Any) -> list[int]:
    """Wrap the fake's warm and generate; after the call, tokens of each reply's prompt
    that no earlier prefill or reply had computed: what its TTFT pays for."""
    order: list[tuple[str, list[int]]] = []
    warm, generate = llm.warm, llm.generate

    async def logged_warm(prompt_ids: list[int], **kw: Any) -> None:
        await warm(prompt_ids, **kw)
        order.append(("warm", list(prompt_ids)))

    def logged_generate(prompt_ids: list[int], **kw: Any) -> Any:
        order.append(("reply", list(prompt_ids)))
        return generate(prompt_ids, **kw)

    llm.warm, llm.generate = logged_warm, logged_generate
    left: list[int] = []

    def count() -> list[int]:
        computed: list[list[int]] = []
        for kind, ids in order:
            if kind == "reply":
                known = max((len(_common(ids, c)) for c in computed), default=0)
                left.append(len(ids) - known)
            computed.append(ids)
        return left

    return count  # type: ignore[return-value]


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


async def test_no_reply_prefills_the_history_a_trim_left(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A long call goes over session.history_tokens: the oldest turns are dropped (down to
    # 60 % of it) and summarised into the system message. Dropping them moves every
    # kept token, so nothing of the kept history is cached any more, and the summary
    # blocked its prefill while being written: seconds on the 2-core CPU (64 tokens at
    # ~6 a second). The next reply prefilled the kept history itself: 825 tokens at the
    # default budget, a TTFT of 4.8 s instead of ~0.4 s (benchmarks/ttft_new_tokens.py).
    # Then the summary landed and rewrote the system message: the same again.
    engines = make_engines(tokenizer, summary_delay=3.0, warm_delay=0.3)
    with_session_cfg(engines, history_tokens=800)
    uncached = computed_before_each_reply(engines.llm)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        conv = c.session.conversation
        await c.pause(1.0)  # the call's prefill of its instructions
        for i in range(16):
            await ask(c, i)
            assert conv.token_count + conv._reserved <= conv.budget_tokens, "the budget holds"
            await c.pause(1.0)  # the caller listens, thinks, speaks
        assert conv.summary is not None and not conv.messages[0].content.startswith("Question number 0")
    left = uncached()  # type: ignore[operator]
    # The question and the generation prompt (25 tokens): nothing of the history.
    assert max(left) <= 32, f"prompt tokens left to prefill, reply by reply: {left}"
    assert not c.of(ev.ErrorEvent)


async def test_replies_faster_than_a_summary_still_keep_the_budget(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The compaction waits for its summary; the budget does not: past it the history is
    # trimmed at once, as before, and the turns it drops are summarised all the same.
    engines = make_engines(tokenizer, summary_delay=60.0)
    with_session_cfg(engines, history_tokens=600)
    llm = engines.llm
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        conv = c.session.conversation
        for i in range(12):
            await ask(c, i)
            assert conv.token_count + conv._reserved <= conv.budget_tokens
        assert conv.messages[0].content != "Question number 0 about the weather in some faraway town?"
        assert llm.summaries_cancelled == 1, "the compaction's summary gave way to the trim's"  # type: ignore[attr-defined]
        await until(c.clock, lambda: conv.summary is not None, timeout=120)
        assert "Question number 0" in llm.summary_prompts[-1]  # type: ignore[attr-defined]
    assert not c.of(ev.ErrorEvent)


def until_compacting(c: Any) -> tuple[int, list[Any]]:
    """Client-side exchanges until a compaction is planned: (exchanges, its turns)."""
    i = 0
    while c.session.core.background.compaction is None:
        exchange(c.session, i, 1)
        i += 1
    return i, list(c.session.core.background.compaction.head)


async def test_a_failed_compaction_summary_still_drops_the_turns(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer, summary_delay=0.5)
    engines.llm.summary_fail = True  # type: ignore[attr-defined]
    with_session_cfg(engines, history_tokens=600)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        conv = c.session.conversation
        i, planned = until_compacting(c)
        await until(c.clock, lambda: "failed, dropped" in caplog.text and c.session.core.background.compaction is None, timeout=30)
        kept = set(map(id, conv.messages))
        assert conv.summary is None and not any(id(m) in kept for m in planned), "dropped unsummarised"
        assert not conv.near_budget() and conv.messages[0].content.startswith("Question number")
    assert not c.of(ev.ErrorEvent), "background work is invisible to the caller"


async def test_a_compaction_whose_turns_a_client_deleted_is_planned_again(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A Realtime client's conversation.item.delete while the summary is written: the
    # turns it was written for are no longer the history's first; dropping "the first
    # n" then would drop a turn nobody summarised.
    engines = make_engines(tokenizer, summary_delay=1.0)
    with_session_cfg(engines, history_tokens=600)
    llm = engines.llm
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        conv = c.session.conversation
        i, planned = until_compacting(c)
        assert conv.delete(conv.messages[0].item_id)  # type: ignore[arg-type]
        exchange(c.session, i, 1)  # still near the budget
        await until(c.clock, lambda: conv.summary is not None, timeout=10)
        assert len(llm.summary_prompts) == 2 and conv.summary == "Summary 2.", "written again for the history as it is"  # type: ignore[attr-defined]
        kept = set(map(id, conv.messages))
        assert all(id(m) not in kept for m in planned[1:]), "the planned turns are gone"
    assert not c.of(ev.ErrorEvent)


async def test_no_summary_starts_beside_a_live_reply_and_its_prompt_is_prefilled_in_pieces(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The caller's question takes the history past 80 % of its budget while the reply to
    # it is already being prepared (speculatively, at the pause). A compaction started
    # there sent its summary's prompt (300-500 tokens) beside the live reply: on the CPU
    # default that prompt is prefilled in one engine step of 2-4 s, and the reply's
    # tokens wait for it. It starts once the reply is written, and its prompt goes through
    # warm() first, which prefills in pieces (test_llm_lanes), so a turn that ends during
    # it waits for one piece.
    engines = make_engines(tokenizer, summary_delay=0.5)
    with_session_cfg(engines, history_tokens=800)
    llm = engines.llm
    order: list[tuple[str, list[int], bool]] = []
    warm, complete = llm.warm, llm.complete  # type: ignore[attr-defined]
    sessions: list[Any] = []

    def live() -> bool:  # a reply not yet written (one written and playing is the window)
        return bool(sessions) and sessions[0].core.reply is not None and not sessions[0].core.reply.written

    listened: list[bool] = []  # each summary: started while the caller listened to a written reply

    async def logged_warm(ids: list[int], **kw: Any) -> None:
        order.append(("warm", list(ids), live()))
        await warm(ids, **kw)

    async def logged_complete(ids: list[int], **kw: Any) -> str:
        order.append(("summary", list(ids), live()))
        listened.append(bool(sessions) and sessions[0].core.reply is not None and sessions[0].core.reply.written)
        return await complete(ids, **kw)  # type: ignore[no-any-return]

    llm.warm, llm.complete = logged_warm, logged_complete  # type: ignore[attr-defined]
    async with call(engines, max_tokens=20) as c:
        sessions.append(c.session)
        conv = c.session.conversation
        i = 0
        while conv.token_count + conv._reserved + 64 < conv.budget_tokens * conv.compact_at:
            exchange(c.session, i, 1)
            i += 1
        assert not conv.near_budget() and c.session.core.background.compaction is None
        # A question that takes the history past 80 % of the budget, not past the budget.
        question = "Could you tell me once more what the weather will be like in the mountains tomorrow?"
        while len(tokenizer.encode(question)) < 72:
            question += " And the day after?"
        engines.asr.text = question  # type: ignore[attr-defined]
        await c.speak(1200)
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)
        await until(c.clock, lambda: conv.summary is not None, timeout=10)
    summaries = [(ids, live) for kind, ids, live in order if kind == "summary"]
    assert summaries and not any(live for _, live in summaries), "a summary started beside a live reply"
    assert listened[0], "the compaction's summary waited past the reply's audio"
    warmed = [ids for kind, ids, _ in order if kind == "warm"]
    assert all(ids in warmed for ids, _ in summaries), "a summary's prompt not prefilled first"


class LaneLlm(LlmEngine):
    """The real LlmEngine (lanes, background cap and queue, warm, complete) over a fake
    transport: every request takes ``delay`` seconds and says a few words."""

    def __init__(self, cfg: LlmConfig, tok: Any, delay: float = 0.2) -> None:
        super().__init__(cfg, "unused")
        self._tokenizer = tok
        self._engine = object()  # type: ignore[assignment]  # "started"
        self.delay = delay
        self.requests: list[tuple[Lane, int]] = []  # (lane, max_tokens)

    def _params(self, values: dict[str, Any]) -> dict[str, Any]:
        return values

    async def _stream(self, rid: str, prompt_ids: list[int], lane: Lane, st: GenerationStats,
                      params: Any) -> AsyncGenerator[TextDelta, None]:
        self.requests.append((lane, params["max_tokens"]))
        for word in ["Summary", " of", " it."][: params["max_tokens"]]:
            await asyncio.sleep(self.delay / 3)
            yield TextDelta(word, 1)


async def test_a_prefill_does_not_take_the_background_place_a_summary_needs(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    # llm.background_queue bounds background requests waiting for a slot; prefills now
    # share it (and the background_concurrency slots) with summaries. After a reply that
    # trims, the prefill is spawned after the summary but takes the slot first (the
    # summary tokenises its prompt in a thread), so with no room to wait the summary is
    # refused (BackgroundQueueFull) and the dropped turns are lost. With the default
    # queue of 64 the same happens once 64 prefills of other calls wait.
    engines = make_engines(tokenizer, clock=REAL_CLOCK, word_delay=0.0)
    cfg = engines.cfg.llm.model_copy(update={"background_concurrency": 1, "background_queue": 0})
    engines.cfg = engines.cfg.model_copy(update={"llm": cfg})
    engines.llm = LaneLlm(cfg, tokenizer)
    with_session_cfg(engines, history_tokens=4096)
    async with call(engines, turn_detection=False, max_tokens=20) as c:
        await until(c.clock, lambda: engines.llm.background_running == 0)  # the call's first prefill
        await reply_that_trims(c)
        # The hard trim prefills the kept history first, then summarises the dropped turns and
        # swaps the summary in once it too is prefilled: wait for that swap, not for a quiet
        # moment between the steps (a refused summary never swaps in: the wait then fails).
        await until(c.clock, lambda: c.session.conversation.summary is not None
                    and engines.llm.background_running == 0, timeout=10)
        assert "summary of" not in caplog.text, caplog.text[-600:]
        assert c.session.conversation.summary is not None, "the dropped turns were summarised"


async def test_a_summary_started_while_a_prefill_runs_gets_the_background_place(tokenizer, caplog) -> None:  # type: ignore[no-untyped-def]
    # A client's text that trims the history (add_text: no reply starts, so nothing
    # cancels a prefill) started a summary while the call's prefill still held the one
    # background slot: with no room to wait the summary was refused and the dropped turns
    # lost. The trim now replaces that prefill with the kept history's, and the summary
    # takes the slot after it.
    engines = make_engines(tokenizer, clock=REAL_CLOCK, word_delay=0.0)
    cfg = engines.cfg.llm.model_copy(update={"background_concurrency": 1, "background_queue": 0})
    engines.cfg = engines.cfg.model_copy(update={"llm": cfg})
    engines.llm = LaneLlm(cfg, tokenizer, delay=3.0)
    with_session_cfg(engines, history_tokens=4096)
    async with call(engines, turn_detection=False, max_tokens=20, system_prompt=LONG_INSTRUCTIONS) as c:
        await until(c.clock, lambda: engines.llm.background_running == 1)  # the call's first prefill
        exchange(c.session, 0, 2)
        conv = c.session.conversation
        conv.budget_tokens = conv.token_count + conv._reserved + 4
        c.session.add_text("user", "And what about the weather there the day after tomorrow?")
        assert c.session.core.background.unsummarised, "the text trimmed the history"
        engines.llm.delay = 0.3  # type: ignore[attr-defined]  # the kept history's prefill, then the summary
        await until(c.clock, lambda: conv.summary is not None, timeout=30)
        assert "summary of" not in caplog.text, caplog.text[-600:]
        assert conv.summary is not None, "the dropped turns were summarised"


# ----------------------------------------------------------- 2. bookkeeping
async def test_a_session_update_that_changes_nothing_keeps_the_running_prefill(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Realtime clients send session.update again and again (voice, turn_detection ...);
    # each calls update_settings -> _warm_prefix. _warmed is set only when a prefill
    # ends, so one still running for the same history is cancelled and started again
    # (back of the background queue, its vLLM request aborted).
    engines = make_engines(tokenizer, warm_delay=2.0)
    llm = engines.llm
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await c.pause(0.5)  # the call's prefill is running
        c.session.update_settings(speed=1.0)
        c.session.update_settings(system_prompt=LONG_INSTRUCTIONS)  # the same instructions again
        await until(c.clock, lambda: llm.warmed, timeout=10)  # type: ignore[attr-defined]
        assert llm.warms_cancelled == 0, f"{llm.warms_cancelled} prefill(s) of the same history restarted"  # type: ignore[attr-defined]


async def test_a_prefill_dropped_for_a_turn_that_was_noise_is_started_again(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The call's prefill of long instructions is cancelled when the first speculative
    # reply starts. A speculative reply sends nothing to the LLM before the final
    # transcript; when that is empty (a cough the VAD took for speech), the reply is
    # dropped without _finish and nothing prefills the history again: the first real
    # turn pays for the whole system prompt, the case the feature is for.
    engines = make_engines(tokenizer, warm_delay=1.0)
    engines.asr.text = ""  # type: ignore[attr-defined]
    llm = engines.llm
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await c.speak(300)
        await c.silence(700)
        await c.wait_for(ev.TranscriptFinal)
        assert llm.warms_cancelled == 1, "the speculative reply dropped the prefill"  # type: ignore[attr-defined]
        await c.silence(3000)
        assert not llm.started, "no reply: nothing reached the LLM for the history"  # type: ignore[attr-defined]
        assert llm.warmed == [c.session.conversation.history_ids()], (  # type: ignore[attr-defined]
            "the history was never prefilled after the noise"
        )


async def test_a_reply_cancelled_before_its_first_token_leaves_its_prompt_to_prefill(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # _finish counts the reply's prompt as cached (_warmed = common prefix with
    # prompt_ids + token_ids[:-1]) even when the reply never got its first token (still
    # queued or in prefill when a barge-in / response.cancel / a failure ended it). The
    # history, whose user turn nothing has computed, is then never prefilled.
    engines = make_engines(tokenizer, word_delay=5.0)  # the first token after 5 s
    llm = engines.llm
    async with call(engines, turn_detection=False) as c:
        c.session.add_text("user", "Could you book me a table for two at eight tonight, by the window?")
        c.session.create_response()
        await c.pause(0.5)
        resp = c.session.speaker.live
        assert resp is not None and resp.stats.first_token_at is None and resp.prompt_ids
        assert c.session.cancel_response()
        await c.wait_for(ev.ResponseDone)
        await c.pause(1.0)
        history = c.session.conversation.history_ids()
        assert llm.warmed and llm.warmed[-1] == history, (  # type: ignore[attr-defined]
            f"no prefill of the {len(history)}-token history after a reply that computed nothing"
        )


# ------------------------------------------------------------ 3. block size
async def test_no_prefill_when_no_whole_block_of_the_engine_could_be_cached(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # llm.block_size None means vLLM's platform default: 128 on CPU (configs/test.yaml
    # sets none), 16 on GPU. _warm_prefix assumes 16, so every call with the default
    # 29-token system prompt sends a prefill at its start that caches nothing on CPU,
    # and ~2/16 of completed replies (a 2-token tail: <|im_end|>, newline) send one that
    # caches nothing either. The engine knows its block (vLLM's cache_config.block_size);
    # here the fake says it, as the proposed LlmEngine attribute would.
    engines = make_engines(tokenizer)
    assert engines.cfg.llm.block_size is None
    engines.llm.block_size = 128  # type: ignore[attr-defined]  # proposed: the engine's real KV block
    async with call(engines) as c:
        assert 16 <= len(c.session.conversation.history_ids()) < 128
        await c.pause(1.0)
        assert not engines.llm.warmed, "a prefill that no whole 128-token block of the cache can hold"  # type: ignore[attr-defined]


# ------------------------------------------- 4. coverage (passes on HEAD)
async def test_a_completed_reply_is_prefilled_only_for_whole_blocks_its_request_did_not_compute(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # test_session's prefill tests reply through FakeLlm, whose deltas carry no token
    # ids: resp.token_ids is empty, so _finish's common prefix is the prompt alone and a
    # prefill follows every reply. `_warmed = []` in _finish passes all three of them.
    # Here the reply streams its token ids as vLLM does (<|im_end|> last, no text): the
    # history then ends 2 tokens past what the request computed, inside one 16-token
    # block (the system prompt is padded to make it so): no prefill after the reply.
    # Passes on HEAD; fails with `self._warmed = []` in Session._finish.
    reply = "Sure, the room is free tonight."
    ids = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    user = "Is there a room for two tonight?"

    def lengths(system: str) -> tuple[int, int]:
        from voicebot.session.history import Conversation

        conv = Conversation(tokenizer, system, 4000, 160)
        conv.append("user", user)
        computed = len(conv.prompt_ids()) + len(ids) - 1  # the prompt, the reply but its last token
        conv.append("assistant", reply, token_ids=ids)
        return computed, conv.token_count

    system = next(s for k in range(16) if (s := "Be brief." + " Please." * k)
                  and (lambda c, h: c // 16 == h // 16 and h % 16 >= 2)(*lengths(s)))

    async def with_ids(prompt_ids: list[int], *, stats: GenerationStats | None = None, **_: object):  # type: ignore[no-untyped-def]
        for i, t in enumerate(ids):
            await asyncio.sleep(0)
            if stats is not None and i == 0:
                stats.first_token_at = 1.0
            yield TextDelta("" if i == len(ids) - 1 else tokenizer.decode([t]), 1, (t,))

    engines = make_engines(tokenizer, clock=REAL_CLOCK)
    engines.llm.generate = with_ids  # type: ignore[method-assign]
    async with call(engines, system_prompt=system, turn_detection=False) as c:
        await until(c.clock, lambda: engines.llm.warmed or len(c.session.conversation.history_ids()) < 16)
        c.session.add_text("user", user)
        start = len(engines.llm.warmed)  # type: ignore[attr-defined]
        c.session.create_response()
        done = await c.wait_for(ev.ResponseDone)
        assert done.status == "completed"
        assert c.session.conversation.messages[-1].content == reply
        assert c.session.conversation.token_count == lengths(system)[1], "the history the lengths were chosen for"
        await asyncio.sleep(0.2)
        assert len(engines.llm.warmed) == start, "the reply's request computed all but 2 tokens of one block"  # type: ignore[attr-defined]


# ----------------------------------------------------------- 5. the remote tier
async def test_a_remote_prefill_is_tried_once_and_is_no_failure_of_the_tier() -> None:
    # A reply's request is retried before its first token and a final failure counts
    # towards the tier's dead_reason; a prefill is best effort: one try, never counted
    # (a busy tier held the call's one background slot for every retry, and a failed
    # prefill moved the tier towards "dead").
    from voicebot.engines.llm.remote import RemoteLlmEngine, RemoteLlmError, _Retryable

    cfg = LlmConfig(backend="remote", remote={"url": "http://tier.invalid", "retries": 2, "retry_backoff_s": 0.001})
    llm = RemoteLlmEngine(cfg, "unused")
    llm._engine = object()  # type: ignore[assignment]  # "started"
    tries: list[int] = []

    async def refused(body: dict[str, Any], headers: dict[str, str], st: GenerationStats) -> AsyncGenerator[TextDelta, None]:
        tries.append(body["max_tokens"])
        raise _Retryable("HTTP 503: busy")
        yield TextDelta("", 0)  # a generator, as _try is

    llm._try = refused  # type: ignore[method-assign]
    with pytest.raises(RemoteLlmError):
        await llm.warm(list(range(llm.block_size)))  # a whole block: something to cache
    assert tries == [1] and llm._failures == 0 and llm.requests_total == 0
    with pytest.raises(RemoteLlmError):
        await llm.complete([1, 2, 3], max_tokens=8)
    assert tries == [1, 8, 8, 8] and llm._failures == 1 and llm.requests_total == 1


async def test_no_prefill_when_the_engine_keeps_no_prefix_cache(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # llm.warm_prefix (default on) exists so that "the next turn's prompt finds it in the
    # prefix cache". An engine without one (the in-process engine with
    # llm.enable_prefix_caching off: test_llm_lanes) would throw every prefill away: call
    # starts, session.update of instructions/tools and reply ends prefill nothing then.
    engines = make_engines(tokenizer, reply="Sure, the room is free.")
    engines.llm.keeps_prefills = False  # type: ignore[misc]
    assert engines.cfg.llm.warm_prefix and engines.cfg.llm.background_concurrency > 0
    async with call(engines, system_prompt=LONG_INSTRUCTIONS) as c:
        await c.speak(600)
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)
        await c.silence(500)
        warmed = engines.llm.warmed  # type: ignore[attr-defined]
        assert not warmed, (
            f"{len(warmed)} prefill(s) ({', '.join(str(len(w)) for w in warmed)} tokens) "
            "with no prefix cache to keep them"
        )


# ------------------------------------------------ 5. the caller's words (llm.warm_turn)
QUESTION = "Could you book me a table for two people at eight tonight, by the window, with a view of the sea?"


def hear(c: Any, words: str) -> None:
    """A partial transcript of the session's stream: the words heard so far."""
    stream = c.session.listener.asr
    assert isinstance(stream, FakeAsrStream)
    stream.hear(words)


async def test_the_callers_words_are_prefilled_while_they_speak(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The turn's prompt was prefilled whole after the end of speech, from the history's
    # last whole block on: on the 2-core CPU default ~7 ms a token of the reply's time to
    # first token. Each partial now prefills the words heard so far, and the reply's
    # prompt starts with them.
    engines = make_engines(tokenizer)
    engines.asr.text = QUESTION  # type: ignore[attr-defined]
    llm = engines.llm
    words = QUESTION.split()
    async with call(engines) as c:
        await until(c.clock, lambda: llm.warmed)  # type: ignore[attr-defined]
        history = c.session.conversation.history_ids()
        await c.speak(1000)
        hear(c, " ".join(words[:6]) + ".")  # Whisper ends a partial with a full stop
        await c.speak(1000)
        hear(c, " ".join(words[:17]))
        await c.speak(600)
        turn = llm.warmed[1:]  # type: ignore[attr-defined]
        heard = len(c.session.conversation.user_prefix_ids(" ".join(words[:17])))
        await c.silence(700)
        await c.wait_for(ev.ResponseDone, timeout=10)
    assert turn, "no prefill while the caller spoke"
    prompt = llm.prompts[0]  # type: ignore[attr-defined]
    for warmed in turn:
        assert prompt[: len(warmed)] == warmed, tokenizer.decode(warmed[len(history):])
    # Every whole 16-token block (FakeLlm.block_size) of the words heard last, and the
    # history's last block, which the history alone did not fill.
    assert len(turn[-1]) // 16 == heard // 16 > len(history) // 16 + 1, (len(history), [len(w) for w in turn], heard)


@pytest.mark.parametrize("warm_turn", [True, False])
async def test_no_prefill_of_the_callers_words_once_the_reply_is_prepared_or_when_it_is_off(tokenizer, warm_turn: bool) -> None:  # type: ignore[no-untyped-def]
    # A partial that comes after the pause (the decode that saw the end of speech) finds
    # a speculative reply whose own prompt prefills the same words: a prefill beside it
    # would only compete with it. And llm.warm_turn: false turns the feature off.
    engines = make_engines(tokenizer)
    engines.cfg = engines.cfg.model_copy(update={"llm": engines.cfg.llm.model_copy(update={"warm_turn": warm_turn})})
    engines.asr.text = QUESTION  # type: ignore[attr-defined]
    llm = engines.llm
    async with call(engines) as c:
        await until(c.clock, lambda: llm.warmed)  # type: ignore[attr-defined]
        history = c.session.conversation.history_ids()
        await c.speak(1500)
        if not warm_turn:
            hear(c, QUESTION[:60])
        await c.silence(200)  # paused: the speculative reply is being prepared
        assert c.session.core.reply is not None
        hear(c, QUESTION)
        await c.silence(60)
        turn = [w for w in llm.warmed if len(w) > len(history)]  # type: ignore[attr-defined]
        await c.silence(500)
        await c.wait_for(ev.ResponseDone, timeout=10)
    assert not turn, f"warm_turn={warm_turn}: {len(turn)} prefill(s) of the caller's words"


async def test_a_prefill_of_the_callers_words_is_kept_when_the_history_is_asked_again(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A Realtime client's session.update with nothing new asks for the history's prefill
    # again. A prefill already under way that covers the history and the caller's words
    # after it must be left to run, not restarted as the history alone.
    engines = make_engines(tokenizer, warm_delay=2.0)
    engines.asr.text = QUESTION  # type: ignore[attr-defined]
    llm = engines.llm
    async with call(engines) as c:
        await until(c.clock, lambda: llm.warmed, timeout=10)  # type: ignore[attr-defined]
        await c.speak(1000)
        hear(c, QUESTION)
        await c.speak(500)  # its prefill is running
        c.session.update_settings(speed=1.0)
        await c.speak(2000)
        assert llm.warms_cancelled == 0, "the prefill of the caller's words was restarted"  # type: ignore[attr-defined]
        assert len(llm.warmed[-1]) > len(c.session.conversation.history_ids())  # type: ignore[attr-defined]
