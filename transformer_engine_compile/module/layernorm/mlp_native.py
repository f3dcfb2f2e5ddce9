"""When and how an eager ``te.LayerNormMLP`` call runs natively (kernels/native.py).

The call becomes four native calls, each with its C++ autograd node: the
normalisation (``native_norm.cpp``, as te.LayerNormLinear's), fc1's native
linear call on its output (module/linear/native.py, the plan a
``te.Linear`` of fc1's configuration gets), the activation
(``native_act.cpp``: triton_act's launches, saving fc1's output as the op
saves it) and fc2's native linear call.  That is bit for bit the Python
path: its op runs the same norm kernel and quantizes the norm's output as
te.LayerNormLinear does, then the same activation kernel, then fc2 as a
``te.Linear``; its backward runs the same steps in reverse, and autograd
adds ``ln_out``'s gradient to fc1's dgrad as the op adds them
(``tests/gpu/test_gpu_native_fused.py`` compares every output and gradient).

Under DelayedScaling the norm and fc1 are one native call, as in
te.LayerNormLinear (module/layernorm/linear_native.py: the norm kernel
writes fc1's FP8 input itself, as the Python path's does).

Covered: what both the native linear path and te.LayerNormLinear's native
norm cover, every activation, and no recipe (bf16 / fp16: both GEMMs the
plain plan, as in te.LayerNormLinear).  Anything else keeps the Python path.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import native
from .linear_native import norm_eligible, norm_plan, norm_then_linear
from .mlp_ops import LayerNormMLPFwdArgs, activation_backward
from ..linear.native_node import _DTYPE_NAMES
from ..linear.native import plan_for


class NativeLayerNormMLP:
    """One configuration's plans: ``plan(layer, x, fc1_w, fc1_b, fc2_w,
    fc2_b)`` is the module's outputs (``fc2_b`` None where it is returned,
    not added), or None where this call must take the Python path."""

    __slots__ = ("ext", "norm", "fc1", "act", "fc2", "fp8_norm")

    def __init__(self, ext, norm, fc1, act, fc2, fp8_norm):
        self.ext, self.norm, self.fc1, self.act, self.fc2 = ext, norm, fc1, act, fc2
        self.fp8_norm = fp8_norm

    def gemms(self):
        return (("fc1_", self.fc1), ("fc2_", self.fc2))

    def __call__(self, layer, x, fc1_w, fc1_b, fc2_w, fc2_b):
        first = norm_then_linear(self.ext, self.norm, self.fc1, self.fp8_norm, layer, x, fc1_w,
                                 fc1_b)
        if first is None:
            return None
        h, slot = first
        # where a later step declines (a parameter moved, other gradients), the
        # Python path runs the whole module again; these outputs are dropped
        a = self.ext.act(self.act, h["out"])
        if a is None:
            return None
        out = self.fc2(layer, a, fc2_w, fc2_b, slot)
        if out is not None:
            out["ln_out"] = h["ln_out"]
        return out


def plan_for_layernorm_mlp(args: LayerNormMLPFwdArgs):
    """A :class:`NativeLayerNormMLP` for this call's configuration, None
    where it has none, ``...`` while the extension is being built."""
    if not (native.ENABLED and norm_eligible(args)
            and kernels.has_fast("activation_forward", "cuda")):
        return None
    x = args.inp  # stands for the norm's output: same shape, dtype, device
    fc1_args = args.gemm("fc1_", x)
    fp8_norm = fc1_args.amax_history_fwd is not None  # DelayedScaling: the norm writes FP8
    fc1 = plan_for(fc1_args, given_x=fp8_norm, plain=True)
    if fc1 is None or fc1 is ...:  # none, or the extension still building
        return fc1
    ext = fc1.ext
    act = _act_plan(ext, args)
    if act is None:
        return None
    act, a = act
    fc2 = plan_for(args.gemm("fc2_", a), plain=True)
    if fc2 is None or fc2 is ... or fc2.slot_keys != fc1.slot_keys:
        return None
    norm = norm_plan(ext, args, fc1_args if fp8_norm else None)
    return None if norm is None else NativeLayerNormMLP(ext, norm, fc1, act, fc2, fp8_norm)


def _act_plan(ext, args: LayerNormMLPFwdArgs):
    """The native activation plan (``native_act.cpp``) and a scratch tensor
    of the activation's output (what fc2's plan is made for), or None."""
    from ...kernels import triton_act as ta  # Triton: imported on CUDA only
    x, name = args.inp, args.activation
    n = args.fc1_weight.shape[0]
    in_shape = (*x.shape[:-1], n)
    dev = x.device
    with torch.no_grad():
        h = torch.zeros(in_shape, dtype=x.dtype, device=dev)
        grid, key, largs, a = ta.forward_call(h, name)
        ta._fwd_launch(grid, key, *largs)
        fwd = native.launch_spec(ext, ta._fwd_launch, dev.index, grid, key, largs, [h, a])
        dy = torch.zeros_like(a)
        grid, key, largs, dh = ta.backward_call(dy, h, name)
        ta._bwd_launch(grid, key, *largs)
        bwd = native.launch_spec(ext, ta._bwd_launch, dev.index, grid, key, largs, [dy, h, dh])
    if fwd is None or bwd is None:
        return None
    return ext.ActPlan(fwd, bwd, _ActPythonBackward(name), _DTYPE_NAMES[x.dtype], dev.index,
                       list(in_shape), list(a.shape)), a


class _ActPythonBackward:
    """The Python path's activation backward for a native node, called
    (under the GIL) with a gradient its launch does not take (a tensor
    subclass, another dtype or device, a strided one)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, dy, x):
        with torch.no_grad():
            return activation_backward(dy, x, self.name)
