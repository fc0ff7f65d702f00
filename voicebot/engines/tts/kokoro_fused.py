"""Kokoro's decoder and vocoder with fewer passes over their activations.

At the generator's time resolution (120 samples per frame x 128 channels in its last
stage) a batched decode is memory-bound: each elementwise op reads and writes a whole
[B, C, T] tensor, and the package's modules run a chain of them around every conv: the
instance norm (centre, variance, scale, its affine), the AdaIN's ``(1 + gamma) * x + beta``,
Snake (``x + 1/a * sin(a x)^2``: four ops) or a leaky ReLU, and the padding mask of the
next conv (``kokoro_model.mask_padding``). :func:`install` replaces the forwards of the
modules that run those chains (``AdaINResBlock1``, ``AdainResBlk1d``, ``Generator``) by
ones that run each chain as :func:`norm_act`:

- the norm's affine and the AdaIN's are folded into one per-row, per-channel scale and
  shift ([B, C, 1], from the style vector), applied in one ``addcmul``;
- the activation is applied in place, and the mask once, on the conv's input; the conv
  then runs without its own mask multiply (``conv_raw``);
- with ``compile`` (``tts.kokoro_compile``) the chain is one ``torch.compile``-d function
  of dynamic shapes (compiled once per kind of call site, not per clause length): Inductor
  fuses it into a reduction for the statistics and one pointwise kernel. The rest of the
  model stays eager.

Same outputs as the package's forwards with ``kokoro_model``'s masks, but for rounding
(tests/engines/test_kokoro_fused.py). This module imports torch only, and ``kokoro_padding``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from voicebot.engines.tts.kokoro_padding import padding_masks

Masks = tuple[torch.Tensor, torch.Tensor] | None  # kokoro_padding.padding_masks: (m [B, 1, L], w [B, L, 1])
RSQRT2 = 1 / math.sqrt(2)  # AdainResBlk1d's torch.rsqrt(torch.tensor(2)), without two host ops per call


def _coefficients(adain: Any, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaIN1d's style affine folded with its instance norm's own: ``(1 + gamma) * weight``
    and ``(1 + gamma) * bias + beta``, each [B, C, 1]."""
    h = adain.fc(s)[:, :, None]
    gamma, beta = h.chunk(2, dim=1)
    g1 = 1 + gamma
    norm = adain.norm
    if norm.weight is None:
        return g1, beta
    return g1 * norm.weight[:, None], torch.addcmul(beta, g1, norm.bias[:, None])


def _norm_act_eager(x: torch.Tensor, m: torch.Tensor | None, w: torch.Tensor | None, scale: torch.Tensor,
                    shift: torch.Tensor, eps: float, alpha: torch.Tensor | None, inv_alpha: torch.Tensor | None,
                    slope: float) -> torch.Tensor:
    """The chain in as few eager passes as torch's ops allow (see :func:`norm_act`)."""
    if m is None or w is None:
        # group_norm's arithmetic: x * a + (shift - mean * a), one pass after the statistics.
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        a = scale * torch.rsqrt(var + eps)
        y = torch.addcmul(shift - mean * a, x, a)
    else:
        # As kokoro_model._masked_instance_norm: statistics over each row's own frames,
        # centred about the first frame (a constant channel then centres to exactly 0).
        xc = x - x[:, :, :1]
        xc.sub_(torch.bmm(xc, w))
        var = torch.bmm(xc * xc, w)
        y = torch.addcmul(shift, xc, scale * torch.rsqrt(var + eps))
    if alpha is not None and inv_alpha is not None:
        t = torch.sin(alpha * y)
        y.addcmul_(t.mul_(t), inv_alpha)  # Snake: y + 1/a * sin(a y)^2
    else:
        y = F.leaky_relu_(y, slope)
    if m is not None:
        y.mul_(m)
    return y


def _norm_act_fusable(x: torch.Tensor, m: torch.Tensor | None, w: torch.Tensor | None, scale: torch.Tensor,
                      shift: torch.Tensor, eps: float, alpha: torch.Tensor | None, inv_alpha: torch.Tensor | None,
                      slope: float) -> torch.Tensor:
    """The chain as plain pointwise ops and sums, which Inductor fuses (a ``bmm`` would stay
    an external kernel with its operand materialised)."""
    if m is None or w is None:
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        xc = x - mean
    else:
        wt = w.transpose(1, 2)  # [B, 1, L]: each row's mask over its frame count
        d = x - x[:, :, :1]
        xc = d - (d * wt).sum(-1, keepdim=True)
        var = (xc * xc * wt).sum(-1, keepdim=True)
    y = xc * (scale * torch.rsqrt(var + eps)) + shift
    if alpha is not None and inv_alpha is not None:
        y = y + inv_alpha * torch.sin(alpha * y) ** 2
    else:
        y = F.leaky_relu(y, slope)
    if m is not None:
        y = y * m
    return y


def _leaky_masked_eager(x: torch.Tensor, m: torch.Tensor | None, slope: float) -> torch.Tensor:
    y = F.leaky_relu(x, slope)
    return y if m is None else y.mul_(m)


def _leaky_masked_fusable(x: torch.Tensor, m: torch.Tensor | None, slope: float) -> torch.Tensor:
    y = F.leaky_relu(x, slope)
    return y if m is None else y * m


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
RECOMPILE_LIMIT = 64


def _compile(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """One ``torch.compile`` of ``fn`` per process, shared by every model: Dynamo compiles
    per guard set (masked or not, Snake or leaky ReLU, batch 1 or more), with symbolic sizes."""
    if name not in _compiled:
        # The chains see each of the model's channel widths (a guard each: a parameter's
        # size is no symbol) and masked or not: past dynamo's default of 8 versions of a
        # function it runs the rest eagerly (seen on an H200: 128 against 512 channels).
        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, RECOMPILE_LIMIT)
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def compiles() -> int:
    """Graphs Dynamo has compiled in this process so far (its own counter): after the
    warm-up, a rise is a caller's batch waiting seconds for a compile."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Chains:
    """The two chains a model runs, eager or compiled."""

    def __init__(self, compile: bool) -> None:
        self.compiled = compile
        self._norm_act = _compile("norm_act", _norm_act_fusable) if compile else _norm_act_eager
        self._leaky = _compile("leaky_masked", _leaky_masked_fusable) if compile else _leaky_masked_eager

    def norm_act(self, x: torch.Tensor, masks: Masks, adain: Any, s: torch.Tensor, *,
                 alpha: torch.Tensor | None = None, inv_alpha: torch.Tensor | None = None,
                 slope: float = 0.0) -> torch.Tensor:
        """``adain(x, s)`` (instance norm, its affine, the style's), then Snake (``alpha``) or a
        leaky ReLU (``slope``), then zeros past each row's end (``masks``): a conv's input."""
        scale, shift = _coefficients(adain, s)
        m, w = masks if masks is not None else (None, None)
        return self._norm_act(x, m, w, scale, shift, adain.norm.eps, alpha, inv_alpha, slope)

    def leaky_masked(self, x: torch.Tensor, masks: Masks, slope: float) -> torch.Tensor:
        return self._leaky(x, None if masks is None else masks[0], slope)


def conv_raw(conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    """The conv's own forward, without ``mask_padding``'s multiply: ``x`` is already masked."""
    return type(conv).forward(conv, x)


def _snake_resblock_forward(self: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """AdaINResBlock1.forward: per dilation, AdaIN + Snake into a conv, twice, plus the residual."""
    chains: Chains = self._chains
    masks = padding_masks(x)
    for c1, c2, n1, n2, a1, a2, i1, i2 in zip(self.convs1, self.convs2, self.adain1, self.adain2,
                                              self.alpha1, self.alpha2, *self._inv, strict=True):
        xt = conv_raw(c1, chains.norm_act(x, masks, n1, s, alpha=a1, inv_alpha=i1))
        xt = conv_raw(c2, chains.norm_act(xt, masks, n2, s, alpha=a2, inv_alpha=i2))
        x = xt.add_(x)  # xt is the conv's own output: x (the caller's) is left as it was
    return x


def _adain_resblk_forward(self: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """AdainResBlk1d.forward (dropout is off in eval): AdaIN + leaky ReLU into each conv."""
    chains: Chains = self._chains
    slope = self.actv.negative_slope
    r = chains.norm_act(x, padding_masks(x), self.norm1, s, slope=slope)
    if self.upsample_type == "none":
        r = conv_raw(self.conv1, r)
    else:  # the depthwise transposed conv doubles the length: conv1 masks at the new one
        r = self.conv1(conv_raw(self.pool, r))
    r = conv_raw(self.conv2, chains.norm_act(r, padding_masks(r), self.norm2, s, slope=slope))
    return r.add_(self._shortcut(x)).mul_(RSQRT2)


def _generator_forward(self: Any, x: torch.Tensor, s: torch.Tensor, f0: torch.Tensor) -> torch.Tensor:
    """Generator.forward with each leaky ReLU and the next conv's mask in one pass."""
    chains: Chains = self._chains
    f0 = self.f0_upsamp(f0[:, None]).transpose(1, 2)
    har_source, _, _ = self.m_source(f0)
    har_spec, har_phase = self.stft.transform(har_source.transpose(1, 2).squeeze(1))
    har = torch.cat([har_spec, har_phase], dim=1)
    for i in range(self.num_upsamples):
        x_source = self.noise_res[i](self.noise_convs[i](har), s)
        x = conv_raw(self.ups[i], chains.leaky_masked(x, padding_masks(x), 0.1))
        if i == self.num_upsamples - 1:
            x = self.reflection_pad(x)
        x = x.add_(x_source)
        xs = self.resblocks[i * self.num_kernels](x, s)
        for j in range(1, self.num_kernels):
            xs = xs.add_(self.resblocks[i * self.num_kernels + j](x, s))
        x = xs.div_(self.num_kernels)
    x = conv_raw(self.conv_post, chains.leaky_masked(x, padding_masks(x), 0.01))
    spec = torch.exp(x[:, : self.post_n_fft // 2 + 1, :])
    phase = torch.sin(x[:, self.post_n_fft // 2 + 1 :, :])
    return self.stft.inverse(spec, phase)


def install(model: nn.Module, *, compile: bool = False) -> Chains:
    """Replace the forwards of ``model``'s AdaIN blocks and generator by the fused ones
    (after ``kokoro_model.mask_padding`` and ``fast_paths``, which they build on)."""
    chains = Chains(compile)
    for mod in model.modules():
        name = type(mod).__name__
        if name == "AdaINResBlock1":
            if not hasattr(mod, "_inv"):
                raise ValueError("kokoro_fused.install needs kokoro_model.fast_paths first")
            mod._chains = chains
            mod.forward = types.MethodType(_snake_resblock_forward, mod)
        elif name == "AdainResBlk1d":
            mod._chains = chains
            mod.forward = types.MethodType(_adain_resblk_forward, mod)
        elif name == "Generator":
            mod._chains = chains
            mod.forward = types.MethodType(_generator_forward, mod)
    return chains
