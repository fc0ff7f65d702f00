"""A function of fixed-shape tensors captured as one CUDA graph and replayed.

An eager torch step over a small batch is a few hundred kernel launches, each a few
microseconds of host work, and on a GPU shared with other processes each launch can also
wait for the GPU's time slice. A CUDA graph launches them all at once. It replays the
kernels recorded at capture on the SAME memory: the inputs are copied into buffers that
the graph reads, the outputs are tensors it writes, and every other tensor the function
touches (model weights, state updated in place) must keep its address.

The capture follows torch's documented pattern (``torch.cuda.graphs``): warm-up calls on a
side stream (they build cuBLAS/cuDNN/cuFFT plans and workspaces, which capture may not),
then the capture on that stream. Graphs of one owner share a memory pool (their
intermediates are never live at the same time: one replay at a time, from one thread).
``capture_error_mode="thread_local"`` lets other threads go on with their own CUDA work
(allocations, syncs on their streams) during a capture, which in the default ``global``
mode would invalidate it. Their random ops must still wait: every capture puts the device's
default generator in capture mode, whichever owner makes it, and a draw outside the
capture then fails. Keeping them apart is the owners' work (a lock, or captures made only
before other threads run).

This module imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

Output: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...]


class CapturedCall:
    """``fn(*inputs) -> output`` (a tensor or a tuple of them) recorded once; :meth:`__call__`
    copies new values into the inputs and replays it. The output tensors are overwritten by
    the next replay."""

    def __init__(
        self,
        fn: Callable[..., Output],
        inputs: tuple[torch.Tensor, ...],
        *,
        stream: torch.cuda.Stream,
        pool: tuple[int, int] | None = None,
        warmup: int = 3,
        capture_error_mode: str = "global",
    ) -> None:
        self.inputs = inputs
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            self.output = fn(*inputs)

    def __call__(self, *values: torch.Tensor) -> Output:
        for buffer, value in zip(self.inputs, values, strict=True):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.output
