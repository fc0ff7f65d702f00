"""One call: the per-session state machine that every transport drives.

    audio in -> resample to 16 kHz -> VAD -> turn detector -> streaming ASR
      -> end of turn -> LLM (interactive lane) -> clauses -> TTS -> playout, paced

States: listening -> user speaking -> thinking -> speaking -> listening. The session
owns all its tasks in one TaskGroup (nothing it starts outlives it) and its outbox;
transports only translate wire messages to the methods below and
:class:`SessionEvent` back to wire.

What to do when is decided by the call's core (voicebot/core: turn-taking, the live
reply, the budget, background work), which this class feeds with what happens and
whose actions it runs through its parts: the :class:`Listener` (audio in, VAD, turn
detector, ASR), the :class:`Speaker` (the live reply and the one pacer) and
:class:`BackgroundWork` (prefills and summaries).

Speculation: when the user pauses (``vad.speculative_silence_ms``) the final
transcript is decoded and the reply is generated *gated*; when the pause becomes the
end of the turn (``vad.min_silence_ms``) the gate opens, so the endpointing wait
overlaps ASR, LLM and TTS. If the user goes on, the speculation is cancelled (the vLLM
request aborted).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TextIO

import numpy as np

from voicebot.affinity import bind_session
from voicebot.config import Config, VadConfig
from voicebot.core import CallCore, replay
from voicebot.core import events as ce
from voicebot.core.backchannel import FalseInterruptions
from voicebot.engines.registry import Engines
from voicebot.errors import BadMessage, VoicebotError
from voicebot.metrics import Metrics
from voicebot.session.background import BackgroundWork
from voicebot.session.clock import REAL_CLOCK, Clock
from voicebot.session.events import (
    ErrorEvent,
    ReplyTruncated,
    SessionEvent,
    TranscriptFinal,
    TranscriptPartial,
)
from voicebot.session.history import Conversation, Message
from voicebot.session.listener import Listener
from voicebot.session.observer import NO_OBSERVER, AudioTap, CallObserver
from voicebot.session.outbox import Outbox
from voicebot.session.response import ResponseOptions
from voicebot.session.settings import SessionSettings
from voicebot.session.speaker import Speaker
from voicebot.tools.session_tools import SessionTools
from voicebot.tools.spec import ToolChoice, ToolSpec

log = logging.getLogger(__name__)

_FRAME_MS = 20


class SessionLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        # The id also as a field: JSON logs carry it as call_id (voicebot/observe/logs.py).
        kwargs["extra"] = {**kwargs.get("extra", {}), "call_id": self.extra["session"]}  # type: ignore[index]
        return f"[{self.extra['session']}] {msg}", kwargs  # type: ignore[index]


def false_interruptions(vad: VadConfig) -> FalseInterruptions | None:
    """What speech over a reply may be and still resume it (None: it cuts the reply)."""
    if not vad.resume_false_interruption:
        return None
    return FalseInterruptions.of(vad.backchannel_words, hums=vad.backchannel_hums, max_words=vad.backchannel_max_words,
                                 max_speech_s=vad.backchannel_max_ms / 1000,
                                 speech_before_s=vad.barge_in_min_ms / 1000)


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


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
        observer: CallObserver | None = None,
    ) -> None:
        cfg: Config = engines.cfg
        self.cfg = cfg
        self.engines = engines
        self.settings = settings or SessionSettings.from_config(cfg)
        self._check_voice(self.settings.voice)
        self.id = session_id or f"sess_{uuid.uuid4().hex[:12]}"
        self.transport = transport
        self.metrics = metrics
        self.clock: Clock = clock or REAL_CLOCK
        self.log = SessionLog(log, {"session": self.id})
        # Who watches the call (traces, its record, the webhook: voicebot/observe).
        self.observer: CallObserver = observer or NO_OBSERVER
        # Where its audio goes, frame by frame, when the call is recorded (else None).
        self.audio_tap: AudioTap | None = self.observer.audio_tap()
        # Control events are few; audio frames are paced at 50/s. A client that stops
        # reading for out_queue_frames events is dropped instead of growing memory.
        self.outbox: Outbox[SessionEvent] = Outbox(cfg.session.out_queue_frames)
        # The caller's audio, VAD, turn detector and ASR (voicebot/session/listener.py).
        self.listener = Listener(self)
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
        # The call's decisions (turns, the live reply, the budget, background work):
        # this class runs what it decides (voicebot/core).
        self.core = CallCore(
            self.conversation,
            tag=self.id[5:],
            create_response=self.settings.create_response,
            interrupt_response=self.settings.interrupt_response,
            warm_turn=cfg.llm.warm_turn,
            # Background prefills only where a prefix cache keeps what they compute.
            prefills=cfg.llm.warm_prefix and cfg.llm.background_concurrency > 0 and engines.llm.keeps_prefills,
            summaries=cfg.llm.background_concurrency > 0,
            block_size=lambda: self.engines.llm.block_size,
            false_interruptions=false_interruptions(self.settings.vad),
            reopen_unheard=self.settings.vad.withdraw_unheard_reply,
            log=self.log,
        )
        # The live reply and the pacer (voicebot/session/speaker.py), background LLM work.
        self.speaker = Speaker(self)
        self.background = BackgroundWork(self)
        self._tasks: set[asyncio.Task[object]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._main: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._ready = asyncio.Event()
        self._counted = False  # in the active-sessions gauge
        self._torn_down = False
        # The core's input as JSON lines (session.record, voicebot/core/replay.py).
        self._record: TextIO | None = None
        if cfg.session.record:
            self._record = open(cfg.session.record.replace("{session}", self.id), "a", encoding="utf-8")  # noqa: SIM115
            self._record.write(replay.header(self.core, cfg.session.history_tokens) + "\n")
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
                self.spawn(self.speaker.pace(), "pacer")
                self.spawn(self.listener.forward_partials(), "partials")
                self.spawn(self._watch_idle(), "idle")
                self.observer.started(self.id, self.transport, self.clock.monotonic())
                self.feed(ce.Started())
                self._ready.set()
                await self._closing.wait()
                for task in list(self._tasks):
                    task.cancel()
        finally:
            self._end()  # events() ends even if the group failed
            await self._teardown()

    async def aclose(self, reason: str = "closed") -> None:
        """End the session (if it is not over already) and wait for its teardown."""
        self.closed_reason = self.closed_reason or reason
        self._end()
        if self._main is not None and not self._main.done():
            await self._main
        await self._teardown()  # a no-op when _run did it; here if it never ran

    async def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        try:
            self.feed(ce.CancelReply(report=False))
            await self.listener.aclose()
        finally:
            record, self._record = self._record, None
            if record is not None:
                record.close()
            if self._counted and self.metrics:
                self.metrics.active_sessions.labels(self.transport).dec()
            self.observer.ended(self.closed_reason or "closed", self.clock.monotonic())
            self.log.info("session closed (%s)", self.closed_reason)

    def _end(self) -> None:
        """The call is ending: nothing new starts."""
        if not self._closing.is_set():
            self._closing.set()
            self.feed(ce.Closing())

    # ------------------------------------------------- for the call's parts and its tests
    @property
    def started(self) -> bool:
        """Its tasks can be spawned (the task group runs)."""
        return self._tg is not None

    @property
    def closing(self) -> bool:
        """Asked to close (or closing by itself): no new work is taken on."""
        return self._closing.is_set()

    @property
    def ended(self) -> bool:
        """Torn down: its main task has finished."""
        return self._main is not None and self._main.done()

    def feed(self, event: ce.Event) -> list[ce.Action]:
        """Tell the core what happened and run what it decides, in order."""
        now = self.clock.monotonic()
        if self._record is not None:
            self._record.write(replay.line(event, now) + "\n")
        actions = self.core.handle(event, now)
        for action in actions:
            self._act(action)
        return actions

    def spawn(self, coro, name: str, *, guard: bool = True) -> asyncio.Task:  # type: ignore[no-untyped-def]
        """Run ``coro`` in the call's task group, cancelled at close like every other task.
        ``guard``: an error in it becomes an error event (off for a task whose result is awaited)."""
        assert self._tg is not None, "session not started"
        task = self._tg.create_task(self._guard(coro) if guard else coro, name=f"{self.id}-{name}")
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
            get = asyncio.ensure_future(self.outbox.get())
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                done, _ = await asyncio.wait({get, closing}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closing.cancel()
                if not get.done():
                    get.cancel()
            if get in done and not get.cancelled():
                yield get.result()
            elif self.outbox.empty():
                return

    def emit(self, event: SessionEvent) -> None:
        self.observer.event(event, self.clock.monotonic())
        try:
            self.outbox.put_nowait(event)
        except asyncio.QueueFull:
            # Once: every later event of a closing session lands here too.
            if self.closed_reason is None:
                self.log.warning("client is not reading events; closing")
                self.closed_reason = "slow_consumer"
            self._end()

    def error(self, code: str, message: str, *, event_id: str | None = None, fatal: bool = False) -> None:
        if self.metrics:
            self.metrics.errors.labels(code).inc()
        self.emit(ErrorEvent(code=code, message=message, event_id=event_id, fatal=fatal))
        if fatal:
            self.closed_reason = code
            self._end()

    # --------------------------------------------------------------------- input
    def push_audio(self, audio: bytes | np.ndarray, sample_rate: int) -> None:
        """Caller audio: PCM16 bytes or float32 samples, mono, any rate (:meth:`Listener.push`)."""
        self.listener.push(audio, sample_rate)

    @property
    def input_ms(self) -> float:
        """Caller audio received so far, at 16 kHz."""
        return self.listener.input_ms

    @input_ms.setter
    def input_ms(self, value: float) -> None:
        self.listener.input_ms = value

    def _transcribed(self, item_id: str, text: str) -> None:
        self.listener.emit_end(TranscriptFinal(item_id=item_id, text=text))

    def describe(self, **fields: str) -> None:
        """What the transport knows of the call (the carrier's ids, the numbers), for
        its record and trace; empty values are left out."""
        self.observer.details({k: v for k, v in fields.items() if v})

    # ----------------------------------------------------------------- commands
    def commit_input(self) -> str:
        """Client-side turn end (turn detection off): transcribe what was sent.

        The turn takes the audio sent before the commit; what is sent after it, even
        while this turn is still being transcribed, is the start of the next turn.
        """
        item_id = self.core.new_item_id()
        self.listener.in_order(lambda: self.feed(ce.Commit(item_id)))
        return item_id

    def clear_input(self) -> None:
        self.listener.drop_unprocessed()
        self.listener.in_order(lambda: self.feed(ce.Clear()))

    def add_text(self, role: str, text: str, item_id: str | None = None) -> str:
        item_id = item_id or self.core.new_item_id()
        if role not in ("user", "assistant", "system"):
            raise BadMessage(f"unsupported role {role!r}", code="invalid_value")
        limit = self.cfg.session.max_text_chars
        if len(text) > limit:
            raise BadMessage(
                f"text of {len(text)} characters is longer than session.max_text_chars ({limit})",
                code="text_too_long",
            )
        self.feed(ce.AddItem(role, text, item_id))
        return item_id

    def create_response(self, options: ResponseOptions | None = None) -> str:
        """Reply now; ``options``: this reply's own instructions / tools / tool_choice /
        max_tokens (a Realtime ``response.create`` override)."""
        if options is not None:
            self.tools.plan(options)  # a tool_choice naming no declared tool: refused here
        started = self.feed(ce.CreateReply(options))[-1]
        assert isinstance(started, ce.StartReply)
        return started.reply_id

    # -------------------------------------------------------------------- tools
    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        """A client's ``session.tools`` / ``tool_choice`` (None: unchanged)."""
        self.tools.set(tools, choice)
        self.conversation.set_tools(self.tools.chat_tools())
        self.feed(ce.ContextChanged())

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        """A client's result of a function call (Realtime ``function_call_output``)."""
        item_id = item_id or self.core.new_item_id()
        self.feed(ce.AddItem("tool", self.tools.clip(output), item_id, call_id=call_id))
        return item_id

    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object], item_id: str | None = None) -> str:
        """A function call a client adds to the history itself (Realtime ``function_call`` item)."""
        item_id = item_id or self.core.new_item_id()
        self.feed(ce.AddItem("assistant", "", item_id, call_id, ({"name": name, "arguments": arguments},)))
        return item_id

    def cancel_response(self) -> bool:
        if self.core.reply is None:
            return False
        self.feed(ce.CancelReply())
        return True

    def truncate(self, item_id: str, audio_end_ms: int) -> str | None:
        """The client heard ``audio_end_ms`` of reply ``item_id``: keep only that."""
        recent = self.speaker.heard.get(item_id)
        if recent is None:
            return None
        response_id, playout = recent
        played_ms = min(audio_end_ms, 1000 * playout.taken // playout.sample_rate)
        heard = playout.heard_text(int(played_ms * playout.sample_rate / 1000))
        self.conversation.replace(item_id, heard)
        # The call's record and audio keep what was heard, as after a barge-in.
        self.observer.event(ReplyTruncated(response_id, item_id, played_ms, heard), self.clock.monotonic())
        return heard

    def set_played(self, ms: int) -> None:
        """A transport that knows how much reply audio was really played says so."""
        self.speaker.played_override = ms

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
        self.listener.update(new.vad)
        self.conversation.reply_tokens = new.max_tokens
        self.feed(ce.SettingsChanged(new.create_response, new.interrupt_response))

    @property
    def replying(self) -> bool:
        """A reply is being spoken: released to the caller and not finished (a drain
        lets it finish)."""
        return self.core.replying

    def item_history(self) -> list[Message]:
        return list(self.conversation.messages)

    # ------------------------------------------------------------------ actions
    def _act(self, action: ce.Action) -> None:  # noqa: C901 (one case per action)
        match action:
            case ce.OpenTurn(item_id, announce):
                self.listener.open_turn(item_id, announce)
            case ce.AnnounceTurn(item_id):
                self.listener.announce(item_id)
            case ce.ForgetTurn(item_id):
                self.listener.forget(item_id)
            case ce.RequestPartial():
                # Decode now, unless a partial that saw the speech to its end is decoded
                # or decoding: it becomes the final (tests/session/test_turns_partials.py).
                self.listener.request_partial()
            case ce.EmitPartial(item_id, confirmed, tentative):
                self.emit(TranscriptPartial(item_id, confirmed, tentative))
            case ce.StartFinal(item_id):
                self.listener.start_final(item_id)
            case ce.CancelFinal(item_id):
                self.listener.cancel_final(item_id)
            case ce.EndTurn(item_id, held):
                self.listener.end_turn(item_id, held)
            case ce.RevealTurn(item_id):
                self.listener.reveal(item_id)
            case ce.ReopenTurn(item_id):
                self.listener.reopen_turn(item_id)
            case ce.CommitTurn(item_id):
                self.listener.commit(item_id)
            case ce.ResetInput():
                self.listener.asr.reset()
            case ce.TurnTranscribed(item_id, text):
                self._transcribed(item_id, text)
            case ce.StartReply():
                self.speaker.start(action)
            case ce.ReleaseReply(reply_id):
                self.speaker.release(self.speaker.replies[reply_id])
            case ce.PauseReply(reply_id):
                self.speaker.pause(reply_id)
            case ce.ResumeReply(reply_id):
                self.speaker.resume(reply_id)
            case ce.StopReply(reply_id, status, report):
                self.speaker.stop(reply_id, status, report)
            case ce.ReportReply(reply_id, status):
                self.speaker.report_done(reply_id, status)
            case ce.StartPrefill():
                self.background.start_prefill(action)
            case ce.CancelPrefill(pid):
                self.background.cancel_prefill(pid)
            case ce.StartSummary():
                self.background.start_summary(action)
            case ce.CancelSummary(sid):
                self.background.cancel_summary(sid)
            case ce.WakeAt(at):
                self.background.wake_at(at)

    # ------------------------------------------------------------------ idle
    async def _watch_idle(self) -> None:
        """Close a session whose client went silent on the wire (no audio at all)."""
        limit = self.cfg.session.idle_timeout_s
        while True:
            idle = self.clock.monotonic() - self.listener.last_input
            if idle >= limit and self.core.reply is None:
                self.error("idle_timeout", f"no audio for {limit:g} s", fatal=True)
                return
            await self.clock.sleep(max(limit - idle, 0.05))  # wakes when it would expire

