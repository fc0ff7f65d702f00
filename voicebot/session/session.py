"""One call: the per-session state machine that every transport drives.

    audio in -> resample to 16 kHz -> VAD -> turn detector -> streaming ASR
      -> end of turn -> LLM (interactive lane) -> clauses -> TTS -> playout, paced

States: listening -> user speaking -> thinking -> speaking -> listening. The session
owns all its tasks in one TaskGroup (nothing it starts outlives it); transports only
translate wire messages to the methods below and :class:`SessionEvent` back to wire.

Speculation: when the user pauses (``vad.speculative_silence_ms``) the final
transcript is decoded and the reply is generated *gated*; when the pause becomes the
end of the turn (``vad.min_silence_ms``) the gate opens, so the endpointing wait
overlaps ASR, LLM and TTS. If the user goes on, the speculation is cancelled (the vLLM
request aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from voicebot.affinity import bind_session
from voicebot.audio import ASR_RATE, Resampler, pcm16_to_float
from voicebot.config import Config, VadConfig
from voicebot.engines.contracts import AsrStream, Lane, Transcript
from voicebot.engines.registry import Engines
from voicebot.engines.tokenizer_thread import run_tokenizer
from voicebot.errors import BadAudio, BadMessage, VoicebotError
from voicebot.metrics import Metrics
from voicebot.session.clock import REAL_CLOCK, Clock
from voicebot.session.events import (
    BargeIn,
    ErrorEvent,
    ResponseAudio,
    ResponseAudioStarted,
    ResponseDone,
    ResponseStarted,
    ResponseTextDelta,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
    ToolResult,
    TranscriptFinal,
    TranscriptPartial,
    TurnTimings,
)
from voicebot.session.history import Conversation, Message
from voicebot.session.outbox import Outbox
from voicebot.session.playout import Playout
from voicebot.session.response import Delta, Response, ResponseOptions
from voicebot.session.settings import SessionSettings
from voicebot.session.text_only import TextOnlyTts
from voicebot.session.turns import Signal, make_turn_detector
from voicebot.tools.session_tools import SessionTools
from voicebot.tools.spec import ToolChoice, ToolSpec

log = logging.getLogger(__name__)

_FRAME_MS = 20
_VAD_WINDOW_MS = 32.0
# Largest piece of input processed in one go (resample + VAD of 100 ms: well under a
# millisecond), so a big push never holds the loop for long.
_SLICE_MS = 100
# Dropped messages waiting for the summariser; beyond this the oldest are forgotten.
_MAX_UNSUMMARISED = 200


class SessionLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        return f"[{self.extra['session']}] {msg}", kwargs  # type: ignore[index]


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one ends it
        if x != y:
            break
        n += 1
    return a[:n]


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


@dataclass
class _Turn:
    """A user turn whose transcript is being (or has been) decoded."""

    item_id: str
    seq: int
    final: asyncio.Task[Transcript]
    asr_started: float
    asr_done: float | None = None
    speech_end: float | None = None  # wall clock of the last speech audio
    committed_at: float | None = None
    response: Response | None = None


@dataclass
class _Compaction:
    """The oldest turns being folded into the summary ahead of the budget: the history
    keeps them (and its cached prefix) until the history without them is prefilled."""

    head: list[Message]  # the messages to drop, as they were (compared by identity)
    summary: str | None = None  # the summary that replaces them, once written
    written: bool = False
    warmed: list[int] = field(default_factory=list)  # of the history after it, prefilled so far


class Session:
    def __init__(
        self,
        engines: Engines,
        settings: SessionSettings | None = None,
        *,
        metrics: Metrics | None = None,
        session_id: str | None = None,
        transport: str = "native",
        clock: Clock | None = None,
    ) -> None:
        cfg: Config = engines.cfg
        self.cfg = cfg
        self.engines = engines
        self.settings = settings or SessionSettings.from_config(cfg)
        self._check_voice(self.settings.voice)
        self.id = session_id or f"sess_{uuid.uuid4().hex[:12]}"
        self.transport = transport
        self.metrics = metrics
        self._clock: Clock = clock or REAL_CLOCK
        self.log = SessionLog(log, {"session": self.id})
        # Control events are few; audio frames are paced at 50/s. A client that stops
        # reading for out_queue_frames events is dropped instead of growing memory.
        self._out: Outbox[SessionEvent] = Outbox(cfg.session.out_queue_frames)
        self._vad = engines.vad.stream()
        self._asr = engines.asr.stream(language=self.settings.language)
        self._turns = make_turn_detector(self.settings.vad, engines.turn_model)
        self._watched_verdict: object = None  # the verdict _watch_verdict last hooked
        self._last_window_at = self._clock.monotonic()  # when audio last reached the detector
        self._turn_timer: asyncio.Task[None] | None = None  # _time_turn
        self._turn_timer_at = 0.0  # when it wakes next
        self._resamplers: dict[int, Resampler] = {}
        # Input waiting to be processed: audio slices and, in order with them, the
        # commits/clears that came after them. Bounded by max_input_backlog_s.
        self._backlog: deque[tuple[np.ndarray, int] | Callable[[], None]] = deque()
        self._backlog_s = 0.0
        self._drain_task: asyncio.Task[None] | None = None
        self._turn_streams: set[AsrStream] = set()  # committed turns' streams, still decoding
        self._ring: deque[np.ndarray] = deque()
        self._ring_samples = 0
        self._ring_max = self._ring_size(self.settings.vad)
        self.conversation = Conversation(
            engines.llm.tokenizer,
            self.settings.system_prompt,
            cfg.session.history_tokens,
            self.settings.max_tokens,
        )
        # Function tools (voicebot/tools): server-side webhooks from the config, or a
        # Realtime client's own; rendered into the system message by the chat template.
        self.tools = SessionTools(cfg, engines.llm.tokenizer, transport)
        self.conversation.set_tools(self.tools.chat_tools())
        self._ids = itertools.count(1)
        self._turn_seq = 0
        self._item_id: str | None = None  # the open user turn
        self._turn_open_at = 0.0
        self._last_speech_wall: float | None = None
        self._speech_end_asr_s: float | None = None
        self._pending: _Turn | None = None  # decoded speculatively, not yet committed
        self._response: Response | None = None
        self._response_turn: _Turn | None = None
        self._response_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # pacer: a response was released or got audio
        self._tasks: set[asyncio.Task[object]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._main: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._ready = asyncio.Event()
        self._counted = False  # in the active-sessions gauge
        self._torn_down = False
        self._played_override: int | None = None
        # Playouts of recent replies, so a client can still truncate them to what it heard.
        self._heard: dict[str, Playout] = {}
        self._unsummarised: list[Message] = []  # dropped from the history, not yet summarised
        self._summariser: asyncio.Task[None] | None = None
        self._compaction: _Compaction | None = None
        self._compactor: asyncio.Task[None] | None = None  # writing its summary
        self._warmer: asyncio.Task[None] | None = None  # prefilling the history (llm.warm_prefix)
        self._warmed: list[int] = []  # the history last prefilled, whole cache blocks
        self._warming: list[int] = []  # what the prefill in flight covers
        self.input_ms = 0.0
        self._last_input = self._clock.monotonic()
        self.closed_reason: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Session:
        if self.metrics:
            self.metrics.active_sessions.labels(self.transport).inc()
            self.metrics.sessions.labels(self.transport).inc()
            self._counted = True
        self._main = asyncio.create_task(self._run(), name=f"{self.id}-main")
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({ready, self._main}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self._main.done():  # it could not start: report why, torn down already
            await self._main
            raise RuntimeError("session ended while starting")
        self.log.info("session opened (%s)", self.transport)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        # However the session ends (aclose, idle timeout, slow consumer, a fatal error,
        # this task cancelled), its teardown runs here, once, after its last task.
        bind_session(self.id)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._spawn(self._pace(), "pacer")
                self._spawn(self._forward_partials(), "partials")
                self._spawn(self._watch_idle(), "idle")
                self._warm_prefix()
                self._ready.set()
                await self._closing.wait()
                for task in list(self._tasks):
                    task.cancel()
        finally:
            self._closing.set()  # events() ends even if the group failed
            await self._teardown()

    async def aclose(self, reason: str = "closed") -> None:
        """End the session (if it is not over already) and wait for its teardown."""
        self.closed_reason = self.closed_reason or reason
        self._closing.set()
        if self._main is not None and not self._main.done():
            await self._main
        await self._teardown()  # a no-op when _run did it; here if it never ran

    async def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        try:
            self._cancel_response(status="cancelled", emit=False)
            for stream in [self._asr, *self._turn_streams]:
                await stream.aclose()
            self._turn_streams.clear()
        finally:
            if self._counted and self.metrics:
                self.metrics.active_sessions.labels(self.transport).dec()
            self.log.info("session closed (%s)", self.closed_reason)

    def _spawn(self, coro, name: str) -> asyncio.Task:  # type: ignore[no-untyped-def]
        assert self._tg is not None, "session not started"
        task = self._tg.create_task(self._guard(coro), name=f"{self.id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A task cancelled before its first step never awaits ``coro``: close it.
        task.add_done_callback(lambda _: coro.close())
        return task

    async def _guard(self, coro) -> None:  # type: ignore[no-untyped-def]
        """An error in one task becomes an error event; the session goes on.
        Cancellation propagates untouched."""
        # A task started from a transport's reader (response.create) copies the reader's
        # context, not _run's: bind the call here too, so every LLM request of the call
        # carries its id (voicebot/affinity.py: X-Session-ID, data-parallel rank).
        bind_session(self.id)
        try:
            await coro
        except Exception as exc:
            # TaskGroups wrap failures in ExceptionGroups; report the underlying error.
            leaf = _first_leaf(exc)
            if isinstance(leaf, VoicebotError):
                self.log.warning("%s: %s", leaf.code, leaf)
                self.error(leaf.code, str(leaf), fatal=leaf.fatal)
            else:
                self.log.exception("task failed")
                self.error("internal_error", f"{type(leaf).__name__}: {leaf}")

    # -------------------------------------------------------------------- output
    async def events(self):  # type: ignore[no-untyped-def]
        """Events for the transport, until the session closes."""
        while True:
            get = asyncio.ensure_future(self._out.get())
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                done, _ = await asyncio.wait({get, closing}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closing.cancel()
                if not get.done():
                    get.cancel()
            if get in done and not get.cancelled():
                yield get.result()
            elif self._out.empty():
                return

    def emit(self, event: SessionEvent) -> None:
        try:
            self._out.put_nowait(event)
        except asyncio.QueueFull:
            # Once: every later event of a closing session lands here too.
            if self.closed_reason is None:
                self.log.warning("client is not reading events; closing")
                self.closed_reason = "slow_consumer"
            self._closing.set()

    def error(self, code: str, message: str, *, event_id: str | None = None, fatal: bool = False) -> None:
        if self.metrics:
            self.metrics.errors.labels(code).inc()
        self.emit(ErrorEvent(code=code, message=message, event_id=event_id, fatal=fatal))
        if fatal:
            self.closed_reason = code
            self._closing.set()

    # --------------------------------------------------------------------- input
    def push_audio(self, audio: bytes | np.ndarray, sample_rate: int) -> None:
        """Caller audio: PCM16 bytes or float32 samples, mono, any rate.

        A frame of up to ``_SLICE_MS`` is processed at once. A larger push (one 1 MiB
        message is 32 s of audio: resampling and VAD over it take long enough to stall
        the pacer of every session on this loop) is cut into slices that a task
        processes one per loop turn, in order with what is pushed after it. Audio
        waiting to be processed is bounded by ``session.max_input_backlog_s``.
        """
        copied = isinstance(audio, bytes | bytearray | memoryview)
        if copied:
            try:
                audio = pcm16_to_float(bytes(audio))
            except ValueError as exc:
                raise BadAudio(str(exc)) from None
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 1:
            raise BadAudio(f"audio must be mono (1-D), got shape {audio.shape}")
        if audio.size == 0:
            return
        self._last_input = self._clock.monotonic()
        step = max(1, sample_rate * _SLICE_MS // 1000)
        if not self._backlog and audio.size <= step:
            self._process_audio(audio, sample_rate)
            return
        seconds = audio.size / sample_rate
        limit = self.cfg.session.max_input_backlog_s
        if self._backlog_s + seconds > limit:
            raise BadAudio(
                f"{seconds:.1f} s of audio at once, with {self._backlog_s:.1f} s still being processed, "
                f"is more than session.max_input_backlog_s ({limit:g} s); send audio in real time",
                code="input_backlog_full",
            )
        if not copied:
            audio = audio.copy()  # the caller may reuse its buffer
        for start in range(0, audio.size, step):
            self._backlog.append((audio[start : start + step], sample_rate))
        self._backlog_s += seconds
        self._start_drain()

    def _start_drain(self) -> None:
        running = self._drain_task is not None and not self._drain_task.done()
        if not running and self._tg is not None and not self._closing.is_set():
            self._drain_task = self._spawn(self._drain_input(), "input")

    async def _drain_input(self) -> None:
        try:
            while self._backlog:
                item = self._backlog.popleft()
                if callable(item):
                    item()  # a commit or clear, in order with the audio around it
                    continue
                audio, rate = item
                self._backlog_s = max(0.0, self._backlog_s - audio.size / rate)
                self._process_audio(audio, rate)
                await asyncio.sleep(0)  # other sessions' pacers and I/O run between slices
        finally:
            self._drain_task = None

    def _process_audio(self, audio: np.ndarray, sample_rate: int) -> None:
        if sample_rate != ASR_RATE:
            rs = self._resamplers.get(sample_rate)
            if rs is None:
                rs = self._resamplers[sample_rate] = Resampler(sample_rate, ASR_RATE)
            audio = rs.process(audio)
        if audio.size == 0:
            return
        self.input_ms += 1000.0 * audio.size / ASR_RATE
        if not self.settings.turn_detection:
            self._asr.push(audio)  # the client decides when the turn ends
            return
        self._remember(audio)
        self._turns.feed(audio)  # a semantic detector hears the turn's audio at pauses
        pushed = False
        bot_speaking = self._response is not None and self._response.released.is_set()
        for i, prob in enumerate(self._vad.process(audio)):
            if prob >= self.settings.vad.threshold and self._item_id is not None:
                self._last_speech_wall = self._clock.monotonic()
                # Where speech ends in the ASR buffer (up to one window late: safe).
                self._speech_end_asr_s = self._asr.buffered_s + (i + 1) * _VAD_WINDOW_MS / 1000
            for sig in self._turns.update(float(prob), _VAD_WINDOW_MS, bot_speaking):
                pushed |= self._on_signal(sig)
        self._watch_verdict()
        self._last_window_at = self._clock.monotonic()
        self._arm_turn_timer()
        # During a pause the speculative final already has the audio; decoding the
        # silence as partials would only compete with it and the LLM for the cores.
        if self._item_id is not None and not pushed and not self._turns.paused:
            self._asr.push(audio)
            if self._clock.monotonic() - self._turn_open_at > self.cfg.session.max_turn_s:
                for sig in self._turns.force_end():
                    self._on_signal(sig)

    def _watch_verdict(self) -> None:
        """The end-of-turn model answers on its own thread, maybe after the last audio
        window (a client that streamed faster than real time, or sends nothing at a
        pause): its answer is acted on when it comes, not only at the next window."""
        fut = self._turns.pending
        if fut is None or fut is self._watched_verdict:
            return
        self._watched_verdict = fut
        loop = asyncio.get_running_loop()

        def wake(_: object) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._poll_turns)

        fut.add_done_callback(wake)

    def _poll_turns(self, idle_ms: float | None = None) -> None:
        if self._closing.is_set():
            return
        if idle_ms is None:  # audio waiting in the backlog is not time without audio
            idle_ms = 0.0 if self._backlog else 1000 * (self._clock.monotonic() - self._last_window_at)
        for sig in self._turns.poll(idle_ms):
            self._on_signal(sig)
        self._watch_verdict()  # a check asked just now

    def _arm_turn_timer(self) -> None:
        if self._tg is None or self._closing.is_set():
            return
        due = self._turns.idle_deadline_ms()
        if due is None:
            return
        at = self._last_window_at + due / 1000
        timer = self._turn_timer
        if timer is not None and not timer.done():
            if at >= self._turn_timer_at - 0.001:
                return  # it wakes in time and reads the deadline again
            timer.cancel()  # the deadline came nearer (a pause began): wake sooner
        self._turn_timer_at = at
        self._turn_timer = self._spawn(self._time_turn(), "turn-timer")

    async def _time_turn(self) -> None:
        """The semantic cap is wall-clock time: a turn heard as unfinished ends
        ``smart_turn_max_silence_ms`` after its last speech even when the client sends
        nothing more (it counted silence frames received, so a client that stopped after
        its question was never answered). One task per open turn, sleeping until the
        detector's next deadline; audio that comes in the meantime moves the deadline
        (new speech restarts the count), and the task reads it again when it wakes."""
        while (due := self._turns.idle_deadline_ms()) is not None:
            idle = 1000 * (self._clock.monotonic() - self._last_window_at)
            if self._backlog or idle < due:
                wait = max(due - idle, 1.0) / 1000
                self._turn_timer_at = self._clock.monotonic() + wait
                await self._clock.sleep(wait)
                continue
            self._poll_turns(max(idle, due))
            if self._turns.idle_deadline_ms() == due:  # nothing moved: never spin
                await self._clock.sleep(_VAD_WINDOW_MS / 1000)

    def _remember(self, audio: np.ndarray) -> None:
        """Keep the last few hundred ms: the start of speech precedes its detection."""
        self._ring.append(audio)
        self._ring_samples += audio.size
        while self._ring_samples - self._ring[0].size >= self._ring_max:
            self._ring_samples -= self._ring.popleft().size

    def _on_signal(self, sig: Signal) -> bool:
        """Act on a turn signal; True if the current chunk went to ASR already."""
        if sig is Signal.SPEECH_START:
            self._start_user_turn()
            return True
        if sig is Signal.QUIET:
            # Decode now, unless a partial that saw the speech to its end is decoded or
            # decoding: it becomes the final, and another decode would only run beside
            # the reply's LLM prefill (tests/test_turns_partials.py).
            self._asr.request_partial(self._speech_end_asr_s)
        elif sig is Signal.PAUSE:
            self._speculate()
        elif sig is Signal.RESUME:
            self._drop_speculation()
        elif sig is Signal.END:
            self._end_user_turn()
        return False

    def _start_user_turn(self) -> None:
        if self._response is not None and self.settings.interrupt_response:
            self._cancel_response(status="interrupted")
        self._turn_seq += 1
        self._item_id = f"item_{self.id[5:]}_{next(self._ids)}"
        self._turn_open_at = self._clock.monotonic()
        self._last_speech_wall = self._clock.monotonic()
        self._asr.reset()
        self._asr.push(np.concatenate(self._ring))
        # Speech lasted at least to here (the window that started the turn is not counted
        # below): never a stale end of the previous turn's speech.
        self._speech_end_asr_s = self._asr.buffered_s
        self.emit(SpeechStarted(audio_ms=int(self.input_ms), item_id=self._item_id))

    def _speculate(self) -> None:
        if self._item_id is None or not self.settings.create_response:
            return
        if self._response is not None and self._response.released.is_set():
            # Speech over a reply that it did not interrupt (interrupt_response off):
            # that reply plays on. A speculation would take its place unfinished (no
            # ResponseDone, nothing in the history); the turn is transcribed as usual.
            return
        turn = self._new_turn(self._item_id, self._spawn_final(self._speech_end_asr_s))
        turn.response = self._start_response(gated=True, turn=turn)
        self._pending = turn

    def _drop_speculation(self) -> None:
        turn, self._pending = self._pending, None
        if turn is None:
            return
        turn.final.cancel()
        if turn.response is not None and turn.response is self._response:
            self._cancel_response(status="cancelled", emit=False)

    def _end_user_turn(self) -> None:
        if self._item_id is None:
            return
        turn = self._pending or self._new_turn(self._item_id, self._spawn_final(self._speech_end_asr_s))
        self._pending = None
        turn.speech_end = self._last_speech_wall
        turn.committed_at = self._clock.monotonic()
        self.emit(SpeechStopped(audio_ms=int(self.input_ms), item_id=self._item_id))
        self._item_id = None
        self._spawn(self._complete_turn(turn), "turn")

    def _new_turn(self, item_id: str, final: asyncio.Task[Transcript]) -> _Turn:
        turn = _Turn(item_id, self._turn_seq, final, asr_started=self._clock.monotonic())
        # When the transcript is ready, not when the committed turn reads it (after END:
        # a speculative final may wait there for Smart Turn's cap; tests/test_asr_final_timing.py).
        final.add_done_callback(lambda _: setattr(turn, "asr_done", self._clock.monotonic()))
        return turn

    def _spawn_final(self, covering_s: float | None = None, stream: AsrStream | None = None) -> asyncio.Task[Transcript]:
        assert self._tg is not None
        task = self._tg.create_task(self._final(covering_s, stream), name=f"{self.id}-final")
        self._tasks.add(task)  # cancelled at close like every other task
        task.add_done_callback(self._tasks.discard)
        return task

    async def _final(self, covering_s: float | None, stream: AsrStream | None = None) -> Transcript:
        """The final transcript of the session's stream, or of ``stream`` (a committed
        turn's own, closed once decoded)."""
        # A failed decode must not take the session's TaskGroup (and the call) down:
        # it is reported, and the turn goes on as one with nothing said.
        try:
            return await (stream or self._asr).finalize(covering_s)
        except VoicebotError as exc:
            self.error(exc.code, str(exc))
        except Exception as exc:
            self.log.exception("final transcript failed")
            self.error("engine_error", f"ASR failed: {exc}")
        finally:
            if stream is not None:
                await stream.aclose()
                self._turn_streams.discard(stream)
        return Transcript("", 0.0, 0.0)

    async def _complete_turn(self, turn: _Turn) -> None:
        transcript = await turn.final
        text = transcript.text.strip()
        self.emit(TranscriptFinal(item_id=turn.item_id, text=text))
        if not text:  # a noise the VAD took for speech
            if turn.response is not None and turn.response is self._response:
                self._cancel_response(status="cancelled", emit=False)
            return
        self.conversation.append("user", text, turn.item_id)
        self._trim_history()
        if self.metrics:
            self.metrics.turns.inc()
        if turn.seq != self._turn_seq:
            return  # the caller is already speaking again: no reply to this turn
        if turn.response is not None and turn.response is self._response:
            self._release(turn.response)
        elif self.settings.create_response and self._response is None:
            self._start_response(gated=False, turn=turn)

    # ----------------------------------------------------------------- commands
    def commit_input(self) -> str:
        """Client-side turn end (turn detection off): transcribe what was sent.

        The turn takes the audio sent before the commit; what is sent after it, even
        while this turn is still being transcribed, is the start of the next turn.
        """
        item_id = f"item_{self.id[5:]}_{next(self._ids)}"
        if self._backlog:  # audio sent before the commit is still being processed
            self._backlog.append(lambda: self._commit(item_id))
        else:
            self._commit(item_id)
        return item_id

    def _commit(self, item_id: str) -> None:
        self._turn_seq += 1
        # The turn's audio leaves with its own stream; a fresh one takes what follows.
        stream, self._asr = self._asr, self.engines.asr.stream(language=self.settings.language)
        self._turn_streams.add(stream)  # closed by its final, or at teardown
        turn = self._new_turn(item_id, self._spawn_final(stream=stream))
        turn.speech_end = turn.committed_at = self._clock.monotonic()
        self._spawn(self._complete_turn(turn), "commit")

    def clear_input(self) -> None:
        # Audio sent after the last queued commit is not processed at all.
        while self._backlog and not callable(self._backlog[-1]):
            audio, rate = self._backlog.pop()  # type: ignore[misc]
            self._backlog_s = max(0.0, self._backlog_s - audio.size / rate)
        if self._backlog:
            self._backlog.append(self._clear)
        else:
            self._clear()

    def _clear(self) -> None:
        self._asr.reset()
        self._drop_speculation()

    def add_text(self, role: str, text: str, item_id: str | None = None) -> str:
        item_id = item_id or f"item_{self.id[5:]}_{next(self._ids)}"
        if role not in ("user", "assistant", "system"):
            raise BadMessage(f"unsupported role {role!r}", code="invalid_value")
        limit = self.cfg.session.max_text_chars
        if len(text) > limit:
            raise BadMessage(
                f"text of {len(text)} characters is longer than session.max_text_chars ({limit})",
                code="text_too_long",
            )
        self.conversation.append(role, text, item_id)  # type: ignore[arg-type]
        self._trim_history()
        return item_id

    def create_response(self, options: ResponseOptions | None = None) -> str:
        """Reply now; ``options``: this reply's own instructions / tools / tool_choice /
        max_tokens (a Realtime ``response.create`` override)."""
        if options is not None:
            self.tools.plan(options)  # a tool_choice naming no declared tool: refused here
        if self._response is not None:
            self._cancel_response(status="cancelled")
        return self._start_response(gated=False, turn=None, options=options).id

    # -------------------------------------------------------------------- tools
    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        """A client's ``session.tools`` / ``tool_choice`` (None: unchanged)."""
        self.tools.set(tools, choice)
        self.conversation.set_tools(self.tools.chat_tools())
        self._warm_prefix()

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        """A client's result of a function call (Realtime ``function_call_output``)."""
        item_id = item_id or f"item_{self.id[5:]}_{next(self._ids)}"
        self.conversation.append("tool", self.tools.clip(output), item_id, call_id=call_id)
        self._trim_history()
        return item_id

    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object], item_id: str | None = None) -> str:
        """A function call a client adds to the history itself (Realtime ``function_call`` item)."""
        item_id = item_id or f"item_{self.id[5:]}_{next(self._ids)}"
        self.conversation.append("assistant", "", item_id, tool_calls=[{"name": name, "arguments": arguments}],
                                 call_id=call_id)
        self._trim_history()
        return item_id

    def cancel_response(self) -> bool:
        if self._response is None:
            return False
        self._cancel_response(status="cancelled")
        return True

    def truncate(self, item_id: str, audio_end_ms: int) -> str | None:
        """The client heard ``audio_end_ms`` of reply ``item_id``: keep only that."""
        playout = self._heard.get(item_id)
        if playout is None:
            return None
        heard = playout.heard_text(int(audio_end_ms * playout.sample_rate / 1000))
        self.conversation.replace(item_id, heard)
        return heard

    def set_played(self, ms: int) -> None:
        """A transport that knows how much reply audio was really played says so."""
        self._played_override = ms

    def _check_voice(self, voice: str | None) -> None:
        # Only voices the server loaded: a client must never make the engine open a
        # file path of its choosing.
        if voice is not None and voice.split("+", 1)[0] not in self.engines.tts.voices():
            raise BadMessage(
                f"unknown voice {voice!r}; available: {', '.join(self.engines.tts.voices()[:20])}",
                code="invalid_voice",
            )

    def update_settings(self, **changes: object) -> None:
        # Validated as a whole (model_copy(update=) would take the values unchecked, and
        # dumping them to check them warns on each wrong type before the error).
        new = SessionSettings.model_validate({**self.settings.model_dump(), **changes})
        self._check_voice(new.voice)
        self.settings = new
        self.conversation.set_system_prompt(new.system_prompt)
        self._turns.cfg = new.vad
        # The pre-speech audio follows the new padding from now on (it was sized once,
        # at the start: an update was acknowledged and the ASR kept the old padding).
        self._ring_max = self._ring_size(new.vad)
        self.conversation.reply_tokens = new.max_tokens
        self._warm_prefix()

    @staticmethod
    def _ring_size(vad: VadConfig) -> int:
        """Samples of audio kept from before speech starts: the padding the ASR gets, and
        the speech a barge-in needs before it counts, with a margin."""
        return int((vad.prefix_padding_ms + vad.barge_in_min_ms + 100) * ASR_RATE / 1000)

    @property
    def replying(self) -> bool:
        """A reply is being spoken: released to the caller and not finished (a drain
        lets it finish)."""
        return self._response is not None and self._response.released.is_set()

    def item_history(self) -> list[Message]:
        return list(self.conversation.messages)

    # ------------------------------------------------------------------ replies
    def _start_response(
        self, *, gated: bool, turn: _Turn | None, options: ResponseOptions | None = None, tool_round: int = 0
    ) -> Response:
        rid = f"resp_{self.id[5:]}_{next(self._ids)}"
        item_id = f"item_{self.id[5:]}_{next(self._ids)}"
        s = self.settings
        options = options or ResponseOptions()
        last = self.conversation.messages[-1] if self.conversation.messages else None
        plan = self.tools.plan(options, tool_round, after_result=turn is None and last is not None and last.role == "tool")
        resp = Response(
            rid,
            item_id,
            [],
            self.engines.llm,
            # Text-only replies (Realtime output_modalities ["text"]) synthesise nothing.
            self.engines.tts if s.audio_output else TextOnlyTts(self.engines.tts.sample_rate),
            voice=s.voice,
            speed=s.speed,
            max_tokens=options.max_tokens or s.max_tokens,
            first_clause_words=self.cfg.session.first_clause_words,
            max_clause_words=self.cfg.session.max_clause_words,
            clause_low_water_ms=self.cfg.session.clause_low_water_ms,
            gated=gated,
            output_rate=s.output_sample_rate,
            clock=self._clock,
            on_audio=self._wake.set,
            tool_stream=plan.stream,
            constraint=plan.constraint,
            options=options,
            tool_round=tool_round,
        )
        resp.prompt_tools, resp.tool_choice = plan.prompt_tools, plan.choice
        if self._warmer is not None:
            # The reply's own prompt starts with that prefix: a warm-up still queued would
            # only compete with it (one already in a vLLM step finishes that step).
            self._warmer.cancel()
            self._warmer = None
        self._response = resp
        self._response_turn = turn
        self._response_task = self._spawn(self._drive(resp, turn), "response")
        if not gated:
            self._release(resp)
        return resp

    def _release(self, resp: Response) -> None:
        resp.release()
        self._wake.set()

    async def _drive(self, resp: Response, turn: _Turn | None) -> None:
        results: list[str] | None = None  # server tools' results, when the reply called them
        try:
            if turn is not None:
                # shield: this reply being cancelled must not cancel the turn's transcript.
                transcript = await asyncio.shield(turn.final)
                if not transcript.text.strip():
                    return
                in_history = any(m.item_id == turn.item_id for m in self.conversation.messages)
                # A speculative reply runs before the turn is committed to the history.
                user_text = None if in_history else transcript.text
                resp.prompt_ids = self.conversation.prompt_ids(user_text=user_text)
            else:
                resp.prompt_ids = self.conversation.prompt_ids(
                    system_prompt=resp.options.instructions, tools=resp.prompt_tools
                )
            resp.times.requested = self._clock.monotonic()
            forward = self._spawn(self._forward_text(resp), "text")
            try:
                await resp.run()
                await forward
                await resp.released.wait()
                if self.tools.runs(resp.tool_calls, resp.tool_round) and resp.tool_choice != ToolChoice("none"):
                    results = await self._run_tools(resp)
                if resp.playout.queued_samples:
                    await resp.drained.wait()  # the pacer is still sending
            finally:
                forward.cancel()
        except Exception:
            if not resp.released.is_set():
                # Speculative work is invisible to the caller: drop it; the committed
                # turn starts a fresh reply (and reports its failure, if any).
                self.log.warning("speculative reply failed", exc_info=True)
                if self._response is resp:
                    self._response = None
                    self._response_task = None
                    self._warm_prefix()  # it may have dropped a prefill that nothing redid
                return
            if self._response is resp:
                self._finish(resp, "failed")
            raise
        if self._response is resp:
            self._finish(resp, "completed")
            if results is not None:
                self._reply_to_tool_results(resp, results)

    async def _run_tools(self, resp: Response) -> list[str]:
        """Run a released reply's server-tool calls, speaking the filler if they are
        slow and the reply said nothing before its call. Runs inside the reply's task:
        a barge-in cancels the webhook requests with it."""
        filler, after_s = self.tools.filler
        work = asyncio.ensure_future(self.tools.run_all(resp.tool_calls, self.id))
        try:
            if filler and not resp.full_text:
                done, _ = await asyncio.wait({work}, timeout=after_s)
                if not done:
                    await resp.say(filler)
            return await work
        finally:
            work.cancel()  # only does something when we are cancelled

    def _reply_to_tool_results(self, resp: Response, results: list[str]) -> None:
        """Results into the history (after the call's reply), then the next reply."""
        for call, output in zip(resp.tool_calls, results, strict=True):
            self.add_tool_result(call.call_id, output)
            self.emit(ToolResult(call.call_id, call.name, output))
        if self._response is None and not self._closing.is_set():
            self._start_response(gated=False, turn=None, options=resp.options, tool_round=resp.tool_round + 1)

    async def _forward_text(self, resp: Response) -> None:
        await resp.released.wait()
        self.emit(ResponseStarted(resp.id, resp.item_id))
        held: list[Delta | None] = []  # taken from the queue, for the next round
        while (delta := held.pop() if held else await resp.deltas.get()) is not None:
            if isinstance(delta, str):
                # The text waiting here goes out as one event. A speculative reply
                # released at the end of turn has hundreds of tokens waiting: one event
                # each, in one loop turn, filled the bounded outbox, and the call was
                # closed as a client that stopped reading.
                parts = [delta]
                while not resp.deltas.empty():
                    nxt = resp.deltas.get_nowait()
                    if not isinstance(nxt, str):
                        held.append(nxt)  # a tool-call event or the end: after this text
                        break
                    parts.append(nxt)
                event: SessionEvent = ResponseTextDelta(resp.id, resp.item_id, "".join(parts))
            else:
                event = delta  # a tool call's start / arguments / end (already session events)
            # Like the reply's audio, its text waits for a slow reader (and coalesces
            # meanwhile) instead of being taken for a stalled one.
            await self._out.wait_for_room()
            if self._response is not resp:
                return  # cut while we waited: its ResponseDone is out, nothing may follow it
            self.emit(event)

    def _cancel_response(self, *, status: str, emit: bool = True) -> None:
        resp, task = self._response, self._response_task
        if resp is None:
            return
        if task is not None:
            task.cancel()  # aborts the vLLM request and pending TTS
        if emit and resp.released.is_set():
            dropped = resp.playout.clear()
            # Its audio still waiting in the outgoing queue is never sent either: the
            # caller must not hear it, and the barge-in event must not wait behind it.
            unsent = sum(
                e.audio.size
                for e in self._out.discard(lambda e: isinstance(e, ResponseAudio) and e.response_id == resp.id)
                if isinstance(e, ResponseAudio)
            )
            resp.playout.taken -= unsent  # taken from the playout, but never sent
            dropped += unsent
            self._finish(resp, status)
            if status == "interrupted":
                if self.metrics:
                    self.metrics.barge_ins.inc()
                self.log.info("barge-in: %d ms of reply audio dropped", 1000 * dropped // resp.playout.sample_rate)
        self._response = None
        self._response_task = None
        self._warm_prefix()  # a reply dropped unheard may have dropped a prefill as well

    def _finish(self, resp: Response, status: str) -> None:
        rate = resp.playout.sample_rate
        if status == "completed":
            played = resp.playout.taken
        elif self._played_override is not None:
            played = int(self._played_override * rate / 1000)
        else:
            # The client holds up to the lead in its buffer: that part was not heard.
            lead = int(self.cfg.session.playout_lead_ms * rate / 1000)
            played = max(0, resp.playout.taken - lead)
        heard = resp.playout.heard_text(played) if status != "completed" else resp.full_text
        # A reply played in full is stored as the tokens the model produced (tool-call
        # markup included): the next prompt then reuses its KV blocks from the prefix
        # cache as well. A reply cut short keeps what was heard, and no call.
        completed = status == "completed"
        self.conversation.append(
            "assistant", resp.raw_text if completed else heard, resp.item_id,
            token_ids=resp.token_ids if completed else None,
        )
        self._heard[resp.item_id] = resp.playout
        while len(self._heard) > 4:  # only recent replies can still be truncated
            self._heard.pop(next(iter(self._heard)))
        self._trim_history()
        played_ms = 1000 * played // rate
        if status == "interrupted":
            self.emit(BargeIn(resp.id, played_ms, heard))
        st = resp.stats
        if self.metrics:
            self.metrics.count_tokens(st.prompt_tokens, st.cached_tokens)
        self.emit(
            ResponseDone(
                resp.id, resp.item_id, status, heard, resp.full_text, played_ms,  # type: ignore[arg-type]
                st.finish_reason, st.prompt_tokens, st.output_tokens,
                tuple(resp.tool_calls) if completed else (), st.cached_tokens,
            )
        )
        self._played_override = None
        if self._response is resp:
            self._response = None
            self._response_task = None
        if resp.stats.first_token_at is not None:
            # The reply's request left its prompt and all but its last token in the cache:
            # prefill the history only where it has a whole block more than that.
            self._warmed = _common_prefix(self.conversation.history_ids(), resp.prompt_ids + resp.token_ids[:-1])
        if self.conversation.near_budget():
            self._start_compaction()  # held back while this reply was live
        self._warm_prefix()

    def _trim_history(self) -> None:
        conv = self.conversation
        if self._can_warm():
            if not conv.over_budget():
                if conv.near_budget():
                    self._start_compaction()
                return
            # Over the budget before the compaction was ready (replies come faster than
            # a summary on this machine): trim now, its summary as well if written.
            c, self._compaction = self._compaction, None
            if self._compactor is not None:
                self._compactor.cancel()
                self._compactor = None
            if c is not None and c.written and conv.compact(c.head, c.summary) and not conv.over_budget():
                self._warm_prefix()
                return
        dropped = conv.trim()
        if dropped and self.cfg.llm.background_concurrency > 0:
            self._unsummarised.extend(dropped)
            if len(self._unsummarised) > _MAX_UNSUMMARISED:  # the summariser is far behind
                del self._unsummarised[: len(self._unsummarised) - _MAX_UNSUMMARISED]
            if self._summariser is None or self._summariser.done():
                if self._warmer is not None and not self._warmer.done():
                    # Its history is about to be rewritten, and it holds a background
                    # place the summary needs (a client's text trims with no reply to
                    # cancel it). The summary prefills again when it lands.
                    self._warmer.cancel()
                self._summariser = self._spawn(self._summarise(), "summary")

    def _start_compaction(self) -> None:
        """Fold the turns the next trim would drop into the summary while the history
        still holds them: a trim moves every kept token, so nothing of the kept history
        stays cached, and a reply that came next prefilled all of it (60 % of
        session.history_tokens: 825 tokens, a TTFT of 4.8 s on the 2-core CPU default,
        docs/benchmarks.md). The history without them is prefilled at background
        priority once the summary is written, and swapped in when that prefill is done
        (:meth:`_warm`): replies until then use the history as it was, still cached."""
        if not self._can_warm():
            return  # nothing would keep the compacted history's prefill: trims do it all
        if self._compaction is not None or (self._summariser is not None and not self._summariser.done()):
            return  # one at a time; a trim's summary rewrites the system message first
        if self._response is not None:
            # Its summary's prompt (hundreds of tokens) would be prefilled in the steps
            # that carry the live reply's tokens: seconds of silence on a CPU. The
            # reply's end trims, so this runs again then.
            return
        head = self.conversation.trim_plan()
        if head:
            self._compaction = _Compaction(head)
            self._compactor = self._spawn(self._write_compaction(self._compaction), "compaction")

    async def _write_compaction(self, c: _Compaction) -> None:
        # Cancellation (the hard trim took over, the call ended) propagates.
        earlier = self.conversation.summary
        try:
            c.summary = await self._summary_of(c.head, earlier)
        except Exception as exc:
            # Dropped unsummarised, as a trim's turns are when their summary fails.
            self.log.warning("summary of %d dropped messages failed, dropped: %s", len(c.head), exc)
            c.summary = earlier
        c.written = True
        if self._compactor is asyncio.current_task():
            self._compactor = None
        self._warm_prefix()

    def _apply_compaction(self, c: _Compaction) -> None:
        self._compaction = None
        if not self.conversation.compact(c.head, c.summary):
            self.log.info("history changed while it was compacted: compacting again")
        self._trim_history()  # a long exchange meanwhile may call for the next one
        self._warm_prefix()  # what came after the prefill began

    def _warm_turn(self, words: str) -> None:
        """Prefill the caller's words so far while they go on speaking (llm.warm_turn),
        on each partial transcript: at the end of the turn its prompt prefills only what
        came after the last whole cache block of them, not the whole question. On the
        2-core CPU default every token of prompt left to prefill costs the reply ~7 ms
        (docs/benchmarks.md); the cores are mostly idle while the caller speaks. A word
        the final hears otherwise costs only the blocks from it on: the cache is keyed
        by content, never wrong."""
        if self.cfg.llm.warm_turn and self.settings.create_response:
            self._warm_prefix(self.conversation.user_prefix_ids(words))

    def _warm_prefix(self, ids: list[int] | None = None) -> None:
        """Prefill the conversation so far at background priority while nobody waits on
        the LLM (llm.warm_prefix): the call has just started or got new instructions or
        tools, or a reply has ended. The next turn's prompt then finds those blocks in
        the prefix cache and prefills only what is new: the caller's words. Without it a
        long system prompt (a Realtime client's instructions and tools) is prefilled
        with the first turn, seconds on a CPU; and the blocks after a reply are cached
        only as far as the model computed them. ``ids``: a longer start of the next
        prompt than the history (the caller's words so far, :meth:`_warm_turn`)."""
        if not self._can_warm() or self._tg is None:
            return
        if self._closing.is_set() or self._response is not None:
            return  # a live reply's prompt has this prefix anyway
        summariser = self._summariser
        if summariser is not None and not summariser.done() and summariser is not asyncio.current_task():
            return  # its summary rewrites the system message; it prefills after that
        c = self._compaction
        if c is not None and c.written:
            # The history without the compacted turns first: the caller's words after it
            # are prefilled by the next partial, once it is the history.
            ids = self.conversation.compacted_ids(c.head, c.summary)
            if ids is None:  # a client deleted or rewrote one of its messages meanwhile
                self._compaction = None
                self._trim_history()
                return
        else:
            c = None
            if ids is None:
                ids = self.conversation.history_ids()
        block = self.engines.llm.block_size  # the prefix cache holds whole blocks only
        whole = len(ids) // block * block
        if whole == 0 or ids[:whole] == self._warmed[:whole]:
            if c is not None:
                self._apply_compaction(c)
            return  # nothing new that the cache could hold
        if self._warmer is not None and not self._warmer.done():
            if ids[:whole] == self._warming[:whole]:
                # Being prefilled: a session.update that changed nothing, or the history
                # while the caller's words after it are.
                return
            self._warmer.cancel()  # superseded
        self._warming = ids[:whole]
        self._warmer = self._spawn(self._warm(ids, whole, c), "warm")

    def _can_warm(self) -> bool:
        """Background prefills are on, and a prefix cache keeps what they compute."""
        llm_cfg = self.cfg.llm
        if not llm_cfg.warm_prefix or llm_cfg.background_concurrency == 0:
            return False
        # No cache to keep it: the prefill would be thrown away (a remote tier's is its own).
        return llm_cfg.backend != "inprocess" or llm_cfg.enable_prefix_caching

    async def _warm(self, ids: list[int], whole: int, compaction: _Compaction | None = None) -> None:
        # Background work is invisible to the caller: a failure is logged, never an
        # error event. Cancellation (a reply started, the call ended) propagates.
        def cached(end: int) -> None:  # a piece is in: a retry after a live turn starts there
            if compaction is not None:
                compaction.warmed = ids[: end // block * block]
            else:
                self._warmed = ids[: end // block * block]

        block = self.engines.llm.block_size
        known = compaction.warmed if compaction is not None else self._warmed
        try:
            await self.engines.llm.warm(ids, cached=len(_common_prefix(ids, known)), on_piece=cached)
        except Exception as exc:
            self.log.warning("prefilling the conversation (%d tokens) failed: %s", len(ids), exc)
            return
        self._warmed = ids[:whole]
        if compaction is not None and compaction is self._compaction and self._response is None:
            self._apply_compaction(compaction)

    async def _summarise(self) -> None:
        """Fold dropped turns into the one-line summary, at background priority.

        One summariser per session: turns dropped while a summary is being written
        wait for it and are folded into the next one, which starts from it (two at once
        would both start from the old summary; the later would lose the other's turns).
        Background work is invisible to the caller: a failed summary is logged and
        dropped, never an error event. Cancellation (the session closing) propagates.
        """
        try:
            while self._unsummarised:
                dropped, self._unsummarised = self._unsummarised, []
                try:
                    summary = await self._summary_of(dropped, self.conversation.summary)
                except Exception as exc:
                    self.log.warning("summary of %d dropped messages failed, dropped: %s", len(dropped), exc)
                    continue
                self.conversation.set_summary(summary)
            self._warm_prefix()  # a new system message: nothing of the old prefix is cached
        finally:
            self._summariser = None

    async def _summary_of(self, dropped: list[Message], earlier: str | None) -> str:
        lines = [f"{m.role}: {m.content}" for m in dropped]
        if earlier:
            lines.insert(0, f"(earlier: {earlier})")
        tok = self.engines.llm.tokenizer

        def encode() -> list[int]:
            prompt = tok.apply_chat_template(
                [
                    {"role": "system", "content": "Summarise the conversation in one short sentence."},
                    {"role": "user", "content": "\n".join(lines)},
                ],
                tokenize=True,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            # Newer transformers return a BatchEncoding (a Mapping, not a dict): its
            # list() would be its keys.
            return list(prompt["input_ids"] if isinstance(prompt, Mapping) else prompt)

        # Up to a history budget of text: tokenised off the event loop, on the one thread
        # that keeps vLLM's tokenizer pool from growing (engines/tokenizer_thread.py).
        ids = await run_tokenizer(encode)
        # Prefilled first in pieces (llm.warm_piece_tokens), as any background prefill: a
        # turn that ends meanwhile waits for one piece's step, not the whole prompt's.
        with contextlib.suppress(Exception):  # best effort: the summary's request prefills the rest
            await self.engines.llm.warm(ids)
        return await self.engines.llm.complete(ids, lane=Lane.BACKGROUND, max_tokens=64, temperature=0.0)

    # -------------------------------------------------------------------- pacer
    async def _pace(self) -> None:
        """Send reply audio in 20 ms frames in real time, ``playout_lead_ms`` ahead."""
        lead_s = self.cfg.session.playout_lead_ms / 1000.0
        while True:
            resp = self._response
            if resp is None or not resp.released.is_set() or resp.playout.queued_samples == 0:
                # Woken by a release or by new audio in the playout (no polling).
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._play(resp, lead_s)

    async def _play(self, resp: Response, lead_s: float) -> None:
        rate = resp.playout.sample_rate
        frame = rate * _FRAME_MS // 1000
        if resp.times.first_audio is not None and resp.playout.taken == 0:
            self.emit(ResponseAudioStarted(resp.id, resp.item_id))
            self._report_timings(resp)
        base = self._clock.monotonic() - resp.playout.taken / rate
        while self._response is resp:
            due = (self._clock.monotonic() - base + lead_s) * rate
            while resp.playout.taken + frame <= due or (
                resp.playout.queued_samples and resp.playout.taken < due and resp.generated
            ):
                if not self._out.data_room():
                    await self._out.wait_for_room()
                    if self._response is not resp:
                        return  # cancelled while the client was slow to read
                chunk = resp.playout.take(frame)
                if chunk.size == 0:
                    break
                self._out.put_nowait(ResponseAudio(resp.id, resp.item_id, chunk, rate))
                resp.notify_drained()
                if resp.generated and resp.playout.queued_samples == 0:
                    resp.drained.set()
                if self._response is not resp:
                    return
            if resp.playout.queued_samples == 0:
                return  # underrun or done: the outer loop waits for more
            await self._clock.sleep(_FRAME_MS / 1000.0)

    def _report_timings(self, resp: Response) -> None:
        now = self._clock.monotonic()
        turn = self._response_turn if self._response is resp else None

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(1000.0 * (b - a), 1)

        t = resp.times
        timings = TurnTimings(
            response_id=resp.id,
            endpointing_ms=ms(turn.speech_end, turn.committed_at) if turn else None,
            asr_final_ms=ms(turn.asr_started, turn.asr_done) if turn else None,
            llm_ttft_ms=None if resp.stats.ttft_s is None else round(1000 * resp.stats.ttft_s, 1),
            first_clause_ms=ms(t.requested, t.first_clause),
            tts_first_audio_ms=ms(t.first_clause_synth_start, t.first_audio),
            voice_to_voice_ms=ms(turn.speech_end, now) if turn else None,
            cached_prompt_tokens=resp.stats.cached_tokens,
            prompt_tokens=resp.stats.prompt_tokens,
            speculative=bool(turn and turn.response is resp),
        )
        self.emit(timings)
        if self.metrics:
            self.metrics.observe_turn(timings)
            self.metrics.cache_hit_ratio.set(self.engines.llm.cache_hit_ratio)

    async def _watch_idle(self) -> None:
        """Close a session whose client went silent on the wire (no audio at all)."""
        limit = self.cfg.session.idle_timeout_s
        while True:
            idle = self._clock.monotonic() - self._last_input
            if idle >= limit and self._response is None:
                self.error("idle_timeout", f"no audio for {limit:g} s", fatal=True)
                return
            await self._clock.sleep(max(limit - idle, 0.05))  # wakes when it would expire

    # ----------------------------------------------------------------- partials
    async def _forward_partials(self) -> None:
        while True:
            stream = self._asr
            async for partial in stream:
                if self._item_id is not None and stream is self._asr:
                    self.emit(TranscriptPartial(self._item_id, partial.confirmed, partial.tentative))
                    self._warm_turn(partial.text)
            if stream is self._asr:
                return  # the session's own stream closed: the session is ending
            # A committed turn took that stream away (and closed it): follow the new one.
