"""Count what a torch forward dispatches, on a CPU, as if its model were on an accelerator.

On a GPU every op that touches device memory costs a kernel launch (5-20 us of host time),
every view op a few us of dispatch, and every host-device sync stalls the host until the
device has drained its queue: a sync in the middle of a forward serialises host and device
time instead of overlapping them. :class:`OpCounter` measures those three on a CPU run:

- device tensors are the model's parameters and buffers, the tensors handed to
  :meth:`OpCounter.on_device`, tensors made with ``device=`` the marker device (a tagged
  tensor's ``.device``), and every result of an op with a device tensor among its inputs;
- a **sync** is what would make the host wait for the device: reading a device tensor's
  value (``.item()``, ``int()``, ``bool()``, ``.tolist()``, ``.numpy()``, an op that reads
  one in C++, such as ``torch.istft``'s window check), a copy to the host (``.cpu()``), and
  a blocking host-to-device copy (``.to(device)`` without ``non_blocking``: PyTorch then
  synchronises the stream, ``at::cuda::memcpy_and_sync``), and ops whose output shape
  depends on device data (``nonzero``, ``repeat_interleave`` with tensor repeats, ...);
- ops are counted at the dispatcher (``TorchDispatchMode``), after autograd's
  decompositions. Where the CPU decomposes further than CUDA does, the counter takes the
  CUDA view: an ``LSTM`` (cuDNN: one call; on a CPU, ops per time step) and
  ``scaled_dot_product_attention`` (one fused kernel) count as one device op each.

The marker device is ``cpu:0``: on a CPU it makes real (if pointless) copies, so that
"copy this to the model's device" stays visible; the forward's results are unchanged.
"""

from __future__ import annotations

import collections
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MARK = torch.device("cpu", 0)  # what a device tensor's .device reads as while counting
_TAG = "_voicebot_on_device"

# Ops whose output shape depends on tensor values: the host must read them first.
_DATA_DEPENDENT = {"nonzero", "nonzero_static", "masked_select", "unique", "_unique2", "unique_consecutive",
                   "unique_dim", "repeat_interleave", "bincount", "histc"}
# One fused CUDA kernel each, decomposed into many ops on a CPU.
_FUSED = {"lstm", "gru", "rnn_tanh", "rnn_relu", "scaled_dot_product_attention"}
_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}


def _on_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and getattr(x, _TAG, False)


def _tag(x: Any) -> None:
    if isinstance(x, torch.Tensor):
        setattr(x, _TAG, True)


def _where() -> str:
    """The innermost frame outside torch and this module: where a sync was asked for."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith(("/voicebot/engines/tts/op_count.py", "/contextlib.py")):
            continue
        return f"{f.rsplit('/', 1)[-1]}:{fr.lineno} {fr.name}"
    return "?"


@dataclass
class Counts:
    """What one counted run dispatched."""

    kernels: int = 0  # device ops that are not views: a kernel launch each on a GPU
    views: int = 0  # device view ops (metadata only, no launch)
    host_ops: int = 0  # ops on host tensors only
    fused: int = 0  # LSTM / attention calls, one cuDNN or fused kernel each (counted in kernels too)
    syncs: list[str] = field(default_factory=list)  # "kind where" for each sync
    by_op: collections.Counter[str] = field(default_factory=collections.Counter)  # device kernels by aten op

    def summary(self, top: int = 15) -> dict[str, Any]:
        kinds = collections.Counter(s.split(" ", 1)[0] for s in self.syncs)
        return {"device_kernels": self.kernels, "device_views": self.views, "host_ops": self.host_ops,
                "fused_calls": self.fused, "syncs": len(self.syncs), "syncs_by_kind": dict(kinds),
                "syncs_at": dict(collections.Counter(self.syncs).most_common()),
                "top_kernels": dict(self.by_op.most_common(top))}


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts, owner: OpCounter) -> None:
        super().__init__()
        self.c = counts
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.owner.fused_depth:
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under inference_mode the dispatcher hands composite ops (linear, item,
            # instance_norm, istft, ...) to the mode undecomposed: count what they run.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        dev_in = any(_on_device(x) for x in flat_in)
        name = func.overloadpacket.__name__
        to_dev = kwargs.get("device") == MARK
        c = self.c
        if name == "_to_copy" and dev_in and kwargs.get("device") not in (None, MARK):
            c.syncs.append(f"d2h {_where()}")  # .cpu(), .to("cpu")
            c.host_ops += 1
            return out
        if name == "_to_copy" and dev_in and to_dev and out.dtype == args[0].dtype:
            _tag(out)  # .to(its own device): no op on a GPU
            return out
        if name == "_to_copy" and not dev_in and to_dev:
            if not kwargs.get("non_blocking"):
                c.syncs.append(f"h2d {_where()}")
        elif (name == "copy_" and _on_device(args[0]) and not _on_device(args[1]) and args[1].dim() > 0
              and not (len(args) > 2 and args[2])):
            c.syncs.append(f"h2d {_where()}")
        if not (dev_in or to_dev):
            c.host_ops += 1
            return out
        if name == "_local_scalar_dense":
            c.syncs.append(f"read {_where()}")
        elif name in _DATA_DEPENDENT and not (name == "repeat_interleave" and len(args) > 1
                                                and not isinstance(args[1], torch.Tensor)):
            c.syncs.append(f"shape:{name} {_where()}")
        for x in tree_flatten(out)[0]:
            _tag(x)
        if func.is_view:
            c.views += 1
        else:
            c.kernels += 1
            c.by_op[name] += 1
        return out


def _target(args: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to`` / ``Tensor.cpu`` call copies to (None: same device)."""
    for a in [*args[1:], kwargs.get("device")]:
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return MARK if _on_device(a) else torch.device("cpu")
    return None


class OpCounter(TorchFunctionMode):
    """``with OpCounter(model) as oc: forward()``; then ``oc.counts``. Single-threaded."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        self.counts = Counts()
        self.fused_depth = 0
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                _tag(t)
        self._dispatch = _Dispatch(self.counts, self)

    @staticmethod
    def on_device(*tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as living on the device (e.g. inputs the caller already moved there)."""
        for t in tensors:
            _tag(t)

    def __enter__(self) -> OpCounter:
        super().__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.device and args and _on_device(args[0]):
            return MARK
        if name in _FUSED and not self.fused_depth:
            flat_in, _ = tree_flatten((args, kwargs))
            if any(_on_device(x) for x in flat_in):
                self.fused_depth += 1
                try:
                    out = func(*args, **kwargs)
                finally:
                    self.fused_depth -= 1
                for x in tree_flatten(out)[0]:
                    _tag(x)
                self.counts.kernels += 1
                self.counts.fused += 1
                self.counts.by_op[name] += 1
                return out
        if name in ("tensor", "as_tensor") and kwargs.get("device") == MARK:
            out = func(*args, **kwargs)  # a host tensor copied to the device (blocking)
            self.counts.syncs.append(f"h2d {_where()}")
            self.counts.kernels += 1
            self.counts.by_op["_to_copy"] += 1
            _tag(out)
            return out
        if name in ("cpu", "to") and args and _on_device(args[0]) and (
                name == "cpu" or _target(args, kwargs) == torch.device("cpu")):
            self.fused_depth += 1  # a no-op on a CPU: counted here, as the copy to the host it is
            try:
                out = func(*args, **kwargs)
                out = out.detach() if out is args[0] else out
            finally:
                self.fused_depth -= 1
            setattr(out, _TAG, False)
            self.counts.syncs.append(f"d2h {_where()}")
            self.counts.host_ops += 1
            return out
        if name in _READS and args and _on_device(args[0]) and name not in ("item", "__bool__", "__int__",
                                                                          "__float__", "__index__", "__complex__"):
            # .tolist() / .numpy() read the data without a dispatched op; the others reach
            # aten::_local_scalar_dense, counted at the dispatcher.
            self.counts.syncs.append(f"read {_where()}")
        return func(*args, **kwargs)

