"""The call's side that speaks: the live reply (and one being stopped), from its
start to what the caller heard of it, and the one pacer that sends its audio.

Which reply is live, when it is released or stopped, and what the history keeps of it
are the core's decisions (voicebot/core); this runs them: each reply's task (LLM ->
clauses -> TTS -> playout, then its server tools), its text events, and the audio in
20 ms frames in real time, ``session.playout_lead_ms`` ahead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from voicebot.core import events as ce
from voicebot.session.call import Call
from voicebot.session.events import (
    BargeIn,
    ResponseAudio,
    ResponseAudioStarted,
    ResponseDone,
    ResponseStarted,
    ResponseTextDelta,
    SessionEvent,
    ToolResult,
    TurnTimings,
)
from voicebot.session.listener import Listener, Turn
from voicebot.session.observer import CallObserver, TurnStages
from voicebot.session.playout import Playout
from voicebot.session.response import Delta, Response, ResponseOptions
from voicebot.session.text_only import TextOnlyTts
from voicebot.tools.spec import ToolChoice

if TYPE_CHECKING:
    from voicebot.session.history import Conversation
    from voicebot.session.outbox import Outbox
    from voicebot.tools.session_tools import SessionTools

_FRAME_MS = 20


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Until the first of ``waits`` ends (its error raised here); the others are cancelled."""
    tasks = {asyncio.ensure_future(w) for w in waits}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
    for t in done:
        t.result()


class SpeakerCall(Call, Protocol):
    """What the speaker uses of its call beside :class:`Call`: the conversation a reply is
    prompted with and written to, the outbox its audio is paced into, the call's tools, its
    observer and the listener's turns."""

    @property
    def conversation(self) -> Conversation: ...
    @property
    def outbox(self) -> Outbox[SessionEvent]: ...
    @property
    def tools(self) -> SessionTools: ...
    @property
    def observer(self) -> CallObserver: ...
    @property
    def listener(self) -> Listener: ...

    def add_tool_result(self, call_id: str, output: str, item_id: str | None = None) -> str:
        """A tool's result into the conversation; its item id."""


class Speaker:
    def __init__(self, call: SpeakerCall) -> None:
        self.call = call
        self.cfg = call.cfg
        self.engines = call.engines
        self._clock = call.clock
        self.replies: dict[str, Response] = {}  # the live reply, and one being stopped
        self._reply_tasks: dict[str, asyncio.Task[None]] = {}
        self._reply_turns: dict[str, Turn] = {}  # the user turn each reply answers
        self._reply_ends: dict[str, tuple[int, str]] = {}  # played ms and heard text, until reported
        self._wake = asyncio.Event()  # pacer: a response was released or got audio
        # What a transport says was really played of the live reply (set_played), in ms.
        self.played_override: int | None = None
        # Recent replies' ids and playouts by item id, so a client can still truncate
        # them to what it heard.
        self.heard: dict[str, tuple[str, Playout]] = {}

    @property
    def live(self) -> Response | None:
        """The live reply."""
        live = self.call.core.reply
        return None if live is None else self.replies.get(live.id)

    def start(self, start: ce.StartReply) -> None:
        turn = self.call.listener.turns.get(start.turn) if start.turn is not None else None
        s = self.call.settings
        options = start.options or ResponseOptions()
        last = self.call.conversation.messages[-1] if self.call.conversation.messages else None
        plan = self.call.tools.plan(options, start.tool_round,
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
            tts_lookahead=self.cfg.session.tts_lookahead_clauses,
            gated=start.gated,
            output_rate=s.output_sample_rate,
            clock=self._clock,
            on_audio=self._wake.set,
            tool_stream=plan.stream,
            constraint=plan.constraint,
            options=options,
            tool_round=start.tool_round,
            wind_down_tokens=self.cfg.llm.wind_down_tokens,
        )
        resp.prompt_tools, resp.tool_choice = plan.prompt_tools, plan.choice
        # Speech before its first audio may withdraw a reply to the caller's turn: until
        # then the client hears nothing of it (voicebot/core: reopen_unheard).
        resp.show_with_audio = start.withdrawable and s.audio_output
        self.replies[resp.id] = resp
        if turn is not None:
            self._reply_turns[resp.id] = turn
            if start.gated:
                turn.response = resp
        self._reply_tasks[resp.id] = self.call.spawn(self._drive(resp, turn), "response")
        if not start.gated:
            self.release(resp)

    def release(self, resp: Response) -> None:
        resp.release()
        self._wake.set()

    def pause(self, reply_id: str) -> None:
        """Speech over the reply: send no more of its audio; the rest waits, queued."""
        resp = self.replies.get(reply_id)
        if resp is not None and resp.paused_at is None:
            resp.paused_at = self._clock.monotonic()

    def resume(self, reply_id: str) -> None:
        """The speech was no turn: the pacer sends the reply on from where it paused."""
        resp = self.replies.get(reply_id)
        if resp is None or resp.paused_at is None:
            return
        paused_ms = 1000 * (self._clock.monotonic() - resp.paused_at)
        resp.paused_at = None
        if self.call.metrics:
            self.call.metrics.false_interruptions.inc()
        self.call.log.info("false interruption: reply resumed after %.0f ms paused", paused_ms)
        self._wake.set()

    async def _drive(self, resp: Response, turn: Turn | None) -> None:
        results: list[str] | None = None  # server tools' results, when the reply called them
        try:
            if turn is not None:
                # shield: this reply being cancelled must not cancel the turn's transcript.
                transcript = await asyncio.shield(turn.final)
                if not transcript.text.strip():
                    return  # the turn's transcript ends it (noise)
                in_history = any(m.item_id == turn.item_id for m in self.call.conversation.messages)
                # A speculative reply runs before the turn is committed to the history.
                user_text = None if in_history else transcript.text
                resp.prompt_ids = self.call.conversation.prompt_ids(user_text=user_text)
            else:
                resp.prompt_ids = self.call.conversation.prompt_ids(
                    system_prompt=resp.options.instructions, tools=resp.prompt_tools
                )
            resp.times.requested = self._clock.monotonic()
            forward = self.call.spawn(self._forward_text(resp), "text")
            try:
                await resp.run()
                self._wake.set()  # a start held for more audio need not wait any longer
                await forward
                await resp.released.wait()
                if self.call.tools.runs(resp.tool_calls, resp.tool_round) and resp.tool_choice != ToolChoice("none"):
                    results = await self._run_tools(resp)
                elif self.live is resp:
                    # The LLM is free while the caller listens to the rest: the core's window
                    # for background work that would delay their next turn.
                    self.call.feed(ce.ReplyWritten(resp.id, resp.playout.queued_samples / resp.playout.sample_rate))
                if resp.playout.queued_samples:
                    await resp.drained.wait()  # the pacer is still sending
            finally:
                forward.cancel()
        except Exception:
            if not resp.released.is_set():
                # Speculative work is invisible to the caller: drop it; the committed
                # turn starts a fresh reply (and reports its failure, if any).
                self.call.log.warning("speculative reply failed", exc_info=True)
                if self.live is resp:
                    self._reply_ended(resp, ce.ReplyEnded(resp.id, "failed"))
                return
            if self.live is resp:
                self._finish(resp, "failed")
            raise
        if self.live is resp:
            self._finish(resp, "completed")
            if results is not None:
                self._reply_to_tool_results(resp, results)

    async def _run_tools(self, resp: Response) -> list[str]:
        """Run a released reply's server-tool calls, speaking the filler if they are
        slow and the reply said nothing before its call. Runs inside the reply's task:
        a barge-in cancels the webhook requests with it."""
        filler, after_s = self.call.tools.filler
        work = asyncio.ensure_future(self.call.tools.run_all(resp.tool_calls, self.call.id))
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
            self.call.add_tool_result(call.call_id, output)
            self.call.emit(ToolResult(call.call_id, call.name, output))
        self.call.feed(ce.ToolResults(resp.id, resp.options, resp.tool_round))

    def _show(self, resp: Response) -> None:
        """Tell the client of the reply (once): its turn's held end first, then its start."""
        if resp.shown.is_set():
            return
        resp.shown.set()
        if self.live is resp:
            self.call.feed(ce.ReplyShown(resp.id))
        self.call.emit(ResponseStarted(resp.id, resp.item_id))

    async def _forward_text(self, resp: Response) -> None:
        await resp.released.wait()
        if resp.show_with_audio and not resp.shown.is_set():
            # The pacer shows it with its first audio; one that has none is shown at its end.
            await _first(resp.shown.wait(), resp.finished.wait())
        self._show(resp)
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
            await self.call.outbox.wait_for_room()
            if self.live is not resp:
                return  # cut while we waited: its ResponseDone is out, nothing may follow it
            self.call.emit(event)

    def stop(self, reply_id: str, status: str, report: bool) -> None:
        """Cancel a reply's work; ``report``: it was heard, and is reported cut short."""
        resp = self.replies.get(reply_id)
        if resp is None:  # its start failed
            self.call.feed(ce.ReplyEnded(reply_id, status))
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
            for e in self.call.outbox.discard(lambda e: isinstance(e, ResponseAudio) and e.response_id == resp.id)
            if isinstance(e, ResponseAudio)
        )
        resp.playout.taken -= unsent  # taken from the playout, but never sent
        dropped += unsent
        self._finish(resp, status)
        if status == "interrupted" and resp.audio_started:
            if self.call.metrics:
                self.call.metrics.barge_ins.inc()
            self.call.log.info("barge-in: %d ms of reply audio dropped", 1000 * dropped // resp.playout.sample_rate)

    def _finish(self, resp: Response, status: str) -> None:
        """A reply the caller was told of ends: the core keeps what was heard of it."""
        rate = resp.playout.sample_rate
        if status == "completed":
            played = resp.playout.taken
        elif self.played_override is not None:
            played = int(self.played_override * rate / 1000)
        else:
            # The client holds up to the lead in its buffer: that part was not heard,
            # unless the reply was paused long enough for the client to play it out.
            lead_s = self.cfg.session.playout_lead_ms / 1000
            if resp.paused_at is not None:
                lead_s = max(0.0, lead_s - (self._clock.monotonic() - resp.paused_at))
            played = max(0, resp.playout.taken - int(lead_s * rate))
        self.played_override = None
        heard = resp.playout.heard_text(played) if status != "completed" else resp.full_text
        self.heard[resp.item_id] = (resp.id, resp.playout)
        while len(self.heard) > 4:  # only recent replies can still be truncated
            self.heard.pop(next(iter(self.heard)))
        self._reply_ends[resp.id] = (1000 * played // rate, heard)
        # A reply played in full is stored as the tokens the model produced (tool-call
        # markup included): the next prompt then reuses its KV blocks from the prefix
        # cache as well. A reply cut short keeps what was heard, and no call.
        # A reply that dropped its unfinished sentence at max_tokens keeps the text spoken.
        completed = status == "completed" and not resp.cut_at_limit
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
            self.call.feed(ended)
        finally:
            self.replies.pop(resp.id, None)
            self._reply_tasks.pop(resp.id, None)
            self._reply_turns.pop(resp.id, None)
            self._reply_ends.pop(resp.id, None)

    def report_done(self, reply_id: str, status: str) -> None:
        resp = self.replies[reply_id]
        self._show(resp)  # a reply ends on the wire only after it started there
        played_ms, heard = self._reply_ends[reply_id]
        if status == "interrupted" and resp.audio_started:
            # Only a reply whose audio started was barged in on: one stopped before
            # it (the caller went on right after a pause taken for the end of the
            # turn) ends without a barge-in.
            self.call.emit(BargeIn(resp.id, played_ms, heard))
        st = resp.stats
        if self.call.metrics:
            self.call.metrics.count_tokens(st.prompt_tokens, st.cached_tokens)
        self.call.observer.stages(self._stages(resp, status))
        completed = status == "completed"
        self.call.emit(
            ResponseDone(
                resp.id, resp.item_id, status, heard, resp.full_text, played_ms,  # type: ignore[arg-type]
                st.finish_reason, st.prompt_tokens, st.output_tokens,
                tuple(resp.tool_calls) if completed else (), st.cached_tokens,
            )
        )

    async def pace(self) -> None:
        """Send reply audio in 20 ms frames in real time, ``playout_lead_ms`` ahead."""
        lead_s = self.cfg.session.playout_lead_ms / 1000.0
        while True:
            resp = self.live
            if (resp is None or not resp.released.is_set() or resp.paused_at is not None
                    or resp.playout.queued_samples == 0):
                # Woken by a release or by new audio in the playout (no polling).
                self._wake.clear()
                await self._wake.wait()
                continue
            hold_s = self._start_hold_s(resp)
            if hold_s > 0:
                await self._wake_or_sleep(hold_s)
                continue
            await self._play(resp, lead_s)

    def _start_hold_s(self, resp: Response) -> float:
        """How much longer a reply that has not started waits for more audio
        (``session.reply_start_hold_ms``): while what is ready is shorter than
        ``clause_low_water_ms`` and more is coming, up to the hold after its first audio."""
        session = self.cfg.session
        first = resp.times.first_audio
        if session.reply_start_hold_ms <= 0 or resp.playout.taken or resp.generated or first is None:
            return 0.0
        if resp.playout.queued_samples >= session.clause_low_water_ms * resp.playout.sample_rate // 1000:
            return 0.0
        return first + session.reply_start_hold_ms / 1000.0 - self._clock.monotonic()

    async def _wake_or_sleep(self, seconds: float) -> None:
        """Until the pacer is woken (audio, a release, the reply's end) or ``seconds`` pass."""
        self._wake.clear()
        await _first(self._wake.wait(), self._clock.sleep(seconds))

    async def _play(self, resp: Response, lead_s: float) -> None:
        rate = resp.playout.sample_rate
        frame = rate * _FRAME_MS // 1000
        if resp.times.first_audio is not None and resp.playout.taken == 0:
            self._show(resp)
            if self.live is not resp:
                return
            resp.audio_started = True
            self.call.emit(ResponseAudioStarted(resp.id, resp.item_id))
            self._report_timings(resp)
        base = self._clock.monotonic() - resp.playout.taken / rate
        while self.live is resp and resp.paused_at is None:
            due = (self._clock.monotonic() - base + lead_s) * rate
            while resp.playout.taken + frame <= due or (
                resp.playout.queued_samples and resp.playout.taken < due and resp.generated
            ):
                if not self.call.outbox.data_room():
                    await self.call.outbox.wait_for_room()
                    if self.live is not resp:
                        return  # cancelled while the client was slow to read
                chunk = resp.playout.take(frame)
                if chunk.size == 0:
                    break
                self.call.outbox.put_nowait(ResponseAudio(resp.id, resp.item_id, chunk, rate))
                if self.call.audio_tap is not None:
                    self.call.audio_tap.reply(resp.id, chunk, rate, self._clock.monotonic())
                resp.notify_drained()
                if resp.generated and resp.playout.queued_samples == 0:
                    resp.drained.set()
                if self.live is not resp or resp.paused_at is not None:
                    return
            if resp.playout.queued_samples == 0:
                return  # underrun or done: the outer loop waits for more
            await self._clock.sleep(_FRAME_MS / 1000.0)

    def _stages(self, resp: Response, status: str) -> TurnStages:
        """The marks of a reply (and of the turn it answers) as it is reported done."""
        turn = self._reply_turns.get(resp.id)
        t, st = resp.times, resp.stats
        return TurnStages(
            resp.id,
            status,
            speech_end=turn.speech_end if turn else None,
            committed=turn.committed_at if turn else None,
            asr_started=turn.asr_started if turn else None,
            asr_done=turn.asr_done if turn else None,
            llm_requested=t.requested,
            llm_ttft_s=st.ttft_s,
            llm_done=t.done_generating,
            first_clause=t.first_clause,
            tts_started=t.first_clause_synth_start,
            tts_first_audio=t.first_audio,
            audio_started=t.first_sent,
            ended=self._clock.monotonic(),
            prompt_tokens=st.prompt_tokens,
            cached_tokens=st.cached_tokens,
            output_tokens=st.output_tokens,
            speculative=bool(turn and turn.response is resp),
        )

    def _report_timings(self, resp: Response) -> None:
        now = self._clock.monotonic()
        resp.times.first_sent = now
        turn = self._reply_turns.get(resp.id) if self.live is resp else None

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
            # A remote tier says how much was cached only after the last token.
            cached_prompt_tokens=resp.stats.cached_tokens if resp.stats.cached_known else None,
            prompt_tokens=resp.stats.prompt_tokens or None,  # never 0 tokens: 0 is not known yet
            speculative=bool(turn and turn.response is resp),
        )
        self.call.emit(timings)
        if self.call.metrics:
            self.call.metrics.observe_turn(timings)
            self.call.metrics.cache_hit_ratio.set(self.engines.llm.cache_hit_ratio)

