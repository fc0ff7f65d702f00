"""The call's background LLM work, run as the core decides: prefills of the
conversation into the prefix cache, and summaries of the turns that leave it. Each is
one task of the call's TaskGroup, cancelled when the core says so."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from voicebot.core import events as ce
from voicebot.engines.contracts import Lane
from voicebot.engines.tokenizer_thread import run_tokenizer
from voicebot.session.call import Call
from voicebot.session.history import Message


class BackgroundWork:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.engines = call.engines
        # The one job of each kind the core started, by its number.
        self._prefill: tuple[int, asyncio.Task[None]] | None = None
        self._summary: tuple[int, asyncio.Task[None]] | None = None
        self._wake: asyncio.Task[None] | None = None  # the one Tick the core asked for

    def wake_at(self, at: float) -> None:
        """Tell the core when ``at`` (the call's clock) has come; a later call replaces it."""
        if self._wake is not None:
            self._wake.cancel()
        self._wake = self.call.spawn(self._tick(at), "wake")

    async def _tick(self, at: float) -> None:
        await self.call.clock.sleep(max(at - self.call.clock.monotonic(), 0.0))
        self._wake = None
        self.call.feed(ce.Tick())

    def start_prefill(self, start: ce.StartPrefill) -> None:
        self._prefill = (start.prefill, self.call.spawn(self.prefill(start), "warm"))

    def cancel_prefill(self, pid: int) -> None:
        if self._prefill is not None and self._prefill[0] == pid:
            self._prefill[1].cancel()
            self._prefill = None

    def start_summary(self, start: ce.StartSummary) -> None:
        self._summary = (start.summary, self.call.spawn(self.summarise(start), "summary"))

    def cancel_summary(self, sid: int) -> None:
        if self._summary is not None and self._summary[0] == sid:
            self._summary[1].cancel()
            self._summary = None

    async def prefill(self, start: ce.StartPrefill) -> None:
        """Prefill the conversation so far (llm.warm_prefix) at background priority, so
        the next turn's prompt finds those blocks in the prefix cache and prefills only
        what is new; in pieces (llm.warm_piece_tokens) from what is cached already.
        Background work is invisible to the caller: a failure is logged, never an error
        event. Cancellation (a reply started, the call ended) propagates."""
        pid, ids = start.prefill, list(start.ids)

        def cached(end: int) -> None:  # a piece is in: a retry after a live turn starts there
            self.call.feed(ce.PrefillProgress(pid, end))

        ok = True
        try:
            await self.engines.llm.warm(ids, cached=start.cached, on_piece=cached)
        except Exception as exc:
            self.call.log.warning("prefilling the conversation (%d tokens) failed: %s", len(ids), exc)
            ok = False
        if self._prefill is not None and self._prefill[0] == pid:
            self._prefill = None
        self.call.feed(ce.PrefillDone(pid, ok))

    async def summarise(self, start: ce.StartSummary) -> None:
        """Summarise dropped turns at background priority. A failed summary is logged
        and its turns dropped unsummarised, never an error event. Cancellation (the
        hard trim took over, the call ended) propagates."""
        messages = list(start.messages)
        try:
            text: str | None = await self._summary_of(messages, start.earlier)
        except Exception as exc:
            self.call.log.warning("summary of %d dropped messages failed, dropped: %s", len(messages), exc)
            text = None
        if self._summary is not None and self._summary[0] == start.summary:
            self._summary = None
        self.call.feed(ce.SummaryDone(start.summary, text))

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

