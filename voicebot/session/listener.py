"""The caller's side of a call: audio in, resampled to 16 kHz, VAD, the turn detector,
streaming ASR and the decode of each turn's final transcript.

    audio in -> resample -> VAD -> turn detector -> signals to the call's core
                         -> streaming ASR -> partials; a turn's final transcript

It owns the input state (the backlog of audio still to process, the pre-speech ring,
the ASR stream, the turn timer); what a signal or a transcript means is the core's
decision (voicebot/core), which the call (:class:`Session`) runs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from voicebot.audio import ASR_RATE, Resampler, pcm16_to_float
from voicebot.config import VadConfig
from voicebot.core import events as ce
from voicebot.engines.contracts import AsrStream, Transcript
from voicebot.errors import BadAudio, VoicebotError
from voicebot.session.call import Call
from voicebot.session.events import SessionEvent, SpeechStarted, SpeechStopped, TranscriptFinal
from voicebot.session.turns import Signal, make_turn_detector

if TYPE_CHECKING:
    from voicebot.session.response import Response

_VAD_WINDOW_MS = 32.0
# Largest piece of input processed in one go (resample + VAD of 100 ms: well under a
# millisecond), so a big push never holds the loop for long.
_SLICE_MS = 100
_SIGNALS: dict[Signal, ce.Event] = {
    Signal.SPEECH_START: ce.SpeechStart(),
    Signal.QUIET: ce.Quiet(),
    Signal.PAUSE: ce.Pause(),
    Signal.RESUME: ce.Resume(),
    Signal.END: ce.TurnEnd(),
}


@dataclass
class Turn:
    """A user turn whose transcript is being (or has been) decoded."""

    item_id: str
    final: asyncio.Task[Transcript]
    asr_started: float
    asr_done: float | None = None
    speech_end: float | None = None  # wall clock of the last speech audio
    committed_at: float | None = None
    response: Response | None = None  # prepared for it speculatively


class ListenerCall(Call, Protocol):
    """What the listener uses of its call beside :class:`Call`."""

    def error(self, code: str, message: str, *, event_id: str | None = None, fatal: bool = False) -> None:
        """An error event to the client (``fatal``: the call ends)."""


class Listener:
    def __init__(self, call: ListenerCall) -> None:
        self.call = call
        self.cfg = call.cfg
        self.engines = call.engines
        self._clock = call.clock
        settings = call.settings
        self._vad = self.engines.vad.stream()
        self.asr: AsrStream = self.engines.asr.stream(language=settings.language)
        self.detector = make_turn_detector(settings.vad, self.engines.turn_model)
        self._watched_verdict: object = None  # the verdict _watch_verdict last hooked
        self._last_window_at = self._clock.monotonic()  # when audio last reached the detector
        self._turn_timer: asyncio.Task[None] | None = None  # _time_turn
        self._turn_timer_at = 0.0  # when it wakes next
        self._resamplers: dict[int, Resampler] = {}
        # Input waiting to be processed: audio slices and, in order with them, the
        # commits/clears that came after them. Bounded by max_input_backlog_s.
        self._backlog: deque[tuple[np.ndarray, int] | Callable[[], object]] = deque()
        self._backlog_s = 0.0
        self._drain_task: asyncio.Task[None] | None = None
        self._turn_streams: set[AsrStream] = set()  # committed turns' streams, still decoding
        self._ring: deque[np.ndarray] = deque()
        self._ring_samples = 0
        self._ring_max = self._ring_size(settings.vad)
        self._turn_open_at = 0.0
        self._last_speech_wall: float | None = None
        self._speech_end_asr_s: float | None = None
        self.turns: dict[str, Turn] = {}  # by item id, until their transcript is in
        # A turn opened over a paused reply, its speech events held until the core says it
        # is one (announce) or not (forget); a newer one replaces it, so at most one.
        self._unannounced: tuple[str, list[SpeechStarted | SpeechStopped]] | None = None
        # An ended turn whose end (and transcript) the client hears of only with its
        # reply's first audio: the core reveals it then, or reopens the turn (at most one).
        self._held_end: tuple[str, list[SessionEvent]] | None = None
        self.input_ms = 0.0
        self.last_input = self._clock.monotonic()

    # ------------------------------------------------------------------ commands
    def in_order(self, command: Callable[[], object]) -> None:
        """Run ``command`` after the audio sent before it (a commit or a clear)."""
        if self._backlog:  # audio sent before it is still being processed
            self._backlog.append(command)
        else:
            command()

    def drop_unprocessed(self) -> None:
        """Audio sent after the last queued commit is not processed at all."""
        while self._backlog and not callable(self._backlog[-1]):
            audio, rate = self._backlog.pop()  # type: ignore[misc]
            self._backlog_s = max(0.0, self._backlog_s - audio.size / rate)

    def update(self, vad: VadConfig) -> None:
        self.detector.cfg = vad
        # The pre-speech audio follows the new padding from now on (it was sized once,
        # at the start: an update was acknowledged and the ASR kept the old padding).
        self._ring_max = self._ring_size(vad)

    def request_partial(self) -> None:
        self.asr.request_partial(self._speech_end_asr_s)

    def start_final(self, item_id: str) -> None:
        turn = self._new_turn(item_id, self._spawn_final(self._speech_end_asr_s))
        if self.detector.paused:
            # A pause's own transcript: the end-of-turn policy weighs its words.
            token = self.detector.expect_words()
            turn.final.add_done_callback(lambda task: self._heard_words(token, task))

    def _heard_words(self, token: int, task: asyncio.Task[Transcript]) -> None:
        if task.cancelled() or task.exception() is not None or self.call.closing:
            return
        self.detector.hear_words(token, task.result().text)
        self._poll_turns()
        self._arm_turn_timer()  # the policy's wait may be shorter or longer now

    def cancel_final(self, item_id: str) -> None:
        turn = self.turns.pop(item_id, None)
        if turn is not None:
            turn.final.cancel()

    async def aclose(self) -> None:
        for stream in [self.asr, *self._turn_streams]:
            await stream.aclose()
        self._turn_streams.clear()

    # --------------------------------------------------------------------- input
    def push(self, audio: bytes | np.ndarray, sample_rate: int) -> None:
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
        self.last_input = self._clock.monotonic()
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
        if not running and self.call.started and not self.call.closing:
            self._drain_task = self.call.spawn(self._drain_input(), "input")

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
        if self.call.audio_tap is not None:
            self.call.audio_tap.caller(audio, self._clock.monotonic())
        if not self.call.settings.turn_detection:
            self.asr.push(audio)  # the client decides when the turn ends
            return
        self._remember(audio)
        self.detector.feed(audio)  # a semantic detector hears the turn's audio at pauses
        pushed = False
        bot_speaking = self.call.core.audible  # a reply the client was told of, not one still unheard
        for i, prob in enumerate(self._vad.process(audio)):
            if prob >= self.call.settings.vad.threshold and self.call.core.open_item is not None:
                self._last_speech_wall = self._clock.monotonic()
                # Where speech ends in the ASR buffer (up to one window late: safe).
                self._speech_end_asr_s = self.asr.buffered_s + (i + 1) * _VAD_WINDOW_MS / 1000
            for sig in self.detector.update(float(prob), _VAD_WINDOW_MS, bot_speaking):
                pushed |= self._on_signal(sig)
        self._watch_verdict()
        self._last_window_at = self._clock.monotonic()
        self._arm_turn_timer()
        # During a pause the speculative final already has the audio; decoding the
        # silence as partials would only compete with it and the LLM for the cores.
        if self.call.core.open_item is not None and not pushed and not self.detector.paused:
            self.asr.push(audio)
            if self._clock.monotonic() - self._turn_open_at > self.cfg.session.max_turn_s:
                for sig in self.detector.force_end():
                    self._on_signal(sig)

    def _watch_verdict(self) -> None:
        """The end-of-turn model answers on its own thread, maybe after the last audio
        window (a client that streamed faster than real time, or sends nothing at a
        pause): its answer is acted on when it comes, not only at the next window."""
        fut = self.detector.pending
        if fut is None or fut is self._watched_verdict:
            return
        self._watched_verdict = fut
        loop = asyncio.get_running_loop()

        def wake(_: object) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._poll_turns)

        fut.add_done_callback(wake)

    def _poll_turns(self, idle_ms: float | None = None) -> None:
        if self.call.closing:
            return
        if idle_ms is None:  # audio waiting in the backlog is not time without audio
            idle_ms = 0.0 if self._backlog else 1000 * (self._clock.monotonic() - self._last_window_at)
        for sig in self.detector.poll(idle_ms):
            self._on_signal(sig)
        self._watch_verdict()  # a check asked just now

    def _arm_turn_timer(self) -> None:
        if not self.call.started or self.call.closing:
            return
        due = self.detector.idle_deadline_ms()
        if due is None:
            return
        at = self._last_window_at + due / 1000
        timer = self._turn_timer
        if timer is not None and not timer.done():
            if at >= self._turn_timer_at - 0.001:
                return  # it wakes in time and reads the deadline again
            timer.cancel()  # the deadline came nearer (a pause began): wake sooner
        self._turn_timer_at = at
        self._turn_timer = self.call.spawn(self._time_turn(), "turn-timer")

    async def _time_turn(self) -> None:
        """The semantic cap is wall-clock time: a turn heard as unfinished ends
        ``smart_turn_max_silence_ms`` after its last speech even when the client sends
        nothing more (it counted silence frames received, so a client that stopped after
        its question was never answered). One task per open turn, sleeping until the
        detector's next deadline; audio that comes in the meantime moves the deadline
        (new speech restarts the count), and the task reads it again when it wakes."""
        while (due := self.detector.idle_deadline_ms()) is not None:
            idle = 1000 * (self._clock.monotonic() - self._last_window_at)
            if self._backlog or idle < due:
                wait = max(due - idle, 1.0) / 1000
                self._turn_timer_at = self._clock.monotonic() + wait
                await self._clock.sleep(wait)
                continue
            self._poll_turns(max(idle, due))
            if self.detector.idle_deadline_ms() == due:  # nothing moved: never spin
                await self._clock.sleep(_VAD_WINDOW_MS / 1000)

    def _remember(self, audio: np.ndarray) -> None:
        """Keep the last few hundred ms: the start of speech precedes its detection."""
        self._ring.append(audio)
        self._ring_samples += audio.size
        while self._ring_samples - self._ring[0].size >= self._ring_max:
            self._ring_samples -= self._ring.popleft().size

    def _on_signal(self, sig: Signal) -> bool:
        """Act on a turn signal; True if the current chunk went to ASR already."""
        self.call.feed(_SIGNALS[sig])
        return sig is Signal.SPEECH_START

    def open_turn(self, item_id: str, announce: bool = True) -> None:
        self._turn_open_at = self._clock.monotonic()
        self._last_speech_wall = self._clock.monotonic()
        self.asr.reset()
        self.asr.push(np.concatenate(self._ring))
        # Speech lasted at least to here (the window that started the turn is not counted
        # below): never a stale end of the previous turn's speech.
        self._speech_end_asr_s = self.asr.buffered_s
        started = SpeechStarted(audio_ms=int(self.input_ms), item_id=item_id)
        if announce:
            self.call.emit(started)
        else:
            self._unannounced = (item_id, [started])

    def end_turn(self, item_id: str, held: bool = False) -> None:
        turn = self.turns[item_id]
        turn.speech_end = self._last_speech_wall
        turn.committed_at = self._clock.monotonic()
        stopped = SpeechStopped(audio_ms=int(self.input_ms), item_id=item_id)
        if held and not (self._unannounced is not None and self._unannounced[0] == item_id):
            self._held_end = (item_id, [stopped])
        else:
            self._emit_or_hold(stopped)
        self.call.spawn(self._complete_turn(turn), "turn")

    def emit_end(self, event: TranscriptFinal) -> None:
        """A turn's transcript: held with its end while that is held."""
        if self._held_end is not None and self._held_end[0] == event.item_id:
            self._held_end[1].append(event)
        else:
            self._tell_end(event)

    def _tell_end(self, event: SessionEvent) -> None:
        self.call.emit(event)
        # A turn is counted once its transcript is told: a reopened one only at its real end.
        if isinstance(event, TranscriptFinal) and event.text and self.call.metrics:
            self.call.metrics.turns.inc()

    def reveal(self, item_id: str) -> None:
        """The held end of the turn (and its transcript, if in) goes to the client now."""
        if self._held_end is not None and self._held_end[0] == item_id:
            _, held = self._held_end
            self._held_end = None
            for event in held:
                self._tell_end(event)

    def reopen_turn(self, item_id: str) -> None:
        """The caller went on before hearing the reply: the turn is open again. Its audio
        stays in the ASR stream (the final covers all of it: one transcript); the speech
        now joins it after its pre-speech padding. The client never hears of the end."""
        if self._held_end is not None and self._held_end[0] == item_id:
            self._held_end = None
        if self.call.metrics:
            self.call.metrics.reopened_turns.inc()
        self.call.log.info("turn reopened: the caller went on before the reply was heard")
        self._last_speech_wall = self._clock.monotonic()
        self.asr.push(np.concatenate(self._ring))
        self._speech_end_asr_s = self.asr.buffered_s

    def _emit_or_hold(self, event: SpeechStopped) -> None:
        if self._unannounced is not None and self._unannounced[0] == event.item_id:
            self._unannounced[1].append(event)
        else:
            self.call.emit(event)

    def announce(self, item_id: str) -> None:
        """The speech over the paused reply is a turn: its held events go out now."""
        if self._unannounced is not None and self._unannounced[0] == item_id:
            _, held = self._unannounced
            self._unannounced = None
            for event in held:
                self.call.emit(event)

    def forget(self, item_id: str) -> None:
        """It was no turn: the client never hears of it, nor does this caller's pause
        history (speech soon after it is no caller going on after an end of turn)."""
        if self._unannounced is not None and self._unannounced[0] == item_id:
            self._unannounced = None
        self.detector.forget_turn_end()

    def _new_turn(self, item_id: str, final: asyncio.Task[Transcript]) -> Turn:
        turn = Turn(item_id, final, asr_started=self._clock.monotonic())
        # When the transcript is ready, not when the committed turn reads it (after END:
        # a speculative final may wait there for Smart Turn's cap; tests/session/test_asr_final_timing.py).
        final.add_done_callback(lambda _: setattr(turn, "asr_done", self._clock.monotonic()))
        self.turns[item_id] = turn
        return turn

    def _spawn_final(self, covering_s: float | None = None, stream: AsrStream | None = None) -> asyncio.Task[Transcript]:
        return self.call.spawn(self._final(covering_s, stream), "final", guard=False)

    async def _final(self, covering_s: float | None, stream: AsrStream | None = None) -> Transcript:
        """The final transcript of the session's stream, or of ``stream`` (a committed
        turn's own, closed once decoded)."""
        # A failed decode must not take the session's TaskGroup (and the call) down:
        # it is reported, and the turn goes on as one with nothing said.
        try:
            return await (stream or self.asr).finalize(covering_s)
        except VoicebotError as exc:
            self.call.error(exc.code, str(exc))
        except Exception as exc:
            self.call.log.exception("final transcript failed")
            self.call.error("engine_error", f"ASR failed: {exc}")
        finally:
            if stream is not None:
                await stream.aclose()
                self._turn_streams.discard(stream)
        return Transcript("", 0.0, 0.0)

    async def _complete_turn(self, turn: Turn) -> None:
        transcript = await turn.final
        try:
            self.call.feed(ce.Transcribed(turn.item_id, transcript.text))
        finally:
            if self.turns.get(turn.item_id) is turn:  # a reopened turn has a new one by now
                self.turns.pop(turn.item_id, None)

    def commit(self, item_id: str) -> None:
        # The turn's audio leaves with its own stream; a fresh one takes what follows.
        stream, self.asr = self.asr, self.engines.asr.stream(language=self.call.settings.language)
        self._turn_streams.add(stream)  # closed by its final, or at teardown
        turn = self._new_turn(item_id, self._spawn_final(stream=stream))
        turn.speech_end = turn.committed_at = self._clock.monotonic()
        self.call.spawn(self._complete_turn(turn), "commit")

    @staticmethod
    def _ring_size(vad: VadConfig) -> int:
        """Samples of audio kept from before speech starts: the padding the ASR gets, and
        the speech a barge-in needs before it counts, with a margin."""
        return int((vad.prefix_padding_ms + vad.barge_in_min_ms + 100) * ASR_RATE / 1000)

    async def forward_partials(self) -> None:
        while True:
            stream = self.asr
            async for partial in stream:
                if stream is self.asr:
                    self.detector.hear_partial(partial.text)
                    self.call.feed(ce.Partial(partial.text, partial.confirmed, partial.tentative))
            if stream is self.asr:
                return  # the session's own stream closed: the session is ending
            # A committed turn took that stream away (and closed it): follow the new one.
