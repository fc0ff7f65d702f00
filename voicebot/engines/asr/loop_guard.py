"""A :class:`~.jobs.Decoder` around any other that never hands out a transcript that loops.

Every decode of every backend passes here: :class:`~.engine.AsrEngine` wraps its decoder
in a :class:`LoopGuard`, and the shared ASR service decodes through its engine's decoder.
Each backend also bounds the tokens a decode may emit by the audio's length
(:func:`token_budget`), so a loop ends early instead of filling Whisper's 448 positions.

When a transcript loops (:func:`.repetition.loop_reason`):

- a final is decoded again at each of ``asr.loop_fallback_temperatures`` in turn (Whisper's
  own temperature fallback, which sampling takes out of the loop), and the first that
  does not loop is kept;
- a partial is not decoded again (it is a preview, the next one decodes anew, and its
  cost would come before everyone's finals);
- what still loops is cut after the loop's first copy (:func:`.repetition.cut_loop`).

A backend that cannot sample (the shared service's frontend, whose service does the
fallback itself) only has its transcripts cut.
"""

from __future__ import annotations

import logging

from voicebot.audio import ASR_RATE
from voicebot.engines.asr.agreement import continuation_after, join_text, split_words
from voicebot.engines.asr.jobs import DecodeAbandoned, DecodeJob, Decoder, Priority
from voicebot.engines.asr.repetition import cut_loop, loop_reason

__all__ = ["WHISPER_MAX_TARGET_TOKENS", "LoopGuard", "token_budget"]

log = logging.getLogger(__name__)

# Whisper's decoder has 448 positions (max_target_positions) for prompt + text.
WHISPER_MAX_TARGET_TOKENS = 448
_TOKENS_SLACK = 16  # a short clip may still carry a few words and their punctuation


def token_budget(audio_s: float, prompt_tokens: int, tokens_per_s: float) -> int:
    """Most tokens a decode of ``audio_s`` seconds may emit after ``prompt_tokens``: the
    audio's length times ``tokens_per_s`` (and a little slack), within Whisper's window."""
    room = WHISPER_MAX_TARGET_TOKENS - prompt_tokens - 1
    return max(1, min(room, int(audio_s * tokens_per_s) + _TOKENS_SLACK))


class LoopGuard:
    """A :class:`~.jobs.Decoder`: ``inner``'s decodes, none of them a loop."""

    def __init__(self, inner: Decoder, fallback_temperatures: tuple[float, ...]) -> None:
        self.inner = inner
        self.fallback_temperatures = fallback_temperatures
        self.name = inner.name
        self.samples = inner.samples
        self.loops = 0  # decodes that looped
        self.cut = 0  # of those, decodes handed out cut (no fallback got out of the loop)

    @property
    def slots(self) -> int:
        return self.inner.slots

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def abandon(self, job: DecodeJob) -> None:
        self.inner.abandon(job)

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        assert job.audio is not None
        audio_s = job.audio.size / ASR_RATE
        text, decode_s = await self.inner.decode(job)
        # The loop may start inside the forced prefix: the decoder reading its audio again.
        forced = len(split_words(job.prefix))
        reason = loop_reason(join_text(job.prefix, text), audio_s, forced)
        if reason is None:
            return text, decode_s
        self.loops += 1
        first = text
        if job.priority is Priority.FINAL and self.inner.samples:
            for temperature in self.fallback_temperatures:
                if job.stale:
                    raise DecodeAbandoned
                log.info("ASR decode looped (%s): decoding again at temperature %.1f", reason, temperature)
                job.temperature = temperature
                try:
                    text, more_s = await self.inner.decode(job)
                finally:
                    job.temperature = 0.0
                decode_s += more_s
                reason = loop_reason(join_text(job.prefix, text), audio_s, forced)
                if reason is None:
                    return text, decode_s
        self.cut += 1
        # The forced prefix's words are confirmed and stay; what follows them is cut.
        cut = continuation_after(cut_loop(join_text(job.prefix, first), audio_s, forced), job.prefix)
        log.info("ASR decode looped (%s): cut to %d words", reason, len(split_words(cut)))
        return cut, decode_s
