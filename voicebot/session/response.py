"""One spoken reply: LLM tokens -> clauses -> TTS audio -> the playout buffer.

The three stages overlap: the first clause goes to TTS while the LLM is still
generating, and its audio is playable while later clauses are being synthesised. A
reply can be *gated*: prepared speculatively while the user pauses, and released
only when the turn is confirmed over (or cancelled if the user goes on). A clause goes
to TTS without its ordered-list markers (clauses.ListMarkers: "1. Mix the flour." is
said "Mix the flour."); the reply's text, deltas and history keep what the model wrote.

Cancelling :meth:`Response.run` aborts the vLLM request (LlmEngine.generate) and the
queued TTS work (TtsEngine.synthesize) and re-raises.

Tool calls: every delta goes through vLLM's tool parser (voicebot/tools/parser.py)
before the clause chunker, so only text outside ``<tool_call>`` markup is ever spoken;
a call streams to the client as ToolCallStarted / ToolCallArgumentsDelta events and
ends as a ToolCallDone with the parser's canonical arguments. The reply's whole output
(markup included) and its token ids are kept for the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicebot.audio import resample
from voicebot.engines.contracts import GenerationStats, Lane
from voicebot.engines.contracts import Llm as LlmEngine
from voicebot.engines.contracts import Tts as TtsEngine
from voicebot.session.clauses import ClauseChunker, ListMarkers, sentence_end, up_to_sentence_end
from voicebot.session.clock import REAL_CLOCK, Clock
from voicebot.session.events import ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from voicebot.session.playout import Playout
from voicebot.tools.grammar import NO_CONSTRAINT, Constraint
from voicebot.tools.parser import ArgumentsDelta, CallStarted, Speech, ToolCallStream
from voicebot.tools.spec import ToolCall, ToolChoice, ToolSpec, new_call_id

log = logging.getLogger(__name__)

# Speech per word at speed 1, to count a clause's audio before it is synthesised: 0.34 s
# p50 (0.29-0.41 p10-p90) over the default Piper voice's replies (docs/benchmarks.md).
SECONDS_PER_WORD = 0.34
# A sentence still to write, for the writing pace: ~10 words.
SENTENCE_TOKENS = 14


@dataclass
class ResponseTimes:
    """Marks of one reply on the session's clock."""

    requested: float = field(default_factory=time.monotonic)
    first_clause: float | None = None
    first_audio: float | None = None  # first synthesised audio of the first clause
    first_clause_synth_start: float | None = None
    done_generating: float | None = None
    first_sent: float | None = None  # its first audio frame went to the client


@dataclass(eq=False)
class _ClauseAudio:
    """A clause in synthesis ahead of its turn in the playout."""

    written: str  # as the model wrote it: what the playout's spans keep
    spoken: str  # as TTS says it (clauses.ListMarkers)
    words: int
    ahead_s: float  # the reply's audio the caller hears before this clause's, as estimated
    chunks: asyncio.Queue[np.ndarray | None] = field(default_factory=asyncio.Queue)  # one clause's audio
    error: Exception | None = None


@dataclass(frozen=True)
class ResponseOptions:
    """Per-response overrides (Realtime ``response.create``); None: the session's own."""

    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    max_tokens: int | None = None
    metadata: dict[str, Any] | None = None


Delta = str | ToolCallStarted | ToolCallArgumentsDelta | ToolCallDone
# A clause for TTS: (as written, as spoken). The playout's spans, and so the words a caller
# who cut the reply short heard, keep it as written; TTS gets it without list markers.
Clause = tuple[str, str]


class Response:
    def __init__(
        self,
        response_id: str,
        item_id: str,
        prompt_ids: list[int],
        llm: LlmEngine,
        tts: TtsEngine,
        *,
        voice: str | None,
        speed: float | None,
        max_tokens: int,
        first_clause_words: int,
        max_clause_words: int,
        gated: bool,
        clause_low_water_ms: int = 0,
        tts_lookahead: int = 1,
        output_rate: int | None = None,
        clock: Clock = REAL_CLOCK,
        on_audio: Callable[[], None] | None = None,
        tool_stream: ToolCallStream | None = None,
        constraint: Constraint = NO_CONSTRAINT,
        options: ResponseOptions | None = None,
        tool_round: int = 0,
        wind_down_tokens: int = 0,
    ) -> None:
        self.id = response_id
        self.item_id = item_id
        self.prompt_ids = prompt_ids
        self._llm = llm
        self._tts = tts
        self._voice = voice
        self._speed = speed
        self._max_tokens = max_tokens
        # From this many tokens on, the reply stops at its next sentence end. A budget
        # no larger than the wind-down has none: it would stop at the first sentence end
        # (a limit of a few tokens is a cap, not a reply length to wind down to).
        start = max_tokens - wind_down_tokens
        self._wind_down_at = start if wind_down_tokens and start > 0 else None
        self.cut_at_limit = False  # stopped by max_tokens: its unfinished sentence was not spoken
        self._chunker = ClauseChunker(first_clause_words, max_clause_words, running_low=self._running_low)
        self._lists = ListMarkers()
        self._low_water_s = clause_low_water_ms / 1000
        self._lookahead = tts_lookahead
        self._words_to_speak = 0  # of clauses handed to TTS whose audio is not in the playout yet
        self._writing_since: float | None = None  # the first token, on the session's clock
        self._tokens_written = 0
        # Each synthesised sentence is resampled once, whole, to the rate the transport
        # sends: a streaming resampler here would release audio in uneven blocks and
        # the pacer could not send exact 20 ms frames.
        self._tts_rate = tts.sample_rate
        self.playout = Playout(output_rate or tts.sample_rate)
        self.stats = GenerationStats(request_id=response_id, lane=Lane.INTERACTIVE)
        self._clock = clock
        self.times = ResponseTimes(requested=clock.monotonic())
        # Called when audio lands in the playout: the pacer waits for it, not polls.
        self._on_audio = on_audio
        self.released = asyncio.Event()
        if not gated:
            self.released.set()
        self.text_parts: list[str] = []  # spoken text (outside tool-call markup)
        self.raw_parts: list[str] = []  # everything generated, as the history stores it
        self.token_ids: list[int] = []  # as generated: the history stores a finished reply so
        # Text deltas and tool-call events for the client; read by the session's forwarder
        # after release. Bounded by max_tokens (at most a few entries per LLM delta).
        self.deltas: asyncio.Queue[Delta | None] = asyncio.Queue()
        self.options = options or ResponseOptions()
        self.tool_round = tool_round  # server-tool rounds before this reply in its turn
        self.tool_calls: list[ToolCall] = []
        self.prompt_tools: list[dict[str, Any]] | None = None  # this reply's own tools (an override)
        self.tool_choice: ToolChoice | None = None  # as planned; calls made under "none" are never run
        self._tools = tool_stream
        self._constraint = constraint
        self._calls: dict[int, tuple[str, str, str]] = {}  # parser index -> call_id, item_id, name
        self.audio_started = False  # the client was told its audio started (it may be playing it)
        self.paused_at: float | None = None  # speech over it paused its audio (the call's clock)
        self.generated = False  # LLM and TTS finished
        self.drained = asyncio.Event()  # generated, and the pacer sent the last sample
        self.finished = asyncio.Event()  # generated (LLM and TTS over)
        # The client was told of it (ResponseStarted). A reply that speech may still
        # withdraw unheard is shown with its first audio (or its end, with none).
        self.shown = asyncio.Event()
        self.show_with_audio = False
        self._room = asyncio.Event()
        self._room.set()

    @property
    def full_text(self) -> str:
        """What the reply says (tool-call markup excluded)."""
        return "".join(self.text_parts).strip()

    @property
    def raw_text(self) -> str:
        """Everything the model generated, markup included."""
        return "".join(self.raw_parts)

    def release(self) -> None:
        self.released.set()

    def notify_drained(self) -> None:
        """The pacer took audio: a waiting synthesiser may go on."""
        if self.playout.has_room():
            self._room.set()

    async def run(self) -> None:
        clauses: asyncio.Queue[Clause | None] = asyncio.Queue(maxsize=8)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._generate(clauses))
                tg.create_task(self._synthesize(clauses))
        finally:
            self.generated = True
            self.finished.set()
            self.deltas.put_nowait(None)

    async def _generate(self, clauses: asyncio.Queue[Clause | None]) -> None:
        async with contextlib.aclosing(
            self._llm.generate(
                self.prompt_ids, max_tokens=self._max_tokens, stats=self.stats, **self._constraint.sampling_kwargs()
            )
        ) as stream:
            async for delta in stream:
                if self._writing_since is None:
                    self._writing_since = self._clock.monotonic()
                self._tokens_written += delta.token_count
                self.raw_parts.append(delta.text)
                self.token_ids.extend(delta.token_ids)
                pieces = self._tools.feed(delta.text, delta.token_ids) if self._tools else [Speech(delta.text)]
                for piece in pieces:
                    if isinstance(piece, Speech) and self._winding_down():
                        piece, done = self._to_sentence_end(piece)
                        await self._piece(piece, clauses)
                        if done:
                            self.stats.finish_reason = "stop"
                            break
                    else:
                        await self._piece(piece, clauses)
                else:
                    continue
                break  # a sentence ended past the wind-down: closing the stream aborts the request
        if self._tools is not None:
            self._finish_calls(self._tools)
        if self._hit_limit():
            self._drop_unfinished_sentence()
        if (rest := self._chunker.flush()) is not None:
            await self._put_clause(clauses, rest)
        self.times.done_generating = self._clock.monotonic()
        await clauses.put(None)

    def _winding_down(self) -> bool:
        return self._wind_down_at is not None and self._tokens_written >= self._wind_down_at

    def _to_sentence_end(self, piece: Speech) -> tuple[Speech, bool]:
        """The part of ``piece`` up to a sentence end it completes, and whether it does."""
        text, done = up_to_sentence_end("".join(self.text_parts), piece.text)
        return Speech(text), done

    def _hit_limit(self) -> bool:
        reason = self.stats.finish_reason
        return reason == "length" if reason is not None else self._tokens_written >= self._max_tokens

    def _drop_unfinished_sentence(self) -> None:
        """The reply ran into max_tokens mid-sentence: what the chunker still holds after
        the last sentence end is never spoken, and the reply's text ends there too."""
        text = "".join(self.text_parts)
        end = sentence_end(text)
        if end == len(text.rstrip()):
            return
        if end == 0:
            # No sentence to end on: dropping the rest would leave a clause already
            # spoken (or nothing) as the whole reply; the fragment says more.
            return
        held = self._chunker.drop_after(sentence_end)
        if held:
            self.cut_at_limit = True
            self.text_parts = [text[: len(text) - held]]

    async def _piece(self, piece: Speech | CallStarted | ArgumentsDelta, clauses: asyncio.Queue[Clause | None]) -> None:
        match piece:
            case Speech(text=text):
                self.text_parts.append(text)
                self.deltas.put_nowait(text)
                self._lists.feed(text)
                for clause in self._chunker.push(text):
                    await self._put_clause(clauses, clause)
            case CallStarted(index=index, name=name):
                self._start_call(index, name)
            case ArgumentsDelta(index=index, delta=delta) if index in self._calls:
                call_id, item_id, _ = self._calls[index]
                self.deltas.put_nowait(ToolCallArgumentsDelta(self.id, item_id, call_id, delta))

    def _start_call(self, index: int, name: str) -> tuple[str, str, str]:
        ids = self._calls[index] = (new_call_id(), f"{self.item_id}_fc{index}", name)
        self.deltas.put_nowait(ToolCallStarted(self.id, ids[1], ids[0], name))
        return ids

    def _finish_calls(self, tools: ToolCallStream) -> None:
        for index, parsed in enumerate(tools.finish()):
            call_id, item_id, _ = self._calls.get(index) or self._start_call(index, parsed.name)
            call = ToolCall(call_id, item_id, parsed.name, parsed.arguments, parsed.valid)
            self.tool_calls.append(call)
            self.deltas.put_nowait(ToolCallDone(self.id, call))

    async def _put_clause(self, clauses: asyncio.Queue[Clause | None], clause: str) -> None:
        spoken = self._lists.spoken(clause)
        if not spoken:
            return  # only a list's marker: nothing to say
        if self.times.first_clause is None:
            self.times.first_clause = self._clock.monotonic()
        self._words_to_speak += len(spoken.split())
        await clauses.put((clause, spoken))

    def _audio_ahead_s(self) -> float:
        """Reply audio the caller has still to hear: what the playout holds, and the
        clauses being synthesised at the voice's pace (their audio is not there yet)."""
        queued = self.playout.queued_samples / self.playout.sample_rate
        return queued + self._words_to_speak * SECONDS_PER_WORD / (self._speed or 1.0)

    def _running_low(self) -> bool:
        """Less audio ahead than ``clause_low_water_ms``, and the model writes too slowly
        to finish a sentence before it runs out: a later clause should be cut now. A fast
        model (a GPU's) finishes the sentence in time: its clauses stay whole."""
        ahead = self._audio_ahead_s()
        if ahead >= self._low_water_s:
            return False
        if self._writing_since is None or self._tokens_written < 2:
            return True
        rate = (self._tokens_written - 1) / max(self._clock.monotonic() - self._writing_since, 1e-3)
        return SENTENCE_TOKENS / rate > ahead

    async def _synthesize(self, clauses: asyncio.Queue[Clause | None]) -> None:
        """Each clause to TTS as soon as it is written, up to ``tts_lookahead`` beyond the
        one whose audio goes into the playout now; their audio goes in in clause order.

        A reply that opens with "Sure," has ~0.4 s of audio to cover the next clause's
        synthesis: sent only once "Sure," is synthesised, that clause waits in a shared
        engine's queue behind other calls' work and the caller hears a gap. Sent at once,
        with the seconds of audio ahead of it, it is ready in time and yields to the calls
        whose callers are waiting in silence (a first clause has none ahead). With no
        look-ahead, one slot: a clause is sent once the one before it is in the playout."""
        slots = asyncio.Semaphore(self._lookahead + 1)  # clauses in synthesis, the one playing included
        order: asyncio.Queue[_ClauseAudio | None] = asyncio.Queue()  # bounded by the slots
        unplayed_words = 0  # of clauses in synthesis, not yet in the playout

        def played(job: _ClauseAudio) -> None:
            nonlocal unplayed_words
            unplayed_words -= job.words
            self._words_to_speak -= job.words
            slots.release()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._play_in_order(order, played))
            while (clause := await clauses.get()) is not None:
                written, spoken = clause
                await slots.acquire()
                if self.times.first_clause_synth_start is None:
                    self.times.first_clause_synth_start = self._clock.monotonic()
                ahead = self.playout.queued_samples / self.playout.sample_rate
                ahead += unplayed_words * SECONDS_PER_WORD / (self._speed or 1.0)
                job = _ClauseAudio(written, spoken, len(spoken.split()), ahead)
                unplayed_words += job.words
                tg.create_task(self._fetch(job))
                order.put_nowait(job)
            order.put_nowait(None)

    async def _fetch(self, job: _ClauseAudio) -> None:
        """One clause's audio from TTS into ``job`` (at most the clause's own length). Its
        failure is kept for :meth:`_play_in_order` to raise when the clause's turn comes:
        the clauses before it are heard whole, as without the look-ahead."""
        try:
            async with contextlib.aclosing(
                self._tts.synthesize(job.spoken, voice=self._voice, speed=self._speed, ahead_s=job.ahead_s)
            ) as audio_stream:
                async for chunk in audio_stream:
                    job.chunks.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001  (raised in clause order; CancelledError goes on up)
            job.error = exc
        finally:
            job.chunks.put_nowait(None)

    async def _play_in_order(self, order: asyncio.Queue[_ClauseAudio | None],
                             played: Callable[[_ClauseAudio], None]) -> None:
        while (job := await order.get()) is not None:
            try:
                while (chunk := await job.chunks.get()) is not None:
                    await self._add_audio(chunk)
                if job.error is not None:
                    raise job.error
                self.playout.end_clause(job.written)
            finally:
                played(job)

    async def say(self, text: str) -> None:
        """Speak ``text`` after the generated reply (a filler while a tool runs): played
        by the pacer like the rest, not part of the transcript or the history."""
        self.drained.clear()  # there is audio to send again
        await self._speak(text, text)

    async def _speak(self, spoken: str, written: str) -> None:
        async with contextlib.aclosing(
            self._tts.synthesize(spoken, voice=self._voice, speed=self._speed,
                                 ahead_s=self.playout.queued_samples / self.playout.sample_rate)
        ) as audio_stream:
            async for chunk in audio_stream:
                await self._add_audio(chunk)
        self.playout.end_clause(written)

    async def _add_audio(self, chunk: np.ndarray) -> None:
        if self.times.first_audio is None:
            self.times.first_audio = self._clock.monotonic()
        await self._wait_for_room()
        audio = np.asarray(chunk, dtype=np.float32)
        if self.playout.added == 0:
            audio = trim_leading_silence(audio, self._tts_rate)
        if self.playout.sample_rate != self._tts_rate:
            audio = resample(audio, self._tts_rate, self.playout.sample_rate)
        self.playout.add(audio)
        if self._on_audio is not None:
            self._on_audio()

    async def _wait_for_room(self) -> None:
        while not self.playout.has_room():
            self._room.clear()
            await self._room.wait()


def trim_leading_silence(audio: np.ndarray, rate: int, floor_dbfs: float = -45.0) -> np.ndarray:
    """Drop the quiet lead-in (TTS engines start with 0-70 ms of it) of a reply's first
    audio: the caller waits for the first *audible* sample. Keeps 10 ms before onset."""
    block = max(rate // 200, 1)  # 5 ms
    n = audio.size // block
    if n == 0:
        return audio
    rms = np.sqrt(np.mean(np.square(audio[: n * block].reshape(n, block)), axis=1))
    loud = np.flatnonzero(rms > 10 ** (floor_dbfs / 20))
    if loud.size == 0:
        return audio
    start = max(int(loud[0]) * block - rate // 100, 0)
    return audio[start:]
