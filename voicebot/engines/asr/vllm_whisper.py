"""Whisper on vLLM: the GPU ASR backend (``asr.backend: vllm``).

faster-whisper's CTranslate2 needs cuBLAS 12; GPU machines with only CUDA 13 cannot run
it there. vLLM serves Whisper (``WhisperForConditionalGeneration``) on torch's own CUDA
with continuous batching, so every session's decodes share one batched encoder/decoder.

The same shared :class:`~voicebot.engines.asr.engine.AsrEngine` as for faster-whisper (the
same streams with partials, LocalAgreement and reuse of the partial that saw the end of
speech, the same bounded finals-first queue), built with another decoder,
:class:`VllmDecoder`: instead of a few threads each running a blocking CTranslate2
decode, up to ``concurrency`` jobs are in flight in vLLM at once, and vLLM's priority
scheduler keeps finals ahead of partials inside the engine as well.

The confirmed words are forced as decoder prompt tokens after
``<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>``, as faster-whisper's
``prefix`` does, so a hypothesis continues them by construction.

Cancelling a waiting ``finalize()`` aborts its vLLM request; closing the engine aborts
every request in flight. vLLM is imported only in :meth:`VllmWhisper.start`, so this
module (and CPU CI) does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.agreement import continuation_after
from voicebot.engines.asr.engine import AsrEngine
from voicebot.engines.asr.jobs import DecodeJob, unless_abandoned
from voicebot.engines.asr.loop_guard import WHISPER_MAX_TARGET_TOKENS, token_budget
from voicebot.engines.vllm_shutdown import Listed, listed, shut_down
from voicebot.errors import EngineError, ModelError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["VllmAsrEngine", "VllmDecoder", "VllmWhisper", "WhisperRunner", "WhisperVllmSettings"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class WhisperVllmSettings:
    """How the Whisper engine is sized on the GPU: ``asr.vllm`` (config.WhisperVllmConfig, whose
    defaults these mirror), or built directly by a benchmark."""

    # Jobs in flight in vLLM at once; more wait in the engine's finals-first queue.
    concurrency: int = 256
    # Share of GPU memory for weights + cross/self-attention KV. Each request holds
    # 1500 encoder positions of cross-attention KV per decoder layer (large-v3-turbo:
    # 4 layers, ~31 MB a request), so this sets how many decodes fit at once.
    gpu_memory_utilization: float = 0.10
    max_num_seqs: int = 256
    # Also the encoder budget per engine step: 1500 tokens per 30 s window, so 12000
    # lets 8 windows be encoded in one step. Larger: more encoder throughput, longer
    # steps for the decodes running beside them.
    max_num_batched_tokens: int = 12_000
    dtype: str = "bfloat16"
    load_format: str = "auto"  # "dummy": shape-only benchmarks (random weights)
    enforce_eager: bool = False  # CUDA graphs for the decoder (encoder-decoder: FULL_DECODE_ONLY)
    # Threads that turn audio into log-mel features (vLLM's renderer pool), off the event loop.
    feature_workers: int = 4
    # The encoder's window lengths (seconds) when the window is cut (window_pad_s set).
    window_buckets_s: tuple[float, ...] = (8.0, 10.0, 12.0, 15.0, 20.0, 30.0)
    # asr.encoder_pad_s / encoder_min_s: encode the utterance + pad_s (at least min_s,
    # rounded up to a bucket) instead of 30 s (whisper_vllm_window.py). None: 30 s.
    window_pad_s: float | None = None
    window_min_s: float = 8.0


class WhisperRunner(Protocol):
    """What the engine needs from a Whisper server (vLLM here; a fake in unit tests)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def prompt_ids(self, language: str | None, prefix: str) -> list[int]:
        """Decoder prompt: task tokens, then the forced prefix's tokens."""
        ...

    async def decode(
        self,
        request_id: str,
        audio: np.ndarray,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int,
        priority: int,
        temperature: float = 0.0,
    ) -> str:
        """The text generated after ``prompt_ids`` (greedy at temperature 0); cancellation
        aborts the request."""
        ...


class VllmWhisper:
    """A Whisper model in its own vLLM ``AsyncLLM`` (in this process, engine core beside it)."""

    def __init__(self, model_path: str, settings: WhisperVllmSettings, tokenizer_path: str | None = None) -> None:
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.settings = settings
        self._engine: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._task_ids: dict[str, int] = {}
        self._started = Listed()

    async def start(self) -> None:
        self._engine = engine = await asyncio.to_thread(self._build)
        self._started = await listed(engine)  # its processes and shared memory, for its shutdown
        self._tokenizer = engine.get_tokenizer()
        tok = self._tokenizer
        for name in ("<|startoftranscript|>", "<|transcribe|>", "<|notimestamps|>"):
            tid = tok.convert_tokens_to_ids(name)
            if not isinstance(tid, int) or tid == tok.unk_token_id:
                raise ModelError(f"Whisper tokenizer of {self.tokenizer_path} has no {name} token")
            self._task_ids[name] = tid

    def _build(self) -> AsyncLLM:
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ModelError(f"asr.backend 'vllm' needs vLLM installed ({exc})") from exc
        kwargs = self.engine_args()
        if "hf_overrides" in kwargs:
            from voicebot.vllm_plugin import register

            # This process; vLLM's spawned engine processes register it through the
            # vllm.general_plugins entry point (pyproject.toml).
            register()
        try:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except Exception as exc:
            raise ModelError(f"vLLM could not load Whisper {self.model_path}: {exc}") from exc

    def engine_args(self) -> dict[str, Any]:
        """vLLM ``AsyncEngineArgs`` of this engine."""
        s = self.settings
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            tokenizer=self.tokenizer_path,
            dtype=s.dtype,
            load_format=s.load_format,
            max_model_len=WHISPER_MAX_TARGET_TOKENS,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            gpu_memory_utilization=s.gpu_memory_utilization,
            enforce_eager=s.enforce_eager,
            scheduling_policy="priority",  # finals (0) before partials (1) inside vLLM too
            enable_prefix_caching=False,  # encoder-decoder: not supported
            limit_mm_per_prompt={"audio": 1},
            # Every utterance is new audio: a processor cache would only cost memory, and
            # it must be off for the feature-extraction pool to have several threads.
            mm_processor_cache_gb=0,
            renderer_num_workers=s.feature_workers,
            generation_config="vllm",  # our sampling params, not the checkpoint's
            disable_log_stats=True,
            seed=0,
        )
        if s.window_pad_s is not None:
            from voicebot.engines.asr.whisper_vllm_window import hf_overrides

            kwargs["hf_overrides"] = hf_overrides(s.window_pad_s, s.window_min_s, s.window_buckets_s)
        return kwargs

    async def aclose(self) -> None:
        engine, self._engine = self._engine, None
        started, self._started = self._started, Listed()  # not carried to a later engine
        if engine is not None:
            await shut_down(engine, started)  # off the loop: it joins the engine-core process

    def prompt_ids(self, language: str | None, prefix: str) -> list[int]:
        ids = [self._task_ids["<|startoftranscript|>"]]
        if language is not None:
            lang = self._tokenizer.convert_tokens_to_ids(f"<|{language}|>")
            if not isinstance(lang, int) or lang == self._tokenizer.unk_token_id:
                raise EngineError(f"Whisper does not know language {language!r}", code="invalid_language")
            ids += [lang, self._task_ids["<|transcribe|>"], self._task_ids["<|notimestamps|>"]]
        # language None: Whisper predicts the language and task tokens itself (they are
        # special tokens, left out of the text).
        if prefix.strip():
            ids += self._tokenizer.encode(" " + prefix.strip(), add_special_tokens=False)
        return ids

    async def decode(
        self,
        request_id: str,
        audio: np.ndarray,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int,
        priority: int,
        temperature: float = 0.0,
    ) -> str:
        engine = self._engine
        if engine is None:
            raise EngineError("ASR engine is not running")
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        prompt = {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, ASR_RATE)}},
            "decoder_prompt": {"prompt_token_ids": prompt_ids},
        }
        # Log-mel features in the renderer's thread pool, not on the event loop.
        (engine_input,) = await engine.renderer.render_cmpl_async([parse_model_prompt(engine.model_config, prompt)])
        params = SamplingParams(
            temperature=temperature,  # greedy but for a loop's fallback (loop_guard.py)
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            skip_special_tokens=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        text = ""
        finished = False
        try:
            outputs = engine.generate(engine_input, params, request_id, priority=priority)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    text = out.outputs[0].text
                    finished = out.finished
        finally:
            if not finished and self._engine is not None:
                await self._engine.abort(request_id)  # cancelled or closed early
        return text


class VllmDecoder:
    """A :class:`~.jobs.Decoder`: up to ``settings.concurrency`` decodes in flight in a
    :class:`WhisperRunner` (vLLM), each aborted as soon as its result is not wanted."""

    name = "asr-vllm"
    samples = True

    def __init__(
        self,
        runner: WhisperRunner,
        settings: WhisperVllmSettings,
        budget: Callable[[DecodeJob, int], tuple[int, int]],
        model_path: str = "",
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.model_path = model_path
        self._budget = budget
        self._rids = itertools.count(1)
        self.in_flight = 0  # decodes submitted to the runner and not finished
        self._superseded: dict[DecodeJob, asyncio.Future[None]] = {}  # running partials: set by abandon

    @property
    def slots(self) -> int:
        return self.settings.concurrency

    async def start(self) -> None:
        t0 = time.perf_counter()
        await self.runner.start()
        log.info(
            "ASR (vLLM) %s ready in %.1f s (%d decode slots)",
            self.model_path,
            time.perf_counter() - t0,
            self.settings.concurrency,
        )

    async def aclose(self) -> None:
        await self.runner.aclose()

    async def decode(self, job: DecodeJob) -> tuple[str, float]:
        """Decode; abort the request as soon as a final's waiter is cancelled or a partial
        is superseded (:meth:`abandon`)."""
        if job.future is not None:
            return await unless_abandoned(asyncio.ensure_future(self._decode(job)), job.future)
        superseded = self._superseded[job] = asyncio.get_running_loop().create_future()
        try:
            return await unless_abandoned(asyncio.ensure_future(self._decode(job)), superseded)
        finally:
            del self._superseded[job]

    def abandon(self, job: DecodeJob) -> None:
        superseded = self._superseded.get(job)
        if superseded is not None and not superseded.done():
            superseded.set_result(None)

    async def _decode(self, job: DecodeJob) -> tuple[str, float]:
        """Text after the job's prefix, and the decode time."""
        assert job.audio is not None
        t0 = time.perf_counter()
        prompt = self.runner.prompt_ids(job.language, job.prefix)
        min_tokens, max_tokens = self._budget(job, len(prompt))
        self.in_flight += 1
        try:
            text = await self.runner.decode(
                f"asr{next(self._rids)}",
                job.audio,
                prompt,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                priority=int(job.priority),  # FINAL = 0 is served first
                temperature=job.temperature,
            )
        finally:
            self.in_flight -= 1
        prefix = job.prefix.strip()
        # The runner returns only the continuation; glue it the way CTranslate2's
        # prefix-included output is split, so both backends confirm words alike.
        decoded = f"{prefix}{text}" if prefix else text
        return continuation_after(decoded, job.prefix), time.perf_counter() - t0


class VllmAsrEngine(AsrEngine):
    """The shared :class:`~.engine.AsrEngine` with a :class:`VllmDecoder`: it adds nothing
    to the engine but the decoder it is built with, and views of it."""

    def __init__(
        self,
        cfg: AsrConfig,
        model_path: str,
        *,
        agreement_n: int = 3,
        settings: WhisperVllmSettings | None = None,
        runner: WhisperRunner | None = None,
    ) -> None:
        self.settings = settings or WhisperVllmSettings()
        decoder = VllmDecoder(
            runner or VllmWhisper(model_path, self.settings),
            self.settings,
            # Looked up at each decode: a benchmark with random weights replaces it.
            lambda job, prompt_len: self.token_budget(job, prompt_len),
            model_path,
        )
        self._vllm = decoder
        super().__init__(cfg, model_path, agreement_n=agreement_n, decoder=decoder)

    @property
    def runner(self) -> WhisperRunner:
        return self._vllm.runner

    @property
    def in_flight(self) -> int:
        """Decodes submitted to the runner and not finished."""
        return self._vllm.in_flight

    def token_budget(self, job: DecodeJob, prompt_len: int) -> tuple[int, int]:
        """``(min_tokens, max_tokens)`` for a job: at most ``asr.max_tokens_per_s`` per
        second of audio (loop_guard.token_budget)."""
        assert job.audio is not None
        if WHISPER_MAX_TARGET_TOKENS - prompt_len - 1 < 1:
            raise EngineError("forced prefix fills Whisper's 448-token window")
        return 0, token_budget(job.audio.size / ASR_RATE, prompt_len, self.cfg.max_tokens_per_s)
