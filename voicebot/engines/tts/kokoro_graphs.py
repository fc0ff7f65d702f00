"""Kokoro's encode and decode over a few padded shapes, each captured as a CUDA graph and replayed.

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
Once :meth:`~_Bucketed.warm_up` has run, nothing more is captured: a bucket it did not
reach runs eagerly. A capture puts the device's default random generator in capture mode,
and a random draw from another thread meanwhile (the vocoder's noise in the other forward
slot, eager or replayed) fails; before the service takes calls only one thread runs.

:class:`BucketedEncoder` does the same for the encode up to the alignment
(``kokoro_model.encode_tokens``: the PL-BERT, the text and duration encoders, their LSTMs:
hundreds of small launches a forward), over (rows, phonemes) buckets with the rows' own lengths masked;
the alignment, whose shape is the frame count, stays eager (a dozen launches). Its graphs
have their own pool, stream and lock, so one forward's encode replays while another's
decode does. If a capture fails where the same encode runs eagerly (a PyTorch that cannot
capture some op), every encode runs eagerly and unpadded from then on, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from voicebot.engines.tts import kokoro_model as km

log = logging.getLogger(__name__)

MISSES_LOGGED = 8  # eager batches after the warm-up named in the log (each one is counted)


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


class GraphSet:
    """CUDA graphs of one owner: one memory pool, one stream, one replay (or capture) at a
    time behind a lock, each thread's wait for it counted (:meth:`take_lock_wait`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[Any, Any] = {}  # key -> cuda_graphs.CapturedCall
        self.captures = 0
        self._lock = threading.Lock()
        self._waited = threading.local()  # per forward thread: seconds spent waiting for _lock
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def take_lock_wait(self) -> float:
        """Seconds the calling thread has waited for the lock since it last asked."""
        waited, self._waited.s = getattr(self._waited, "s", 0.0), 0.0
        return float(waited)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, its wait counted for this thread."""
        t0 = time.perf_counter()
        with self._lock:
            self._waited.s = getattr(self._waited, "s", 0.0) + time.perf_counter() - t0
            yield

    def replay(self, key: Any, fn: Any, *inputs: torch.Tensor) -> Any:
        """``fn(*inputs)``'s graph for ``key`` (captured now if new) replayed on ``inputs``:
        copies of its output tensors, ordered after the caller's stream and before the
        caller's next work."""
        from voicebot.engines.cuda_graphs import CapturedCall

        caller = torch.cuda.current_stream(self.device)
        with self.locked():
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._pool = torch.cuda.graph_pool_handle()
            stream = self._stream
            graph = self.graphs.get(key)
            if graph is None:
                static = tuple(x.clone() for x in inputs)  # CapturedCall orders its stream after these
                # thread_local: the other forward slots' work (allocations, their syncs) goes
                # on during the capture; every replay of this set waits on the lock.
                graph = self.graphs[key] = CapturedCall(fn, static, stream=stream, pool=self._pool,
                                                        capture_error_mode="thread_local")
                self.captures += 1
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                out = graph(*inputs)
                out = tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone()
            caller.wait_stream(stream)
            for x in out if isinstance(out, tuple) else (out,):
                x.record_stream(caller)
        return out


class _Bucketed:
    """What the two stages' bucketed runs share: the model's device, their graphs, and the
    rule that pads a batch of ``rows`` x ``length`` (frames or phonemes) to a bucket."""

    def __init__(self, model: Any, cuda_graphs: bool, row_buckets: list[int], length_buckets: list[int],
                 max_cells: int) -> None:
        self.model = model
        self.device = torch.device(model.device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"Kokoro CUDA graphs need the model on a CUDA device, not {self.device}")
        self.cuda_graphs = cuda_graphs
        self.row_buckets = row_buckets
        self.length_buckets = length_buckets
        self.max_cells = max_cells  # rows x length: larger batches run eagerly, uncaptured
        self.graphs = GraphSet(self.device)
        self.eager_calls = 0
        self.capture_new = True  # False once warmed up: only the warmed buckets replay (module docstring)
        self.pad = True  # False: every batch runs as it is (graphs given up)

    @property
    def captures(self) -> int:
        return self.graphs.captures

    def _missed(self, what: str, rows: int, length: int) -> None:
        """Count a batch run eagerly; after the warm-up, say so in the log (the first few):
        with ``tts.kokoro_compile`` such a batch may wait seconds for a compile."""
        self.eager_calls += 1
        if not self.capture_new and self.eager_calls <= MISSES_LOGGED:
            log.warning("kokoro: a %s batch of %d rows x %d ran eagerly, past the captured buckets (%d so far)",
                        what, rows, length, self.eager_calls)

    def take_lock_wait(self) -> float:
        """Seconds the calling thread has waited for the graphs' lock since it last asked."""
        return self.graphs.take_lock_wait()

    def shape(self, rows: int, length: int) -> tuple[int, int] | None:
        """The (rows, length) bucket a batch pads to; None: past the buckets, run as it is."""
        r = next((b for b in self.row_buckets if b >= rows), None)
        n = next((b for b in self.length_buckets if b >= length), None)
        if r is None or n is None or r * n > self.max_cells:
            return None
        return r, n

    def replayable(self, key: Any) -> bool:
        """Whether the bucket ``key`` runs padded: without graphs always, with them if it
        was captured or may still be (before the warm-up's end); never once graphs are given up."""
        return self.pad and (not self.cuda_graphs or self.capture_new or key in self.graphs.graphs)

    def _warm_up(self, max_rows: int, max_length: int, run: Callable[[int, int], object]) -> list[tuple[int, int]]:
        """``run(rows, length)`` on zeros for every bucket up to ``max_rows`` x ``max_length``
        (with ``cuda_graphs``: each captured), then no more captures. Returns the buckets."""
        shapes = self.warm_shapes(max_rows, max_length)
        with torch.inference_mode():
            for rows, length in shapes:
                run(rows, length)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_new = False
        return shapes

    def warm_shapes(self, max_rows: int, max_length: int) -> list[tuple[int, int]]:
        """Every bucket a batch of up to ``max_rows`` rows of ``max_length`` pads to, fewest rows first."""
        top_rows = next((b for b in self.row_buckets if b >= max_rows), self.row_buckets[-1])
        top_length = next((b for b in self.length_buckets if b >= max_length), self.length_buckets[-1])
        return [(r, n) for r in self.row_buckets if r <= top_rows for n in self.length_buckets
                if n <= top_length and r * n <= self.max_cells]


class BucketedDecoder(_Bucketed):
    """``decode(items)`` like ``kokoro_model.decode``, over bucketed shapes (module docstring)."""

    def __init__(self, model: Any, *, cuda_graphs: bool = False, max_frames: int = 64 * 300,
                 max_rows: int = 128, min_frames: int = 16) -> None:
        # max_frames: a group's padded frames, all rows (the cell limit)
        super().__init__(model, cuda_graphs, buckets(max_rows), buckets(max_frames, min_frames), max_frames)

    @torch.no_grad()
    def decode(self, items: Sequence[km.Encoded]) -> list[torch.Tensor]:
        frames = [it.frames for it in items]
        shape = self.shape(len(items), max(frames))
        if shape is None or not self.replayable(shape):
            self._missed("decode", len(items), max(frames))
            if not self.cuda_graphs:
                return km.decode(self.model, items)
            with self.graphs.locked():  # its noise source must not draw while a capture records the RNG
                return km.decode(self.model, items)
        rows, fmax = shape
        en, asr, styles, frames_dev = km.gather(items, max(frames))
        en = _pad_to(en, rows, fmax)
        asr = _pad_to(asr, rows, fmax)
        styles = _pad_rows(styles, rows)
        frames_dev = _pad_rows(frames_dev, rows, fmax)
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
        en_ch, asr_ch = km.feature_channels(self.model)

        def run(rows: int, frames: int) -> None:
            en = torch.zeros(rows, en_ch, frames, device=self.device)
            asr = torch.zeros(rows, asr_ch, frames, device=self.device)
            styles = torch.zeros(rows, 256, device=self.device)
            counts = torch.full((rows,), frames, device=self.device, dtype=torch.long)
            if self.cuda_graphs:
                self._replay((rows, frames), en, asr, styles, counts)
            else:
                km.decode_rows(self.model, en, asr, styles, counts, masked=True)

        return self._warm_up(max_rows, max_frames, run)

    def _replay(self, key: tuple[int, int], *inputs: torch.Tensor) -> torch.Tensor:
        def run(en: torch.Tensor, asr: torch.Tensor, styles: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
            return km.decode_rows(self.model, en, asr, styles, frames, masked=True)

        out: torch.Tensor = self.graphs.replay(key, run, *inputs)
        return out


def _pad_rows(x: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    """``x`` with rows of ``value`` added up to ``rows`` (a bucket's padded rows)."""
    if rows <= x.shape[0]:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), value)])


def _pad_to(x: torch.Tensor, rows: int, frames: int) -> torch.Tensor:
    """``x`` [B, C, F] zero-padded to [rows, C, frames]."""
    out = x.new_zeros(rows, x.shape[1], frames)
    out[: x.shape[0], :, : x.shape[2]] = x
    return out


class BucketedEncoder(_Bucketed):
    """``encode(ids, styles, speeds, durations)`` like ``kokoro_model.encode``, over
    (rows, phonemes) buckets (module docstring)."""

    def __init__(self, model: Any, *, cuda_graphs: bool = False, max_rows: int = 128, max_tokens: int = 512,
                 min_tokens: int = 16, max_cells: int = 16_384) -> None:
        super().__init__(model, cuda_graphs, buckets(max_rows), buckets(max_tokens, min_tokens), max_cells)

    @torch.no_grad()
    def encode(self, ids: Sequence[Sequence[int]], styles: torch.Tensor, speeds: Sequence[float],
               durations: Sequence[Sequence[int]] | None = None) -> list[km.Encoded]:
        shape = self.shape(len(ids), max(len(i) for i in ids) + 2)
        if shape is None or not self.replayable((*shape, durations is not None)):
            self._missed("encode", len(ids), max(len(i) for i in ids) + 2)
            return km.encode(self.model, ids, styles, speeds, durations)
        rows, t = shape
        tb = km.tokens(self.device, ids, durations, rows=rows, t=t)
        padded = _pad_rows(styles, rows)
        # One of the two, by mode: forced frames per phoneme (random weights) or the speeds.
        last = tb.forced if tb.forced is not None else km.speeds_tensor(speeds, rows, styles)
        d, t_en, cum = self._run((rows, t, tb.forced is not None), tb.ids, tb.lengths, padded, last)
        return km.align(d, t_en, cum, styles, tb.frames)

    def warm_up(self, max_rows: int, max_tokens: int, *, forced: bool = False) -> list[tuple[int, int]]:
        """Run (with ``cuda_graphs``: capture) every bucket up to ``max_rows`` rows of
        ``max_tokens`` phonemes once, before the service takes calls (BucketedDecoder.warm_up).
        ``forced``: the buckets of forced durations (random-weight benchmarks)."""
        def run(rows: int, t: int) -> None:
            ids = torch.zeros(rows, t, dtype=torch.long, device=self.device)
            lengths = torch.full((rows,), t, dtype=torch.long, device=self.device)
            styles = torch.zeros(rows, 256, device=self.device)
            last = torch.ones(rows, t, dtype=torch.long, device=self.device) if forced else \
                torch.ones(rows, device=self.device)
            self._run((rows, t, forced), ids, lengths, styles, last)

        return self._warm_up(max_rows, max_tokens, run)

    def _run(self, key: tuple[int, int, bool], ids: torch.Tensor, lengths: torch.Tensor, styles: torch.Tensor,
             last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forced = key[2]

        def run(ids: torch.Tensor, lengths: torch.Tensor, styles: torch.Tensor,
                last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return km.encode_tokens(self.model, ids, lengths, styles, None if forced else last,
                                    last if forced else None, ragged=True)

        if not self.cuda_graphs:
            return run(ids, lengths, styles, last)
        try:
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self.graphs.replay(key, run, ids, lengths,
                                                                                      styles, last)
            return out
        except Exception:
            if key in self.graphs.graphs:
                raise  # a replay failed, not a capture
            eager = run(ids, lengths, styles, last)  # raises if the inputs, not the capture, are at fault
            # A capture this PyTorch cannot make: eager is correct, only slower.
            log.warning("Kokoro: the encode cannot be captured as a CUDA graph; every encode runs eagerly",
                        exc_info=True)
            self.cuda_graphs = self.pad = False
            with self.graphs.locked():
                self.graphs.graphs.clear()  # their pool's memory goes back once no replay holds it
            return eager
