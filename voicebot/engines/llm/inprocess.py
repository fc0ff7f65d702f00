"""The shared LLM engine: vLLM's ``AsyncLLM`` in-process, with priority lanes.

Live turns run in the INTERACTIVE lane at the highest vLLM priority. BACKGROUND work
(summaries of old history, long answers) runs at a lower priority *and* under its own
concurrency cap: vLLM's priority only reorders the waiting queue and never frees a
running slot, so without the cap a burst of background requests fills
``max_num_seqs`` and a voice turn waits behind it. Background requests waiting for a
slot are bounded too (``background_queue``): one more is refused with
:class:`BackgroundQueueFull` rather than queued, so a backlog cannot grow without end;
background work is optional by nature and its caller drops it.

Cancelling the consumer of :meth:`LlmEngine.generate` aborts the vLLM request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from voicebot.affinity import current_session, rank_for
from voicebot.config import LlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.engines.llm.dtype import resolve_dtype
from voicebot.engines.vllm_shutdown import shut_down
from voicebot.errors import EngineError, ModelError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class BackgroundQueueFull(EngineError):
    """Too many background requests already wait for a slot; this one is refused."""

    code = "background_queue_full"


def _no_del_after_shutdown(engine: AsyncLLM) -> None:
    """Mark an AsyncLLM that was shut down explicitly so its ``__del__`` does nothing.

    The build thread's frame keeps the engine alive until interpreter teardown, where
    ``AsyncLLM.__del__`` calls ``shutdown()`` again with vLLM's module globals already
    gone and logs a ``TypeError`` traceback at every server exit.
    """
    cls = type(engine)
    quiet = _QUIET_CLASSES.get(cls)
    if quiet is None:
        quiet = _QUIET_CLASSES[cls] = type(f"ShutDown{cls.__name__}", (cls,), {"__del__": lambda self: None})
    engine.__class__ = quiet


_QUIET_CLASSES: dict[type, type] = {}


def _tool_parser(name: str) -> None:
    from voicebot.tools.parser import parser_class

    try:
        parser_class(name)
    except KeyError as exc:
        raise ModelError(f"llm.tool_parser: vLLM has no tool parser {name!r} ({exc})") from None

class LlmEngine:
    """One vLLM engine shared by every session."""

    def __init__(self, cfg: LlmConfig, model_path: str, tokenizer_path: str | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self._engine: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._ids = itertools.count()
        # The background cap: a FIFO of waiters, each handed a freed slot directly, so a
        # task that resubmits at once cannot jump the queue (a bare Event let it take
        # the slot back every time); the limit can be tuned at run time. Per engine.
        self._background_limit = max(cfg.background_concurrency, 1)
        self._background_queue_max = cfg.background_queue
        self._background_running = 0
        self._background_queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self._running: dict[str, GenerationStats] = {}
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    # ----------------------------------------------------------------- lifecycle
    async def start(self, cancel: threading.Event | None = None) -> None:
        """Build the engine in a thread. Setting ``cancel`` (or cancelling this call)
        stops the build at its next step; an engine already built is shut down there,
        so an aborted start-up never leaves a loaded engine behind."""
        cancel = cancel or threading.Event()
        try:
            engine = await asyncio.to_thread(self._build, cancel)
        except asyncio.CancelledError:
            cancel.set()  # the thread cannot be interrupted: it checks this and cleans up
            raise
        self._engine = engine
        self._tokenizer = engine.get_tokenizer()
        # vLLM's tool parser for the family (voicebot/tools/parser.py): imported now, so
        # the first reply does not pay for it, and a wrong llm.tool_parser fails start-up.
        try:
            await asyncio.to_thread(_tool_parser, self.cfg.tool_parser)
        except BaseException:
            await self.aclose()
            raise
        log.info("LLM ready: %s", self.model_path)

    @staticmethod
    def _check_cancel(cancel: threading.Event, engine: AsyncLLM | None = None) -> None:
        if cancel.is_set():
            if engine is not None:
                # Built in this thread, no output handler yet: safe to shut down here.
                engine.shutdown()
                _no_del_after_shutdown(engine)
            raise asyncio.CancelledError("LLM start cancelled")

    def _build(self, cancel: threading.Event) -> AsyncLLM:
        self._check_cancel(cancel)
        # Read by the engine-core child process; set here, at start-up, not at import.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.kv_cache_space_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.cfg.cpu_threads_bind)
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # pragma: no cover - install problem
            raise ModelError(f"vLLM is not installed ({exc}); run `make install`") from exc
        from vllm.platforms import current_platform

        c = self.cfg
        dtype = resolve_dtype(c.dtype, on_cpu=current_platform.is_cpu())
        log.info("LLM dtype: %s (llm.dtype %s)", dtype, c.dtype)
        args: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.tokenizer_path,
            dtype=dtype,
            load_format=c.load_format,
            max_model_len=c.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching,
            scheduling_policy=c.scheduling_policy,
            max_num_seqs=c.max_num_seqs,
            enforce_eager=c.enforce_eager,
            tensor_parallel_size=c.tensor_parallel_size,
            data_parallel_size=c.data_parallel_size,
            disable_log_stats=False,
            seed=c.seed if c.seed is not None else 0,
        )
        if c.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = c.max_num_batched_tokens
        if c.block_size is not None:
            args["block_size"] = c.block_size
        try:
            import torch

            if torch.cuda.is_available():
                args["gpu_memory_utilization"] = c.gpu_memory_utilization
        except ImportError:  # pragma: no cover
            pass
        self._check_cancel(cancel)
        try:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        except Exception as exc:
            raise ModelError(f"vLLM could not load {self.model_path}: {exc}") from exc
        self._check_cancel(cancel, engine)
        return engine

    async def aclose(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                await shut_down(engine)  # off the loop: it joins the engine-core process
            finally:
                _no_del_after_shutdown(engine)

    # ------------------------------------------------------------------ queries
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise EngineError("LLM engine not started")
        return self._tokenizer

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (None: it can); read by the health check."""
        engine = self._engine
        if engine is None:
            return "not started"
        if not engine.errored:
            return None
        resources = getattr(getattr(engine, "engine_core", None), "resources", None)
        if getattr(resources, "engine_dead", False):
            return "vLLM engine dead: its engine-core process exited"
        return "vLLM engine dead: its output handler stopped"

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def background_waiting(self) -> int:
        return sum(1 for f in self._background_queue if not f.done())

    @property
    def background_limit(self) -> int:
        return self._background_limit

    @background_limit.setter
    def background_limit(self, value: int) -> None:
        self._background_limit = max(value, 1)
        while self._background_running < self._background_limit and self._hand_over():
            pass

    @property
    def background_running(self) -> int:
        return self._background_running

    def unfinished_requests(self) -> int:
        """Requests vLLM itself still tracks (tests: an abort must bring this to 0)."""
        if self._engine is None:
            return 0
        return int(self._engine.output_processor.get_num_unfinished_requests())

    @property
    def keeps_prefills(self) -> bool:
        """vLLM's prefix cache keeps a background prefill when it is on."""
        return self.cfg.enable_prefix_caching

    @property
    def cache_hit_ratio(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

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

    def _params(self, values: dict[str, Any]) -> Any:
        """The in-process form: vLLM's SamplingParams, streamed as deltas."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**values, output_kind=RequestOutputKind.DELTA)

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
        if self._background_running < self._background_limit and not self._background_queue:
            self._background_running += 1
            return
        if self.background_waiting >= self._background_queue_max:
            raise BackgroundQueueFull(
                f"{self.background_waiting} background requests already wait for a slot "
                f"(llm.background_queue); this one is refused"
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._background_queue.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._leave_background()  # handed a slot just as we were cancelled
            else:
                self._background_queue.remove(slot)
            raise

    def _hand_over(self) -> bool:
        """Give a slot to the first live waiter; False if nobody waits."""
        while self._background_queue:
            slot = self._background_queue.popleft()
            if not slot.done():
                self._background_running += 1
                slot.set_result(None)
                return True
        return False

    def _leave_background(self) -> None:
        self._background_running -= 1
        if self._background_running < self._background_limit:
            self._hand_over()

    def _priority(self, lane: Lane) -> int:
        """The vLLM priority of a request in ``lane`` (lower runs first)."""
        if self.cfg.scheduling_policy != "priority":
            return 0  # vLLM (in process or a server) rejects a non-zero priority under FCFS
        return self.cfg.interactive_priority if lane is Lane.INTERACTIVE else self.cfg.background_priority

    async def _stream(
        self,
        rid: str,
        prompt_ids: list[int],
        lane: Lane,
        st: GenerationStats,
        params: Any,
    ) -> AsyncGenerator[TextDelta, None]:
        assert self._engine is not None
        priority = self._priority(lane)
        st.submitted_at = time.monotonic()
        self._running[rid] = st
        finished = False
        try:
            # data_parallel_size > 1: every request of a call goes to one rank, where its
            # prefix is cached (voicebot/affinity.py); None lets vLLM balance.
            rank = rank_for(current_session(), self.cfg.data_parallel_size)
            outputs = self._engine.generate(
                {"prompt_token_ids": prompt_ids}, params, rid, priority=priority, data_parallel_rank=rank
            )
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if out.num_cached_tokens is not None and st.first_token_at is None:
                        st.cached_tokens = out.num_cached_tokens
                    comp = out.outputs[0]
                    if comp.token_ids and st.first_token_at is None:
                        st.first_token_at = time.monotonic()
                    st.output_tokens += len(comp.token_ids)
                    if out.finished:
                        finished = True
                        st.finish_reason = comp.finish_reason
                    if comp.text or comp.token_ids:
                        yield TextDelta(comp.text, len(comp.token_ids), tuple(comp.token_ids))
        finally:
            self._done(rid, st)
            if not finished and self._engine is not None:
                # vLLM aborts on cancellation itself; this also covers an early
                # break by the consumer (GeneratorExit) on every vLLM version.
                await self._engine.abort(rid)

    def _done(self, rid: str, st: GenerationStats) -> None:
        """A request ended (both backends): off the running list, into the totals."""
        self._running.pop(rid, None)
        st.finished_at = time.monotonic()
        if not st.best_effort:  # a prefill (warm) is not a reply: the totals feed the hit ratio
            self.requests_total += 1
            self.prompt_tokens_total += st.prompt_tokens
            self.cached_tokens_total += st.cached_tokens

    @property
    def block_size(self) -> int:
        """The KV cache block: the prefix cache holds whole blocks only (vLLM-CPU's
        default is 128, a GPU's 16)."""
        if self._engine is not None and hasattr(self._engine, "vllm_config"):
            return int(self._engine.vllm_config.cache_config.block_size)
        return self.cfg.block_size or 16

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
        recomputes its last one). ``on_piece(end)``: ``prompt_ids[:end]`` is now cached."""
        block = self.block_size
        piece = max(self.cfg.warm_piece_tokens // block, 1) * block if self.cfg.warm_piece_tokens else 0
        start = min(cached, len(prompt_ids)) // block * block
        ends = list(range(start + piece, len(prompt_ids), piece)) if piece else []
        for end in [*ends, len(prompt_ids)]:
            st = GenerationStats("", Lane.BACKGROUND, best_effort=True)
            async for _ in self.generate(
                prompt_ids[:end], lane=Lane.BACKGROUND, max_tokens=1, temperature=0.0, stats=st
            ):
                pass
            if on_piece is not None:
                on_piece(end)

    async def complete(self, prompt_ids: list[int], **kwargs: Any) -> str:
        """Collect a whole reply (background summaries, tests)."""
        parts = [d.text async for d in self.generate(prompt_ids, **kwargs)]
        return "".join(parts)
