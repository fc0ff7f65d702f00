"""Which frames of a padded decode are each utterance's own.

A decode runs utterances of different lengths padded to the longest (``kokoro_model``'s
docstring). While it runs, this thread's padding context holds each row's frame count;
every instance norm and conv that ``kokoro_model.mask_padding`` (or ``kokoro_fused``) made
blind to padding reads its masks from :func:`padding_masks`, at its own time resolution.
Per thread: each forward slot decodes on a thread of its own. This module imports torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# .frames: [B] each utterance's frame count on the device (None: no padding), .fmax: the
# padded count, .masks: the masks made from them, by (length, dtype).
_ctx = threading.local()


@contextmanager
def padded(frames: torch.Tensor | None, fmax: int) -> Iterator[None]:
    """This thread's decode of rows of ``frames`` frames each, padded to ``fmax`` (None: none
    is padded, every mask is None)."""
    _ctx.frames = frames
    _ctx.fmax = fmax
    _ctx.masks = {}
    try:
        yield
    finally:
        _ctx.frames = None
        _ctx.masks = {}


def padding_masks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For ``x`` [B, C, L]: ``m`` [B, 1, L], 1.0 over each utterance's own frames at ``x``'s
    length, and ``w`` [B, L, 1], ``m`` over its count (a mean is ``x @ w``); None: no padding."""
    frames = getattr(_ctx, "frames", None)
    if frames is None:
        return None
    length = x.shape[-1]
    cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = _ctx.masks
    mw = cache.get((length, x.dtype))
    if mw is None:
        # Every layer's length is a * frames + c (c: 0, or the generator's +1 sample of
        # reflection padding): an utterance of f frames has a * f + c of them.
        scale = length // _ctx.fmax
        valid = frames * scale + (length - scale * _ctx.fmax)  # [B]
        m = (torch.arange(length, device=x.device)[None, :] < valid[:, None]).to(x.dtype)
        w = (m / valid[:, None].to(x.dtype))[:, :, None]
        mw = cache[(length, x.dtype)] = (m[:, None, :], w)
    return mw
