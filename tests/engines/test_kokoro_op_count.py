"""voicebot/engines/tts/op_count.py: what a forward would dispatch and sync on an accelerator,
counted on a CPU (used by tests/engines/test_kokoro_model.py and benchmarks/gpu_kokoro.py --count)."""

from __future__ import annotations

import torch

from voicebot.engines.tts.op_count import MARK, OpCounter


def test_counts_kernels_views_and_each_kind_of_sync() -> None:
    lin = torch.nn.Linear(4, 4)
    host = torch.ones(2, 4)
    with OpCounter(lin) as oc:
        x = host.to(lin.weight.device)  # the model's device: a blocking copy there
        y = lin(x)
        assert y.device == MARK  # a device tensor's .device reads as the marker
        z = torch.zeros(3, device=y.device)
        y.t()
        host + 1  # host only
        int(y.sum())
        y.cpu()
        y.tolist()
        torch.nonzero(y)
        x.to(y.device)  # already there: nothing
        torch.tensor([1, 2], device=y.device)
        y.to(y.device, non_blocking=True)
    c = oc.counts
    kinds = [s.split()[0] for s in c.syncs]
    assert kinds == ["h2d", "read", "d2h", "read", "shape:nonzero", "h2d"], c.syncs
    assert all("test_kokoro_op_count.py" in s for s in c.syncs), c.syncs
    assert c.views >= 1 and c.host_ops >= 1
    assert c.by_op["addmm"] == 1 and c.by_op["zeros"] == 1 and z.shape == (3,)


def test_an_lstm_is_one_kernel_as_with_cudnn() -> None:
    lstm = torch.nn.LSTM(4, 4, batch_first=True)
    x = torch.randn(2, 50, 4)
    OpCounter.on_device(x)
    with OpCounter(lstm) as oc:
        lstm(x)
    assert oc.counts.fused == 1 and oc.counts.by_op["lstm"] == 1
    assert oc.counts.kernels < 10, oc.counts.summary()  # not ops per time step
