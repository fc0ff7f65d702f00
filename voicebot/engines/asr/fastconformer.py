"""The streaming FastConformer backend (``asr.backend: fastconformer``): every audio frame
encoded once, every call's stream in one batched step.

Whisper re-encodes the whole utterance for each partial and for the final. A cache-aware
streaming FastConformer keeps each stream's encoder state instead, so a chunk of audio is
encoded once, when it arrives, and the RNN-T's running hypothesis *is* the partial.
:class:`FastConformerAsr` holds a bounded pool of stream slots (:class:`~.fastconformer_model.SlotPool`)
and one task, the stepper: whenever a stream has a chunk due, it takes one due chunk from
every stream, runs one batched encoder step and greedy decode for all of them in a worker
thread, and hands each stream its new tokens. Under load the steps run back to back, so
each takes every active stream (NeMo's cache-aware pipeline and Kyutai's batched ASR work
the same way); alone, a stream is stepped as soon as its chunk is complete.

The final: :meth:`FastConformerStream.finalize` encodes what is left, the last chunk padded
with silence, without keeping that padded chunk's state (speech may go on after a pause:
the stream continues from its real audio). It is ready one step after the end of speech.

A stream holds its slot until :meth:`~FastConformerStream.aclose`; :meth:`~FastConformerStream.reset`
(a new turn) starts the slot afresh. Everything here runs on the event loop except the
step, and the slot tensors are touched by the step only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from voicebot.audio import ASR_RATE
from voicebot.config import AsrConfig
from voicebot.engines.asr.partials import PartialQueue, PartialStream
from voicebot.engines.asr.stream import as_mono_f32
from voicebot.engines.contracts import AsrStats, Partial, Transcript
from voicebot.errors import CapacityError, EngineError, ModelError
from voicebot.runtime.recent import RecentWork

__all__ = ["FastConformerAsr", "FastConformerStream"]

log = logging.getLogger(__name__)

_HALF_FFT = 256  # the left padding of a centred STFT (fastconformer_model.N_FFT // 2)
_WORD_START = "▁"  # SentencePiece's mark of a token that starts a word


class FastConformerAsr:
    """The :class:`~voicebot.engines.contracts.Asr` contract over a pool of streaming slots."""

    def __init__(self, cfg: AsrConfig, model_path: str) -> None:
        self.cfg = cfg
        self.fc = cfg.fastconformer
        self.model_path = model_path
        self.stats = AsrStats()
        self.pool: Any = None  # fastconformer_model.SlotPool, once started
        self.tokenizer: Any = None
        self._free: list[int] = []
        self._streams: list[FastConformerStream] = []
        self._due = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None
        # One thread: steps run one at a time, and only it touches the slot tensors.
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self.steps = 0
        self._recent = RecentWork(512)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        from voicebot.engines.asr import fastconformer_model as fm  # torch, transformers

        fc = self.fc
        t0 = time.perf_counter()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asr-fastconformer")
        loop = asyncio.get_running_loop()

        def load() -> tuple[Any, Any]:
            model = fm.load_model(self.model_path, fc.device, fc.dtype)
            pool = fm.SlotPool(model, fc.max_streams, fc.lookahead_frames, cuda_graphs=fc.cuda_graphs)
            return pool, fm.load_tokenizer(self.model_path)

        try:
            self.pool, self.tokenizer = await loop.run_in_executor(self._executor, load)
        except Exception as exc:
            raise ModelError(f"cannot load the FastConformer model {self.model_path!r}: {exc}") from exc
        self._free = list(range(fc.max_streams - 1, -1, -1))
        self._stepper = asyncio.create_task(self._run(), name="asr-fastconformer-steps")
        log.info("FastConformer %s loaded in %.2f s on %s (%d stream slots, %d ms chunks, %s)", self.model_path,
                 time.perf_counter() - t0, fc.device, fc.max_streams, self.chunk_ms,
                 f"CUDA graphs for {self.pool.buckets} streams" if fc.cuda_graphs else "eager")

    async def aclose(self) -> None:
        self._closed = True
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
            self._stepper = None
        for stream in list(self._streams):
            stream.fail(EngineError("ASR engine closed"))
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)  # the step in flight, if any
            self._executor = None
        self.pool = None

    async def __aenter__(self) -> FastConformerAsr:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def chunk_ms(self) -> int:
        return (self.fc.lookahead_frames + 1) * 80

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def queue_depth(self) -> int:
        """Streams with audio waiting to be encoded."""
        return sum(1 for s in self._streams if s.has_work())

    # -- streams ------------------------------------------------------------------------

    def stream(self, *, language: str | None = None) -> FastConformerStream:
        """A new stream in a free slot; CapacityError when all ``max_streams`` are taken.
        ``language`` is not used: the model knows one language."""
        if self._closed or self.pool is None:
            raise EngineError("ASR engine is not running")
        if not self._free:
            raise CapacityError(f"all {self.fc.max_streams} ASR stream slots are in use (asr.fastconformer.max_streams)")
        stream = FastConformerStream(self, self._free.pop())
        self._streams.append(stream)
        return stream

    async def transcribe(self, audio: np.ndarray, *, language: str | None = None) -> Transcript:
        async with self.stream(language=language) as stream:
            stream.push(audio)
            return await stream.finalize()

    def release(self, stream: FastConformerStream) -> None:
        """A closed stream's slot is free again (a step still running for it is ignored)."""
        if stream in self._streams:
            self._streams.remove(stream)
            self._free.append(stream.slot)

    def wake(self) -> None:
        self._due.set()

    def step_stats(self) -> dict[str, float | int]:
        """Steps run, and the last few hundred steps' time (p50, p95, ms) and rows (mean)."""
        return {"steps": self.steps, **self._recent.stats("step", digits=2)}

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)).strip()

    def starts_word(self, token_id: int) -> bool:
        return str(self.tokenizer.convert_ids_to_tokens(token_id)).startswith(_WORD_START)

    # -- the stepper --------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        pool = self.pool
        while True:
            batch = [(s, s.generation, row) for s in self._streams if (row := s.take_row(pool)) is not None]
            if not batch:
                self._due.clear()
                await self._due.wait()
                continue
            t0 = time.perf_counter()
            try:
                tokens = await loop.run_in_executor(self._executor, pool.step, [row for _, _, row in batch])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.stats.failed_decodes += 1
                log.warning("FastConformer step failed: %s", exc, exc_info=True)
                for stream, generation, _ in batch:
                    if stream.generation == generation:  # its utterance is lost: it starts afresh
                        stream.fail(EngineError(f"ASR step failed: {exc}"), close=False)
                        stream.reset()
                continue
            step_s = time.perf_counter() - t0
            self.steps += 1
            self._recent.add(step_s, len(batch))
            for (stream, generation, row), ids in zip(batch, tokens, strict=True):
                stream.deliver(generation, row.keep, ids, step_s)


class FastConformerStream(PartialStream):
    """One call's utterance in a slot of :class:`FastConformerAsr`. Event loop only."""

    def __init__(self, engine: FastConformerAsr, slot: int) -> None:
        self.engine = engine
        self.slot = slot
        self.generation = 0  # bumped by reset(): a step's result for older audio is dropped
        self.partials = PartialQueue()
        self._closed = False
        self._begin()

    def _begin(self) -> None:
        self._pending = np.zeros(_HALF_FFT, np.float32)  # pre-emphasised samples not yet encoded
        self._last = 0.0  # the last raw sample (pre-emphasis continues from it)
        self._samples = 0  # raw samples pushed into this utterance
        self._frames = 0  # mel frames encoded (kept in the slot)
        self._first = True
        self._in_flight = False
        self._tokens: list[int] = []
        self._finals: list[tuple[int, float, asyncio.Future[Transcript]]] = []  # (mel frames, asked at, waiter)

    @property
    def buffered_s(self) -> float:
        return self._samples / ASR_RATE

    def push(self, audio: np.ndarray) -> None:
        if self._closed:
            raise RuntimeError("push() on a closed ASR stream")
        from voicebot.engines.asr.fastconformer_model import preemphasise

        audio = as_mono_f32(audio)
        if audio.size == 0:
            return
        # Unbounded by design only as far as the caller's audio is: the session refuses
        # input beyond session.max_input_backlog_s, and the stepper encodes in real time.
        self._pending = np.concatenate([self._pending, preemphasise(audio, self._last)])
        self._last = float(audio[-1])
        self._samples += audio.size
        self.engine.wake()

    def request_partial(self, covering_s: float | None = None) -> None:
        """Nothing to ask: every complete chunk is decoded as soon as it arrives."""

    async def finalize(self, covering_s: float | None = None) -> Transcript:
        """The transcript of everything pushed so far, ready one step after the last chunk."""
        if self._closed:
            raise RuntimeError("finalize() on a closed ASR stream")
        from voicebot.engines.asr.fastconformer_model import frames_to_cover

        waiter: asyncio.Future[Transcript] = asyncio.get_running_loop().create_future()
        target = frames_to_cover(self._samples, self.engine.fc.lookahead_frames) if self._samples else 0
        self._finals.append((target, time.perf_counter(), waiter))
        self.engine.wake()
        try:
            return await waiter
        finally:
            self._finals = [f for f in self._finals if f[2] is not waiter]

    def reset(self) -> None:
        self._resolve_finals(self._tokens)  # a final still waiting gets the words heard so far
        self.generation += 1
        self._begin()
        self.partials.clear()  # previews of the old utterance are stale

    async def aclose(self) -> None:
        if self._closed:
            return
        self.fail(EngineError("ASR stream closed"))

    def fail(self, exc: Exception, *, close: bool = True) -> None:
        """Fail the waiting finals; with ``close``, end the stream and free its slot."""
        for _, _, waiter in self._finals:
            if not waiter.done():
                waiter.set_exception(exc)
        self._finals = []
        if close and not self._closed:
            self._closed = True
            self.generation += 1
            self.engine.release(self)
            self.partials.put(None)

    # -- the stepper's side ---------------------------------------------------------------

    def has_work(self) -> bool:
        if self._closed or self._in_flight:
            return False
        pool = self.engine.pool
        from voicebot.engines.asr.fastconformer_model import samples_for

        return bool(self._finals) or self._pending.size >= samples_for(pool.chunk_mel_frames(self._first))

    def take_row(self, pool: Any) -> Any:
        """This stream's chunk for the next step: the next complete one, else (a final
        waiting) the last one padded with silence and not kept; or None."""
        from voicebot.engines.asr.fastconformer_model import HOP, PREEMPHASIS, Row, samples_for

        if self._closed or self._in_flight:
            return None
        if self._finals:
            self._resolve_finals(self._tokens, upto=self._frames)
        frames = pool.chunk_mel_frames(self._first)
        need = samples_for(frames)
        if self._pending.size >= need:
            row = Row(self.slot, self._pending[:need].copy(), self._first)
            self._pending = self._pending[frames * HOP :]
            self._frames += frames
            self._first = False
        elif self._finals:
            # The raw audio continues with zeros: pre-emphasised, its first sample is -0.97 x[-1].
            tail = np.zeros(need, np.float32)
            tail[: self._pending.size] = self._pending
            tail[self._pending.size] = -PREEMPHASIS * self._last
            row = Row(self.slot, tail, self._first, keep=False)
        else:
            return None
        self._in_flight = True
        return row

    def deliver(self, generation: int, kept: bool, ids: list[int], step_s: float) -> None:
        if generation != self.generation or self._closed:
            return  # reset or closed while the step ran
        self._in_flight = False
        stats = self.engine.stats
        if not kept:
            stats.final_decodes += 1
            self._resolve_finals(self._tokens + ids)
            return
        if ids:
            self._tokens.extend(ids)
            stats.partial_decodes += 1
            self.partials.put(self._partial())
        self._resolve_finals(self._tokens, upto=self._frames)

    def _resolve_finals(self, ids: list[int], upto: int | None = None) -> None:
        """Answer the finals whose audio is encoded (``upto`` mel frames), or all of them."""
        now = time.perf_counter()
        keep: list[tuple[int, float, asyncio.Future[Transcript]]] = []
        text: str | None = None
        for target, asked, waiter in self._finals:
            if upto is not None and target > upto:
                keep.append((target, asked, waiter))
            elif not waiter.done():
                text = self.engine.text(ids) if text is None else text
                waiter.set_result(Transcript(text, self.buffered_s, now - asked))
        if len(keep) != len(self._finals) and upto is not None:
            self.engine.stats.final_decodes += 1
        self._finals = keep

    def _partial(self) -> Partial:
        """Every word but the last is confirmed (an RNN-T never takes a token back; only
        the last word may still grow)."""
        tokens, engine = self._tokens, self.engine
        cut = next((i for i in range(len(tokens) - 1, -1, -1) if engine.starts_word(tokens[i])), 0)
        confirmed, tentative = engine.text(tokens[:cut]), engine.text(tokens[cut:])
        return Partial(confirmed, tentative, self.buffered_s)

