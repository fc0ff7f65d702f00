"""``TurnTimings.asr_final_ms`` is the ASR's time, not the wait for the end of turn.

The stage split (benchmarks/v2v_stages.py over the probe's ``turn.timings``)
gave the ASR final on the CPU default a p95 of ~1380 ms against a p50 of ~300 ms.
Traced (``TRACE=1 benchmarks/voice_loop.sh``, then ``benchmarks/trace_serve.py --report``),
every one of those ~1380 ms values was a turn that Smart Turn held for its
1.5 s cap (an unfinished sentence): the speculative final had been ready for over a
second, and the reply's LLM request had gone out with it, but ``asr_done`` was stamped
only when the committed turn read the transcript, after END. The stage then reported
the endpointing wait as ASR time, in the event and in the Prometheus histogram.

Fakes of our own interfaces (tests/fakes.py), virtual clock.
"""

from __future__ import annotations

from fakes import call, make_engines

from voicebot.session import events as ev


async def test_a_late_end_of_turn_is_not_counted_as_asr_time(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engines = make_engines(tokenizer)
    # The turn ends 1.5 s into the silence (as Smart Turn's cap does); the speculative
    # final (PAUSE at 160 ms, the fake decode 30 ms) is ready long before.
    engines.cfg = engines.cfg.model_copy(update={"vad": engines.cfg.vad.model_copy(update={"min_silence_ms": 1500})})
    async with call(engines) as c:
        await c.speak(600)
        await c.silence(2000)
        await c.wait_for(ev.ResponseDone, timeout=10)
        timings = c.of(ev.TurnTimings)[0]
        assert timings.speculative is True
        assert timings.endpointing_ms is not None and timings.endpointing_ms >= 1400, timings
        assert timings.asr_final_ms is not None
        assert 25 <= timings.asr_final_ms <= 100, f"the fake decode takes 30 ms: {timings}"


async def test_a_final_slower_than_the_end_of_turn_is_counted_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The other side: a final that is still decoding at END (the common case on 2 cores)
    is counted to the moment the transcript is ready."""
    engines = make_engines(tokenizer)
    clock = engines.asr.clock  # type: ignore[attr-defined]
    stream_finalize = None

    async with call(engines) as c:
        stream = engines.asr.streams[-1]  # type: ignore[attr-defined]
        stream_finalize = stream.finalize

        async def slow_finalize(covering_s: float | None = None):  # type: ignore[no-untyped-def]
            await clock.sleep(0.6)  # 0.6 s more than the fake's 30 ms: past END (480 ms of silence)
            return await stream_finalize(covering_s)

        stream.finalize = slow_finalize
        await c.speak(600)
        await c.silence(1500)
        await c.wait_for(ev.ResponseDone, timeout=10)
        timings = c.of(ev.TurnTimings)[0]
        assert timings.asr_final_ms is not None
        assert 600 <= timings.asr_final_ms <= 700, timings
