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
import logging
import uuid
from collections.abc import Mapping

import numpy as np

from voicebot.affinity import bind_session
from voicebot.config import Config
from voicebot.core import CallCore
from voicebot.core import events as ce
from voicebot.engines import Engines
from voicebot.engines.asr import AsrStream
from voicebot.engines.llm import Lane
from voicebot.engines.tokenizer_thread import run_tokenizer
from voicebot.errors import BadMessage, VoicebotError
from voicebot.metrics import Metrics
from voicebot.session.capabilities import keeps_background_prefills
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
    ToolResult,
    TranscriptFinal,
    TranscriptPartial,
    TurnTimings,
)
from voicebot.session.history import Conversation, Message
from voicebot.session.listener import Listener, Turn
from voicebot.session.outbox import Outbox
from voicebot.session.playout import Playout
from voicebot.session.response import Delta, Response, ResponseOptions
from voicebot.session.settings import SessionSettings
from voicebot.session.text_only import TextOnlyTts
from voicebot.tools.session_tools import SessionTools
from voicebot.tools.spec import ToolChoice, ToolSpec

log = logging.getLogger(__name__)

_FRAME_MS = 20


class SessionLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):  # type: ignore[no-untyped-def]
        return f"[{self.extra['session']}] {msg}", kwargs  # type: ignore[index]


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
            prefills=keeps_background_prefills(cfg.llm),
            summaries=cfg.llm.background_concurrency > 0,
            block_size=lambda: self.engines.llm.block_size,
            log=self.log,
        )
        self._replies: dict[str, Response] = {}  # the live reply, and one being stopped
        self._reply_tasks: dict[str, asyncio.Task[None]] = {}
        self._reply_turns: dict[str, Turn] = {}  # the user turn each reply answers
        self._reply_ends: dict[str, tuple[int, str]] = {}  # played ms and heard text, until reported
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
        # The one background LLM job of each kind the core started, by its number.
        self._prefill: tuple[int, asyncio.Task[None]] | None = None
        self._summary: tuple[int, asyncio.Task[None]] | None = None
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
                self._spawn(self.listener.forward_partials(), "partials")
                self._spawn(self._watch_idle(), "idle")
                self._feed(ce.Started())
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
            self._feed(ce.CancelReply(report=False))
            await self.listener.aclose()
        finally:
            if self._counted and self.metrics:
                self.metrics.active_sessions.labels(self.transport).dec()
            self.log.info("session closed (%s)", self.closed_reason)

    def _end(self) -> None:
        """The call is ending: nothing new starts."""
        if not self._closing.is_set():
            self._closing.set()
            self.core.handle(ce.Closing(), self._clock.monotonic())

    def _feed(self, event: ce.Event) -> list[ce.Action]:
        """Tell the core what happened and run what it decides, in order."""
        actions = self.core.handle(event, self._clock.monotonic())
        for action in actions:
            self._act(action)
        return actions

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

    @property
    def _asr(self) -> AsrStream:
        return self.listener.asr

    def _transcribed(self, item_id: str, text: str) -> None:
        self.emit(TranscriptFinal(item_id=item_id, text=text))
        if text and self.metrics:
            self.metrics.turns.inc()

    # ----------------------------------------------------------------- commands
    def commit_input(self) -> str:
        """Client-side turn end (turn detection off): transcribe what was sent.

        The turn takes the audio sent before the commit; what is sent after it, even
        while this turn is still being transcribed, is the start of the next turn.
        """
        item_id = self.core.new_item_id()
        self.listener.in_order(lambda: self._feed(ce.Commit(item_id)))
        return item_id

    def clear_input(self) -> None:
        self.listener.drop_unprocessed()
        self.listener.in_order(lambda: self._feed(ce.Clear()))

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
        self._feed(ce.AddItem(role, text, item_id))
        return item_id

    def create_response(self, options: ResponseOptions | None = None) -> str:
        """Reply now; ``options``: this reply's own instructions / tools / tool_choice /
        max_tokens (a Realtime ``response.create`` override)."""
        if options is not None:
            self.tools.plan(options)  # a tool_choice naming no declared tool: refused here
        started = self._feed(ce.CreateReply(options))[-1]
        assert isinstance(started, ce.StartReply)
        return started.reply_id

    # -------------------------------------------------------------------- tools
    def set_tools(self, tools: list[ToolSpec] | None = None, choice: ToolChoice | None = None) -> None:
        """A client's ``session.tools`` / ``tool_choice`` (None: unchanged)."""
        self.tools.set(tools, choice)
        self.conversation.set_tools(self.tools.chat_tools())
        self._feed(ce.ContextChanged())

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        """A client's result of a function call (Realtime ``function_call_output``)."""
        item_id = item_id or self.core.new_item_id()
        self._feed(ce.AddItem("tool", self.tools.clip(output), item_id, call_id=call_id))
        return item_id

    def add_tool_call(self, call_id: str, name: str, arguments: dict[str, object], item_id: str | None = None) -> str:
        """A function call a client adds to the history itself (Realtime ``function_call`` item)."""
        item_id = item_id or self.core.new_item_id()
        self._feed(ce.AddItem("assistant", "", item_id, call_id, ({"name": name, "arguments": arguments},)))
        return item_id

    def cancel_response(self) -> bool:
        if self.core.reply is None:
            return False
        self._feed(ce.CancelReply())
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
        self.listener.update(new.vad)
        self.conversation.reply_tokens = new.max_tokens
        self._feed(ce.SettingsChanged(new.create_response, new.interrupt_response))

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
            case ce.OpenTurn(item_id):
                self.listener.open_turn(item_id)
            case ce.RequestPartial():
                # Decode now, unless a partial that saw the speech to its end is decoded
                # or decoding: it becomes the final (tests/test_turns_partials.py).
                self.listener.request_partial()
            case ce.EmitPartial(item_id, confirmed, tentative):
                self.emit(TranscriptPartial(item_id, confirmed, tentative))
            case ce.StartFinal(item_id):
                self.listener.start_final(item_id)
            case ce.CancelFinal(item_id):
                self.listener.cancel_final(item_id)
            case ce.EndTurn(item_id):
                self.listener.end_turn(item_id)
            case ce.CommitTurn(item_id):
                self.listener.commit(item_id)
            case ce.ResetInput():
                self.listener.asr.reset()
            case ce.TurnTranscribed(item_id, text):
                self._transcribed(item_id, text)
            case ce.StartReply():
                self._start_response(action)
            case ce.ReleaseReply(reply_id):
                self._release(self._replies[reply_id])
            case ce.StopReply(reply_id, status, report):
                self._stop_response(reply_id, status, report)
            case ce.ReportReply(reply_id, status):
                self._report_done(reply_id, status)
            case ce.StartPrefill():
                self._prefill = (action.prefill, self._spawn(self._warm(action), "warm"))
            case ce.CancelPrefill(pid):
                if self._prefill is not None and self._prefill[0] == pid:
                    self._prefill[1].cancel()
                    self._prefill = None
            case ce.StartSummary():
                self._summary = (action.summary, self._spawn(self._summarise(action), "summary"))
            case ce.CancelSummary(sid):
                if self._summary is not None and self._summary[0] == sid:
                    self._summary[1].cancel()
                    self._summary = None

    # ------------------------------------------------------------------ replies
    @property
    def _response(self) -> Response | None:
        """The live reply."""
        live = self.core.reply
        return None if live is None else self._replies.get(live.id)

    def _start_response(self, start: ce.StartReply) -> None:
        turn = self.listener.turns.get(start.turn) if start.turn is not None else None
        s = self.settings
        options = start.options or ResponseOptions()
        last = self.conversation.messages[-1] if self.conversation.messages else None
        plan = self.tools.plan(options, start.tool_round,
                               after_result=turn is None and last is not None and last.role == "tool")
        resp = Response(
            start.reply_id,
            start.item_id,
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
            gated=start.gated,
            output_rate=s.output_sample_rate,
            clock=self._clock,
            on_audio=self._wake.set,
            tool_stream=plan.stream,
            constraint=plan.constraint,
            options=options,
            tool_round=start.tool_round,
        )
        resp.prompt_tools, resp.tool_choice = plan.prompt_tools, plan.choice
        self._replies[resp.id] = resp
        if turn is not None:
            self._reply_turns[resp.id] = turn
            if start.gated:
                turn.response = resp
        self._reply_tasks[resp.id] = self._spawn(self._drive(resp, turn), "response")
        if not start.gated:
            self._release(resp)

    def _release(self, resp: Response) -> None:
        resp.release()
        self._wake.set()

    async def _drive(self, resp: Response, turn: Turn | None) -> None:
        results: list[str] | None = None  # server tools' results, when the reply called them
        try:
            if turn is not None:
                # shield: this reply being cancelled must not cancel the turn's transcript.
                transcript = await asyncio.shield(turn.final)
                if not transcript.text.strip():
                    return  # the turn's transcript ends it (noise)
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
                    self._reply_ended(resp, ce.ReplyEnded(resp.id, "failed"))
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
        self._feed(ce.ToolResults(resp.id, resp.options, resp.tool_round))

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

    def _stop_response(self, reply_id: str, status: str, report: bool) -> None:
        """Cancel a reply's work; ``report``: it was heard, and is reported cut short."""
        resp = self._replies.get(reply_id)
        if resp is None:  # its start failed
            self._feed(ce.ReplyEnded(reply_id, status))
            return
        task = self._reply_tasks.get(reply_id)
        if task is not None:
            task.cancel()  # aborts the vLLM request and pending TTS
        if not report:
            self._reply_ended(resp, ce.ReplyEnded(reply_id, status))
            return
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

    def _finish(self, resp: Response, status: str) -> None:
        """A reply the caller was told of ends: the core keeps what was heard of it."""
        rate = resp.playout.sample_rate
        if status == "completed":
            played = resp.playout.taken
        elif self._played_override is not None:
            played = int(self._played_override * rate / 1000)
        else:
            # The client holds up to the lead in its buffer: that part was not heard.
            lead = int(self.cfg.session.playout_lead_ms * rate / 1000)
            played = max(0, resp.playout.taken - lead)
        self._played_override = None
        heard = resp.playout.heard_text(played) if status != "completed" else resp.full_text
        self._heard[resp.item_id] = resp.playout
        while len(self._heard) > 4:  # only recent replies can still be truncated
            self._heard.pop(next(iter(self._heard)))
        self._reply_ends[resp.id] = (1000 * played // rate, heard)
        # A reply played in full is stored as the tokens the model produced (tool-call
        # markup included): the next prompt then reuses its KV blocks from the prefix
        # cache as well. A reply cut short keeps what was heard, and no call.
        completed = status == "completed"
        computed = None
        if resp.stats.first_token_at is not None:
            # Its request left its prompt and all but its last token in the cache.
            computed = tuple(resp.prompt_ids + resp.token_ids[:-1])
        self._reply_ended(resp, ce.ReplyEnded(
            resp.id, status, resp.raw_text if completed else heard,
            tuple(resp.token_ids) if completed else None, computed,
        ))

    def _reply_ended(self, resp: Response, ended: ce.ReplyEnded) -> None:
        try:
            self._feed(ended)
        finally:
            self._replies.pop(resp.id, None)
            self._reply_tasks.pop(resp.id, None)
            self._reply_turns.pop(resp.id, None)
            self._reply_ends.pop(resp.id, None)

    def _report_done(self, reply_id: str, status: str) -> None:
        resp = self._replies[reply_id]
        played_ms, heard = self._reply_ends[reply_id]
        if status == "interrupted":
            self.emit(BargeIn(resp.id, played_ms, heard))
        st = resp.stats
        if self.metrics:
            self.metrics.count_tokens(st.prompt_tokens, st.cached_tokens)
        completed = status == "completed"
        self.emit(
            ResponseDone(
                resp.id, resp.item_id, status, heard, resp.full_text, played_ms,  # type: ignore[arg-type]
                st.finish_reason, st.prompt_tokens, st.output_tokens,
                tuple(resp.tool_calls) if completed else (), st.cached_tokens,
            )
        )

    # --------------------------------------------------------- background work
    async def _warm(self, start: ce.StartPrefill) -> None:
        """Prefill the conversation so far (llm.warm_prefix) at background priority, so
        the next turn's prompt finds those blocks in the prefix cache and prefills only
        what is new; in pieces (llm.warm_piece_tokens) from what is cached already.
        Background work is invisible to the caller: a failure is logged, never an error
        event. Cancellation (a reply started, the call ended) propagates."""
        pid, ids = start.prefill, list(start.ids)

        def cached(end: int) -> None:  # a piece is in: a retry after a live turn starts there
            self._feed(ce.PrefillProgress(pid, end))

        ok = True
        try:
            await self.engines.llm.warm(ids, cached=start.cached, on_piece=cached)
        except Exception as exc:
            self.log.warning("prefilling the conversation (%d tokens) failed: %s", len(ids), exc)
            ok = False
        if self._prefill is not None and self._prefill[0] == pid:
            self._prefill = None
        self._feed(ce.PrefillDone(pid, ok))

    async def _summarise(self, start: ce.StartSummary) -> None:
        """Summarise dropped turns at background priority. A failed summary is logged
        and its turns dropped unsummarised, never an error event. Cancellation (the
        hard trim took over, the call ended) propagates."""
        messages = list(start.messages)
        try:
            text: str | None = await self._summary_of(messages, start.earlier)
        except Exception as exc:
            self.log.warning("summary of %d dropped messages failed, dropped: %s", len(messages), exc)
            text = None
        if self._summary is not None and self._summary[0] == start.summary:
            self._summary = None
        self._feed(ce.SummaryDone(start.summary, text))

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
        turn = self._reply_turns.get(resp.id) if self._response is resp else None

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
            idle = self._clock.monotonic() - self.listener.last_input
            if idle >= limit and self.core.reply is None:
                self.error("idle_timeout", f"no audio for {limit:g} s", fatal=True)
                return
            await self._clock.sleep(max(limit - idle, 0.05))  # wakes when it would expire

