"""The native node of an eager ``te.Linear`` call: :class:`NativeLinear`
(one configuration's plan, run from C++), the weight-cache modes, the
launches every plan shares (the bias gradient's), and the Python backward
a node falls back to for a gradient it does not take as it is.  The plans
for each recipe are made in ``linear/native.py`` and
``linear/native_delayed.py``."""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import grid_state, native
from ...kernels.triton_launch import int_key
from ...quantization.blockwise import Float8BlockwiseQTensorStorage
from ...quantization.float8 import Float8TensorStorage
from .args import LinearBwdArgs, LinearFwdArgs
from .compute import BACKWARD_UPDATES, linear_backward, linear_setup_context

_GEMM_OUT = (torch.bfloat16, torch.float16, torch.float32)


# native_linear.cpp's Cache: no weight cache, write it, read it
NO_CACHE, WRITE_CACHE, READ_CACHE = 0, 1, 2


_DTYPE_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
                torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class NativeLinear:
    """One configuration's plan: ``plan(layer, x, w, bias)`` is the layer's
    outputs (``{"out": y}``), or None where this call must take the Python
    path."""

    __slots__ = ("ext", "plan", "slot", "slot_keys", "state")

    def __init__(self, ext, plan, slot, state=()):
        self.ext, self.plan, self.slot = ext, plan, slot
        self.slot_keys = (int_key(slot[0]), int_key(slot[1]))
        # DelayedScaling: the layer's history and scale buffers (forward, then
        # backward); the FP8 weight cache's buffers (_cache_buffers).
        # The plan's memo entry serves only while they are the layer's
        self.state = list(state)

    def gemms(self):
        """``((state prefix, native linear call),)``: checkpointing's view
        (module/args_memo.py)."""
        return (("", self),)

    def slot_for(self, x):
        """The counter slot a native call on ``x`` uses, or None where the
        call must take the Python path: fast kernels off, a functorch
        transform or forward-mode AD active, a CUDA graph being captured, or
        counters elsewhere than the kernels were compiled for."""
        if (not kernels._fast_enabled or torch._C._are_functorch_transforms_active()
                or torch.autograd.forward_ad._current_level >= 0):
            return None
        slot = grid_state.slot(x.device)  # None while a CUDA graph is captured
        if slot is None or (slot != self.slot
                            and (int_key(slot[0]), int_key(slot[1])) != self.slot_keys):
            return None
        return slot

    def __call__(self, layer, x, w, bias, slot=None):
        """``slot``: :meth:`slot_for`'s, where the caller asked already."""
        slot = slot or self.slot_for(x)
        if slot is None:
            return None
        y = self.ext.linear(self.plan, x, w, bias, slot[0], slot[1], self.state)
        return None if y is None else {"out": y}

    def with_norm(self, norm, x, ln_w, ln_b, w, bias, slot):
        """A fused module's norm (``norm``: its FP8-writing plan) and this
        GEMM under DelayedScaling as one native call
        (layernorm/linear_native.py): ``{"out": y, "ln_out": ln_out}``, ln_out
        None where the norm does not write it; None where either plan
        declines the call (checked before either runs)."""
        res = self.ext.norm_linear(self.plan, norm, x, ln_w, ln_b, w, bias, slot[0], slot[1],
                                   self.state)
        return {"out": res[0], "ln_out": res[1]} if res else None


def _wgrad_dtype(args: LinearFwdArgs) -> torch.dtype:
    """The wgrad GEMM's output dtype: main_grad's with
    ``fuse_wgrad_accumulation``, else the weight's."""
    return (args.weight if args.main_grad is None else args.main_grad).dtype


def _cache_mode(args: LinearFwdArgs) -> int:
    """How this call uses the FP8 weight cache (``is_first_microbatch``)."""
    if args.weight_workspace is None:
        return NO_CACHE
    return WRITE_CACHE if args.cache_weight else READ_CACHE


def _cache_buffers(args: LinearFwdArgs):
    """The buffers of the call's FP8 weight cache in native_linear.cpp's
    order: per-tensor scaling's data, transpose and scale_inv; blockwise
    (128x128 blocks) the rowwise data and scales, the columnwise data and
    scales.  None where it is neither, or a buffer is not a plain tensor
    (what the native path takes)."""
    ws = args.weight_workspace
    if type(ws) is Float8TensorStorage:
        bufs = [ws._data, ws._transpose, ws._scale_inv]
    elif type(ws) is Float8BlockwiseQTensorStorage and ws._block_scaling_dim == 2:
        bufs = [ws._rowwise_data, ws._rowwise_scale_inv, ws._columnwise_data,
                ws._columnwise_scale_inv]
    else:
        return None
    if any(type(b) not in (torch.Tensor, torch.nn.Parameter) for b in bufs):
        return None
    return bufs


def _with_bias_grad(ext, plan, args: LinearFwdArgs, slot, state=()):
    """The :class:`NativeLinear` of ``plan`` (``state``: see there; the weight
    cache's buffers with one), with the
    bias gradient's launches where the bias needs one, and ``main_grad``
    last in its state with ``fuse_wgrad_accumulation``; None where the
    launches cannot be native."""
    if args.main_grad is not None:
        plan.set_main_grad()
        state = (*state, args.main_grad)
    if args.bias_requires_grad:
        x = args.inp
        launches = _bias_grad_launches(ext, x.numel() // x.shape[-1], args.weight.shape[0],
                                       x.dtype, x.device)
        if launches is None:
            return None
        plan.set_bias_grad(*launches)
    return NativeLinear(ext, plan, slot, state)


def _listed_launches(ext, device, launches, slots):
    """Native launches of ``launches`` (each launched once here, which
    compiles it) over the slot table ``slots``; None if one cannot be."""
    specs = []
    for launcher, grid, key, largs in launches:
        launcher(grid, key, *largs)
        specs.append(native.launch_spec(ext, launcher, device.index, grid, key, largs, slots))
    return None if None in specs else specs


def _bias_grad_launches(ext, m, n, dtype, device):
    """The native launches of the bias gradient (``column_sum`` of dy, two
    kernels) and its group count, or None."""
    from ...kernels import triton_bias  # Triton: imported on CUDA only
    with torch.no_grad():
        dy2d = torch.zeros((m, n), dtype=dtype, device=device)
        launches, parts, out = triton_bias.column_sum_calls(dy2d, dtype)
        specs = []
        for launcher, grid, key, largs in launches:
            launcher(grid, key, *largs)
            specs.append(native.launch_spec(ext, launcher, device.index, grid, key, largs,
                                            [dy2d, parts, out]))
    if None in specs:
        return None
    return specs[0], specs[1], parts.shape[0]


class _PythonBackward:
    """The Python path's backward for a native node, called (under the GIL)
    with a gradient the node does not take as it is: a tensor subclass (the
    quantized dy of a next layer's ``fp8_grad``, a DTensor) or another dtype.
    The saved copies become the storages the Python forward would have saved."""

    def __init__(self, args: LinearFwdArgs, q, wq, names, state_bwd=(None, None)):
        self.names = names  # the buffer names of a columnwise copy, its scales (and amax)
        self.state_bwd = state_bwd  # DelayedScaling: the backward history and scales
        self.values = linear_setup_context(args)
        self.main_grad = args.main_grad  # fuse_wgrad_accumulation: W's gradient added there
        self.x_shape, self.x_dtype = tuple(args.inp.shape), args.inp.dtype
        self.w_shape, self.w_dtype = tuple(args.weight.shape), args.weight.dtype
        self.xq, self.wq = q.usage_variant(False, True), wq.usage_variant(False, True)

    def __call__(self, dy, x_t, x_sinv, w_t, w_sinv, x_amax=None, w_amax=None):
        from ...dynamo.updates import apply_updates
        from ...kernels.tracing import eager_buffers_in_place
        x = w = None

        def buffers(*tensors):  # NVFP4's copies also have their amax
            return dict(zip(self.names, tensors))

        if x_t is not None:
            x = self.xq.from_buffers(self.x_shape, self.x_dtype, buffers(x_t, x_sinv, x_amax))
        if w_t is not None:
            w = self.wq.from_buffers(self.w_shape, self.w_dtype, buffers(w_t, w_sinv, w_amax))
        saved = {"inputmat": x, "weightmat": w, "main_grad": self.main_grad,
                 "amax_history_bwd": self.state_bwd[0], "scale_bwd": self.state_bwd[1]}
        bwd_args = LinearBwdArgs(**saved, **self.values, grad_output=dy)
        with torch.no_grad(), eager_buffers_in_place():
            grads = linear_backward(bwd_args)
            grads = apply_updates(BACKWARD_UPDATES, bwd_args, grads)
        return grads["inp"], grads.get("weight"), grads["bias"]
