"""Kokoro's decode over a few padded shapes, each captured as a CUDA graph and replayed.

A decode of one clause launches thousands of small kernels: on a GPU the host's launches,
not the kernels, set its time. :class:`BucketedDecoder` pads a vocoder group to the next
(rows, frames) bucket (rows: 1, 2, 3, 4, 6, 8 ...; frames: 16, 24, 32, 48, 64 ...: powers
of two and the halfway points, so padding wastes at most a third of each) and runs
``kokoro_model.decode_rows`` on it with the padding masks on. The masks make every norm
and conv blind to the padded frames, and padded rows (zeros, of the bucket's full length)
are rows of their own: each clause gets the audio it gets unpadded, but for the very end
of the utterance (kokoro_model's docstring).

With ``cuda_graphs`` each bucket's ``decode_rows`` is captured on its first use
(``engines/cuda_graphs.py``; all graphs share one memory pool and replay on one stream,
one at a time) and replayed after; a group larger than ``max_frames`` padded frames runs
eagerly. Without, the same padded function runs eagerly (what tests check on a CPU).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from voicebot.engines.tts import kokoro_model as km


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two and the halfway points between them, from ``start`` up to the first
    at or above ``limit``."""
    out: list[int] = []
    b = start
    while True:
        for x in (b, b + b // 2):
            if x >= start and (not out or x > out[-1]):
                out.append(x)
                if x >= limit:
                    return out
        b *= 2


class BucketedDecoder:
    """``decode(items)`` like ``kokoro_model.decode``, over bucketed shapes (module docstring)."""

    def __init__(self, model: Any, *, cuda_graphs: bool = False, max_frames: int = 64 * 300,
                 max_rows: int = 128, min_frames: int = 16) -> None:
        self.model = model
        self.device = torch.device(model.device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"Kokoro CUDA graphs need the model on a CUDA device, not {self.device}")
        self.cuda_graphs = cuda_graphs
        self.max_frames = max_frames
        self.row_buckets = buckets(max_rows)
        self.frame_buckets = buckets(max_frames, min_frames)
        self._graphs: dict[tuple[int, int], Any] = {}  # (rows, frames) -> cuda_graphs.CapturedCall
        self._lock = threading.Lock()  # one capture or replay at a time: the graphs share their pool
        self._waited = threading.local()  # per forward thread: seconds spent waiting for _lock
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None
        self.captures = 0
        self.eager_calls = 0

    def take_lock_wait(self) -> float:
        """Seconds the calling thread has waited for the lock since it last asked."""
        waited, self._waited.s = getattr(self._waited, "s", 0.0), 0.0
        return float(waited)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, its wait counted for this thread (take_lock_wait)."""
        t0 = time.perf_counter()
        with self._lock:
            self._waited.s = getattr(self._waited, "s", 0.0) + time.perf_counter() - t0
            yield

    def shape(self, rows: int, frames: int) -> tuple[int, int] | None:
        """The (rows, frames) bucket a group pads to; None: beyond ``max_frames``, run as it is."""
        r = next((b for b in self.row_buckets if b >= rows), None)
        f = next((b for b in self.frame_buckets if b >= frames), None)
        if r is None or f is None or r * f > self.max_frames:
            return None
        return r, f

    @torch.no_grad()
    def decode(self, items: Sequence[km.Encoded]) -> list[torch.Tensor]:
        frames = [it.frames for it in items]
        shape = self.shape(len(items), max(frames))
        if shape is None:
            self.eager_calls += 1
            if not self.cuda_graphs:
                return km.decode(self.model, items)
            with self._locked():  # its noise source must not draw while a capture records the RNG
                return km.decode(self.model, items)
        rows, fmax = shape
        en, asr, styles, frames_dev = km.gather(items, max(frames))
        n = len(items)
        en = _pad_to(en, rows, fmax)
        asr = _pad_to(asr, rows, fmax)
        styles = torch.cat([styles, styles.new_zeros(rows - n, styles.shape[1])]) if rows > n else styles
        frames_dev = torch.cat([frames_dev, frames_dev.new_full((rows - n,), fmax)]) if rows > n else frames_dev
        if not self.cuda_graphs:
            audio = km.decode_rows(self.model, en, asr, styles, frames_dev, masked=True)
        else:
            audio = self._replay((rows, fmax), en, asr, styles, frames_dev)
        return [audio[i, : f * km.SAMPLES_PER_FRAME] for i, f in enumerate(frames)]

    def warm_up(self, max_rows: int, max_frames: int) -> list[tuple[int, int]]:
        """Run (with ``cuda_graphs``: capture) every bucket up to ``max_rows`` rows of
        ``max_frames`` frames once, on zeros: a service does it before it takes calls, so that
        no caller waits for a capture (or, with ``tts.kokoro_compile``, a compile: seconds).
        Returns the buckets run, fewest rows first."""
        top_rows, top_frames = self.shape(max_rows, max_frames) or (max_rows, max_frames)
        shapes = [(r, f) for r in self.row_buckets if r <= top_rows for f in self.frame_buckets
                  if f <= top_frames and r * f <= self.max_frames]
        with torch.inference_mode():
            en_ch, asr_ch = km.feature_channels(self.model)
            for rows, frames in shapes:
                en = torch.zeros(rows, en_ch, frames, device=self.device)
                asr = torch.zeros(rows, asr_ch, frames, device=self.device)
                styles = torch.zeros(rows, 256, device=self.device)
                counts = torch.full((rows,), frames, device=self.device, dtype=torch.long)
                if self.cuda_graphs:
                    self._replay((rows, frames), en, asr, styles, counts)
                else:
                    km.decode_rows(self.model, en, asr, styles, counts, masked=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return shapes

    def _replay(self, key: tuple[int, int], *inputs: torch.Tensor) -> torch.Tensor:
        """The bucket's graph (captured now if new) on ``inputs``: a copy of its audio, ordered
        after the caller's stream and before the caller's next work."""
        from voicebot.engines.cuda_graphs import CapturedCall

        caller = torch.cuda.current_stream(self.device)
        with self._locked():
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._pool = torch.cuda.graph_pool_handle()
            stream = self._stream
            graph = self._graphs.get(key)
            if graph is None:
                static = tuple(x.clone() for x in inputs)  # CapturedCall orders its stream after these

                def run(en: torch.Tensor, asr: torch.Tensor, styles: torch.Tensor,
                        frames: torch.Tensor) -> torch.Tensor:
                    return km.decode_rows(self.model, en, asr, styles, frames, masked=True)

                # thread_local: the other forward slots' encodes (allocations, their one
                # sync) go on during the capture; every decode waits on the lock.
                graph = self._graphs[key] = CapturedCall(run, static, stream=stream, pool=self._pool,
                                                         capture_error_mode="thread_local")
                self.captures += 1
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                out = graph(*inputs).clone()
            caller.wait_stream(stream)
            out.record_stream(caller)
        return out


def _pad_to(x: torch.Tensor, rows: int, frames: int) -> torch.Tensor:
    """``x`` [B, C, F] zero-padded to [rows, C, frames]."""
    out = x.new_zeros(rows, x.shape[1], frames)
    out[: x.shape[0], :, : x.shape[2]] = x
    return out
