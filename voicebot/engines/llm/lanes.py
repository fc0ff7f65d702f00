"""What both LLM backends share: the priority lanes, the request totals, the sampling
defaults, and ``generate`` / ``warm`` / ``complete`` over two hooks a backend supplies.

Live turns run in the INTERACTIVE lane at the highest priority. BACKGROUND work
(summaries of old history, prefills) runs at a lower priority *and* under its own
concurrency cap (:class:`BackgroundSlots`): a priority only reorders the waiting queue and
never frees a running slot, so without the cap a burst of background requests fills
``max_num_seqs`` and a voice turn waits behind it. Background requests waiting for a slot
are bounded too (``background_queue``): one more is refused with
:class:`BackgroundQueueFull` rather than queued, so a backlog cannot grow without end;
background work is optional by nature and its caller drops it.

A backend (:mod:`.inprocess`, :mod:`.remote`) derives from :class:`LaneEngine` and
supplies its lifecycle, its health, ``_params`` (the request's sampling in its own form)
and ``_stream`` (one request's deltas); neither backend derives from the other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from typing import Any

from voicebot.config import LlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.errors import EngineError, ModelError
from voicebot.tools.preload import preload_tools

log = logging.getLogger(__name__)

# The sampling warm-up's replies (LaneEngine._warm_sampling): any 16 token ids are a prompt
# in every vocabulary, and the first steps after they are sent let all of them join a batch.
_WARM_PROMPT = list(range(16))
_WARM_LEAD = 4


class BackgroundQueueFull(EngineError):
    """Too many background requests already wait for a slot; this one is refused."""

    code = "background_queue_full"


class BackgroundSlots:
    """The background lane's cap: at most ``limit`` requests at once and ``queue_max``
    waiting. A FIFO of waiters, each handed a freed slot directly, so a task that
    resubmits at once cannot jump the queue (a bare Event let it take the slot back every
    time); the limit can be tuned at run time."""

    def __init__(self, limit: int, queue_max: int) -> None:
        self._limit = max(limit, 1)
        self._queue_max = queue_max
        self._running = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._queue if not f.done())

    @property
    def running(self) -> int:
        return self._running

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = max(value, 1)
        while self._running < self._limit and self._hand_over():
            pass

    async def enter(self) -> None:
        if self._running < self._limit and not self._queue:
            self._running += 1
            return
        if self.waiting >= self._queue_max:
            raise BackgroundQueueFull(
                f"{self.waiting} background requests already wait for a slot "
                f"(llm.background_queue); this one is refused"
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.leave()  # handed a slot just as we were cancelled
            else:
                self._queue.remove(slot)
            raise

    def leave(self) -> None:
        self._running -= 1
        if self._running < self._limit:
            self._hand_over()

    def _hand_over(self) -> bool:
        """Give a slot to the first live waiter; False if nobody waits."""
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done():
                self._running += 1
                slot.set_result(None)
                return True
        return False


class LaneEngine(ABC):
    """The :class:`~voicebot.engines.contracts.Llm` contract's shared half."""

    def __init__(self, cfg: LlmConfig, model_path: str, tokenizer_path: str | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        # The backend's handle (vLLM's AsyncLLM, the HTTP client): None until started.
        self._engine: Any = None
        self._tokenizer: Any = None
        self._ids = itertools.count()
        self._background = BackgroundSlots(cfg.background_concurrency, cfg.background_queue)
        self._running: dict[str, GenerationStats] = {}
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.sampling_warmed = 0  # replies sampled at start-up (_warm_sampling), and their tokens
        self.sampling_warmed_tokens = 0
        self.grammar_warmed = False  # one constrained reply at start-up (_warm_grammar)

    # ----------------------------------------------------------- the backend's part
    @abstractmethod
    async def start(self) -> None:
        """Every backend's start also runs :meth:`_preload_tools`."""

    async def _preload_tools(self) -> None:
        """vLLM's tool parser for the family (``llm.tool_parser``) and the tool grammar's
        modules, imported in a thread now (voicebot/tools/preload.py): a session's first
        reply does not hold the event loop for the import, and a wrong parser name fails
        start-up instead of every reply."""
        try:
            await asyncio.to_thread(preload_tools, self.cfg.tool_parser)
        except KeyError as exc:
            raise ModelError(f"llm.tool_parser: vLLM has no tool parser {self.cfg.tool_parser!r} ({exc})") from None

    @abstractmethod
    async def aclose(self) -> None: ...

    @property
    @abstractmethod
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (None: it can); read by the health check."""

    @abstractmethod
    def unfinished_requests(self) -> int:
        """Requests the backend itself still tracks (an abort brings this to 0)."""

    @property
    @abstractmethod
    def keeps_prefills(self) -> bool:
        """Whether a prefix cache keeps what :meth:`warm` computes."""

    @abstractmethod
    def _params(self, values: dict[str, Any]) -> Any:
        """A request's sampling (:meth:`_sampling`'s values) in the backend's own form."""

    @abstractmethod
    def _stream(
        self, rid: str, prompt_ids: list[int], lane: Lane, st: GenerationStats, params: Any
    ) -> AsyncGenerator[TextDelta, None]:
        """One request's deltas; fills ``st`` in, calls :meth:`_done` at its end, and
        aborts the request when closed early."""

    # ------------------------------------------------------------------ queries
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise EngineError("LLM engine not started")
        return self._tokenizer

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def background_waiting(self) -> int:
        return self._background.waiting

    @property
    def background_limit(self) -> int:
        return self._background.limit

    @background_limit.setter
    def background_limit(self, value: int) -> None:
        self._background.limit = value

    @property
    def background_running(self) -> int:
        return self._background.running

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    @property
    def block_size(self) -> int:
        """The KV cache block: the prefix cache holds whole blocks only."""
        return self.cfg.block_size or 16

    # --------------------------------------------------------------- generation
    def _sampling(
        self,
        max_tokens: int | None,
        temperature: float | None,
        stop: list[str] | None,
        min_tokens: int,
        structured_outputs: Any = None,
        logit_bias: dict[int, float] | None = None,
        skip_special_tokens: bool = True,
    ) -> Any:
        """One request's sampling, the config's defaults resolved here for both backends;
        :meth:`_params` gives it the backend's form (SamplingParams, or a JSON body)."""
        c = self.cfg
        return self._params(
            dict(
                max_tokens=max_tokens or c.max_tokens,
                temperature=c.temperature if temperature is None else temperature,
                top_p=c.top_p,
                # Off with tools in the prompt (skip_special_tokens False): a call must repeat
                # the tool's name and argument names from the system message.
                repetition_penalty=c.repetition_penalty if skip_special_tokens else 1.0,
                seed=c.seed,
                stop=stop,
                min_tokens=min_tokens,
                # Tool calls (voicebot/tools/grammar.py): a structural tag keeps a call's JSON
                # valid for its schema; a logit bias bans the call tag under tool_choice none.
                structured_outputs=structured_outputs,
                logit_bias=logit_bias,
                # False when tools are in the prompt: vLLM's detokenizer drops <tool_call> (an
                # added token) otherwise, and the parser never sees the call (vLLM's hermes
                # parser asks the same of its requests in adjust_request).
                skip_special_tokens=skip_special_tokens,
            )
        )

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        lane: Lane = Lane.INTERACTIVE,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop: list[str] | None = None,
        min_tokens: int = 0,
        stats: GenerationStats | None = None,
        request_id: str | None = None,
        structured_outputs: Any = None,
        logit_bias: dict[int, float] | None = None,
        skip_special_tokens: bool = True,
    ) -> AsyncGenerator[TextDelta, None]:
        """Stream text deltas for a tokenised prompt.

        Cancellation (or closing the iterator early) aborts the vLLM request and
        re-raises. Pass ``stats`` to read TTFT and cached prompt tokens afterwards.
        ``structured_outputs`` (vLLM ``StructuredOutputsParams``) and ``logit_bias``
        constrain the output (tool calls: voicebot/tools/grammar.py).
        """
        if self._engine is None:
            raise EngineError("LLM engine not started")
        rid = request_id or f"{lane.value[0]}{next(self._ids)}"
        st = stats or GenerationStats(request_id=rid, lane=lane)
        st.request_id, st.lane, st.prompt_tokens = rid, lane, len(prompt_ids)
        if lane is Lane.BACKGROUND:
            await self._enter_background()
        try:
            params = self._sampling(
                max_tokens, temperature, stop, min_tokens, structured_outputs, logit_bias, skip_special_tokens
            )
            # aclosing: when our consumer stops early, the inner stream's cleanup
            # (the abort) must run now, not whenever the generator is collected.
            async with contextlib.aclosing(self._stream(rid, prompt_ids, lane, st, params)) as stream:
                async for delta in stream:
                    yield delta
        finally:
            if lane is Lane.BACKGROUND:
                self._leave_background()

    async def _enter_background(self) -> None:
        await self._background.enter()

    def _leave_background(self) -> None:
        self._background.leave()

    def _priority(self, lane: Lane) -> int:
        """The vLLM priority of a request in ``lane`` (lower runs first)."""
        if self.cfg.scheduling_policy != "priority":
            return 0  # vLLM (in process or a server) rejects a non-zero priority under FCFS
        return self.cfg.interactive_priority if lane is Lane.INTERACTIVE else self.cfg.background_priority

    def _done(self, rid: str, st: GenerationStats) -> None:
        """A request ended (both backends): off the running list, into the totals."""
        self._running.pop(rid, None)
        st.finished_at = time.monotonic()
        if not st.best_effort:  # a prefill (warm) is not a reply: the totals feed the hit ratio
            self.requests_total += 1
            self.prompt_tokens_total += st.prompt_tokens
            self.cached_tokens_total += st.cached_tokens

    async def warm(
        self, prompt_ids: list[int], cached: int = 0, on_piece: Callable[[int], None] | None = None
    ) -> None:
        """Prefill ``prompt_ids`` at background priority and drop the one token made:
        the prefix cache then holds their whole blocks for the next prompt that starts
        with them. Best effort (see ``GenerationStats.best_effort``); cancelling it
        aborts the request, as for any other.

        In pieces of ``llm.warm_piece_tokens``, each a request that starts with the last
        one's blocks (cached): the engine runs one step at a time and an abort takes
        effect after the step, so a live turn that arrives during a long prefill (a
        history compacted at its budget, a Realtime client's instructions) waits for at
        most one piece instead of all of it. ``cached``: how much of the start the caller
        knows to be cached; the pieces start after it (a request over cached blocks still
        recomputes its last one); a piece that completes no whole block is not sent.
        ``on_piece(end)``: ``prompt_ids[:end]`` is now cached."""
        block = self.block_size
        piece = max(self.cfg.warm_piece_tokens // block, 1) * block if self.cfg.warm_piece_tokens else 0
        start = min(cached, len(prompt_ids)) // block * block
        ends = list(range(start + piece, len(prompt_ids), piece)) if piece else []
        if len(prompt_ids) // block * block > (ends[-1] if ends else start):
            ends.append(len(prompt_ids))  # else its last block is not whole: it would cache nothing
        for end in ends:
            st = GenerationStats("", Lane.BACKGROUND, best_effort=True)
            async for _ in self.generate(
                prompt_ids[:end], lane=Lane.BACKGROUND, max_tokens=1, temperature=0.0, stats=st
            ):
                pass
            if on_piece is not None:
                on_piece(end)

    async def _warm_sampling(self) -> None:
        """Replies sampled as live ones are (``_sampling``'s defaults), ``llm.warm_sampling_rows``
        of them at once, each stopping one step after the one before: the engine's sampler
        then runs every batch size from that many rows down to one before any caller does.
        Twice: alone, then beside one greedy reply that outlasts them all.

        Why: vLLM on a GPU compiles its batched top-p sampler (a Triton kernel) at the first
        step that needs each of its shape classes, in the engine's one process, so every
        request in flight waits for it; a fresh server's first burst of callers stalled
        2.6 s, twice (docs/gpu-results.md). vLLM 0.26 takes that kernel only for a batch with
        a greedy row in it (our prefix warm-ups and background tasks run at temperature 0);
        a batch of sampled rows alone goes to FlashInfer's sampler. A live burst has both, so
        the warm-up has both. The first ``_WARM_LEAD`` steps give the requests time to join
        one batch; ``min_tokens`` keeps an early end of text from shortening one. With tool
        grammars on, :meth:`_warm_grammar` follows."""
        rows = self.cfg.warm_sampling_rows
        if not rows:
            return
        started = time.monotonic()

        async def reply(tokens: int, temperature: float | None = None) -> None:
            st = GenerationStats("", Lane.INTERACTIVE, best_effort=True)  # not a reply: kept out of the totals
            stream = self.generate(_WARM_PROMPT, max_tokens=tokens, min_tokens=tokens, temperature=temperature, stats=st)
            async for delta in stream:
                self.sampling_warmed_tokens += delta.token_count

        for beside_greedy in (False, True):
            try:
                async with asyncio.TaskGroup() as group:  # one failing cancels (aborts) the others
                    if beside_greedy:
                        group.create_task(reply(_WARM_LEAD + rows, temperature=0.0))
                    for i in range(rows):
                        group.create_task(reply(_WARM_LEAD + i))
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None  # the start fails with the engine's own error, not a group
        self.sampling_warmed = rows
        if self.cfg.tool_grammar != "off":
            await self._warm_grammar()
        log.info(
            "LLM sampling warmed: %d replies at once, one fewer each step, alone and beside a greedy one, in %.1f s",
            rows, time.monotonic() - started,
        )

    async def _warm_grammar(self) -> None:
        """One constrained reply (a choice), for tool calls' structured outputs: vLLM on a GPU
        applies a grammar's token mask with a Triton kernel compiled at the first constrained
        request (vllm/v1/worker/gpu/structured_outputs.py), which would otherwise be the
        first tool call of a fresh server, holding every request in flight as the sampler's
        compile did. Its arguments are the vocabulary's sizes: one compile. No min_tokens: a
        grammar that is done allows only the end of text."""
        from vllm.sampling_params import StructuredOutputsParams

        st = GenerationStats("", Lane.INTERACTIVE, best_effort=True)
        grammar = StructuredOutputsParams(choice=["yes", "no"])
        async for _ in self.generate(_WARM_PROMPT, max_tokens=_WARM_LEAD, structured_outputs=grammar, stats=st):
            pass
        self.grammar_warmed = True

    async def complete(self, prompt_ids: list[int], **kwargs: Any) -> str:
        """Collect a whole reply (background summaries, tests)."""
        parts = [d.text async for d in self.generate(prompt_ids, **kwargs)]
        return "".join(parts)
