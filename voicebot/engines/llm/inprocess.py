"""The shared LLM engine in this process (``llm.backend: inprocess``): vLLM's ``AsyncLLM``.

The priority lanes, the totals, ``generate``/``warm``/``complete`` are the shared half in
:mod:`.lanes`; this module builds and shuts down vLLM, turns a request's sampling into
``SamplingParams`` and streams it. Cancelling the consumer of :meth:`LlmEngine.generate`
aborts the vLLM request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from voicebot.affinity import current_session, rank_for
from voicebot.config import LlmConfig
from voicebot.engines.contracts import GenerationStats, Lane, TextDelta
from voicebot.engines.llm.dtype import resolve_dtype
from voicebot.engines.llm.lanes import LaneEngine
from voicebot.engines.vllm_shutdown import Listed, listed, shut_down
from voicebot.errors import ModelError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


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


class LlmEngine(LaneEngine):
    """One vLLM engine in this process, shared by every session."""

    def __init__(self, cfg: LlmConfig, model_path: str, tokenizer_path: str | None = None) -> None:
        super().__init__(cfg, model_path, tokenizer_path)
        self._engine: AsyncLLM | None = None
        self._started = Listed()  # its processes and shared memory, for its shutdown

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
        try:
            self._started = await listed(engine)
            await self._preload_tools()
            await self._warm_sampling()
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
        started, self._started = self._started, Listed()  # not carried to a later engine
        if engine is not None:
            try:
                await shut_down(engine, started)  # off the loop: it joins the engine-core process
            finally:
                _no_del_after_shutdown(engine)

    # ------------------------------------------------------------------ queries
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

    def unfinished_requests(self) -> int:
        """Requests vLLM itself still tracks (tests: an abort must bring this to 0)."""
        if self._engine is None:
            return 0
        return int(self._engine.output_processor.get_num_unfinished_requests())

    @property
    def keeps_prefills(self) -> bool:
        """vLLM's prefix cache keeps a background prefill when it is on."""
        return self.cfg.enable_prefix_caching

    # --------------------------------------------------------------- generation
    def _params(self, values: dict[str, Any]) -> Any:
        """The in-process form: vLLM's SamplingParams, streamed as deltas."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**values, output_kind=RequestOutputKind.DELTA)

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
                        st.cached_tokens, st.cached_known = out.num_cached_tokens, True
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

    @property
    def block_size(self) -> int:
        """The KV cache block: the prefix cache holds whole blocks only (vLLM-CPU's
        default is 128, a GPU's 16)."""
        if self._engine is not None and hasattr(self._engine, "vllm_config"):
            return int(self._engine.vllm_config.cache_config.block_size)
        return super().block_size
