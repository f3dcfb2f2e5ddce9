"""When and how an eager ``te.LayerNormLinear`` call runs natively (kernels/native.py).

The call becomes two native calls: the normalisation (``native_norm.cpp``:
the Python path's norm kernels, a C++ autograd node saving x, mean, rstd
and gamma as its op does) and the layer's native linear call on its
output (module/linear_native.py, the same plan as a ``te.Linear``'s).  That
is bit for bit the Python path, whose fused op runs the same norm kernel
and then quantizes the norm's output exactly as ``te.Linear`` quantizes an
input (under current scaling the norm kernel hands the cast its amax, the
same bytes as the cast's own amax pass; ``tests/gpu/test_gpu_native_fused.py``
compares every output and gradient), and autograd adds ``ln_out``'s
gradient to the linear call's dgrad as the op adds them.

Covered: what the native linear path covers (module/linear_native.py),
except DelayedScaling, whose norm kernel writes the FP8 copy itself (other
bytes than casting the rounded output); LayerNorm or RMSNorm, zero-centred
gamma, ``return_layernorm_output``; norm parameters of one dtype, rows of
at most ``triton_norm.MAX_K``.  Anything else keeps the Python path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import native
from .layernorm_linear_ops import LayerNormLinearFwdArgs
from .linear_native import _DTYPE_NAMES, plan_for
from .norm_ops import _gamma


class NativeLayerNormLinear:
    """One configuration's plans: ``plan(layer, x, w, bias)`` is the layer's
    outputs, or None where this call must take the Python path."""

    __slots__ = ("ext", "norm", "linear")

    def __init__(self, ext, norm, linear):
        self.ext, self.norm, self.linear = ext, norm, linear

    def __call__(self, layer, x, w, bias):
        first = native_norm(self.ext, self.norm, self.linear, layer, x)
        if first is None:
            return None
        slot, ln_out = first
        # where the linear call declines now (the weight or bias moved, other
        # gradients), the Python path runs the whole layer again; the norm's
        # output is dropped
        out = self.linear(layer, ln_out, w, bias, slot)
        if out is not None:
            out["ln_out"] = ln_out
        return out


def native_norm(ext, norm, linear, layer, x):
    """``(slot, ln_out)``: a fused module's norm run natively, once its first
    native linear call's conditions hold (``linear.slot_for``: checked
    before the norm runs), else None."""
    slot = linear.slot_for(x)
    if slot is None:
        return None
    ln_out = ext.norm(norm, x, layer.layer_norm_weight, layer.layer_norm_bias)
    return None if ln_out is None else (slot, ln_out)


def plan_for_layernorm_linear(args: LayerNormLinearFwdArgs):
    """A :class:`NativeLayerNormLinear` for this call's configuration, None
    where it has none, ``...`` while the extension is being built."""
    if not (native.ENABLED and args.amax_history_fwd is None and norm_eligible(args)):
        return None  # DelayedScaling: its norm kernel writes the FP8 copy itself
    linear = plan_for(args)  # args.inp stands for the norm's output: same shape, dtype, device
    if not linear:
        return linear
    ext = linear.ext
    norm = norm_plan(ext, args)
    return None if norm is None else NativeLayerNormLinear(ext, norm, linear)


def norm_eligible(args) -> bool:
    """Whether the norm of a fused module's call (its ``inp``, ``ln_weight``,
    ``ln_bias``, ``normalization``) can run natively."""
    x, w, b = args.inp, args.ln_weight, args.ln_bias
    rms = args.normalization == "RMSNorm"
    if type(x) is not torch.Tensor or not x.is_cuda or (b is not None) == rms:
        return False
    from ..kernels import triton_norm  # Triton: imported on CUDA only
    params = (w,) if rms else (w, b)
    return (all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device == x.device
                and p.dtype == w.dtype and p.dim() == 1 and p.is_contiguous()
                and p.data_ptr() % 16 == 0 for p in params)
            and x.dim() >= 2 and 0 < x.shape[-1] <= triton_norm.MAX_K
            and w.dtype in _DTYPE_NAMES and kernels.has_fast("norm_forward", "cuda"))


def norm_plan(ext, args):
    """The native norm plan (``native_norm.cpp``'s slot tables) of a fused
    module's call, compiled on zeroed scratch tensors of the call's shapes;
    None where a launch cannot be native."""
    from ..kernels import triton_norm as tn  # Triton: imported on CUDA only
    x, w = args.inp, args.ln_weight
    rms = args.normalization == "RMSNorm"
    m, k, dev = x.numel() // x.shape[-1], x.shape[-1], x.device
    need_dx = args.norm_input_requires_grad
    need_dw = args.ln_weight_requires_grad
    need_db = args.ln_bias_requires_grad and not rms
    with torch.no_grad():
        x2d = torch.zeros((m, k), dtype=x.dtype, device=dev)
        gamma = _gamma(torch.zeros(k, dtype=w.dtype, device=dev), args.zero_centered_gamma)
        beta = None if rms else torch.zeros(k, dtype=w.dtype, device=dev)
        launcher, grid, key, largs, (y, mean, rstd, _, _) = tn.forward_call(
            x2d, gamma, beta, args.eps, rms)
        launcher(grid, key, *largs)
        fwd = native.launch_spec(ext, launcher, dev.index, grid, key, largs,
                                 [x2d, gamma, gamma if rms else beta, y,
                                  x2d if rms else mean, rstd])
        bwd = sums = None
        parts_rows, n_sums = 1, 0
        if need_dx or need_dw or need_db:
            dy2d = torch.zeros((m, k), dtype=x.dtype, device=dev)
            launches, (dx, out) = tn.backward_calls(dy2d, x2d, mean, rstd, gamma, rms, need_dx,
                                                    need_dw, need_db, w.dtype)
            parts = launches[0][3][6]
            parts_rows, n_sums = parts.shape[0], 0 if out is None else out.shape[0]
            slots = [dy2d, x2d, gamma, rstd if rms else mean, rstd,
                     x2d if dx is None else dx, parts, parts if out is None else out]
            specs = []
            for l, g, kk, a in launches:
                l(g, kk, *a)
                specs.append(native.launch_spec(ext, l, dev.index, g, kk, a, slots))
            if None in specs:
                return None
            bwd, sums = specs[0], (specs[1] if n_sums else None)
    if fwd is None:
        return None
    return ext.NormPlan(fwd, bwd if bwd is not None else fwd, sums, _NormPythonBackward(args),
                        rms, args.zero_centered_gamma, need_dx, need_dw, need_db,
                        _DTYPE_NAMES[x.dtype], _DTYPE_NAMES[w.dtype], dev.index, parts_rows,
                        n_sums, list(x.shape))


class _NormPythonBackward:
    """The Python path's norm backward for a native norm node, called (under
    the GIL) with a gradient its launches do not take (a tensor subclass,
    another dtype or device): ``(dx, dgamma, dbeta)`` from the saved x, mean,
    rstd and gamma, as ``norm_ops.norm_backward`` makes them."""

    def __init__(self, args):
        self.rms = args.normalization == "RMSNorm"
        self.shape = tuple(args.inp.shape)
        self.needs = (args.norm_input_requires_grad, args.ln_weight_requires_grad,
                      args.ln_bias_requires_grad and not self.rms)
        self.w_dtype = args.ln_weight.dtype

    def __call__(self, dy, x2d, mean, rstd, gamma):
        with torch.no_grad():
            dx, dw, db = kernels.get("norm_backward", x2d)(
                dy.reshape(-1, x2d.shape[1]), x2d, mean, rstd, gamma, self.rms, *self.needs,
                self.w_dtype)
        return (None if dx is None else dx.to(x2d.dtype).view(self.shape),
                None if dw is None else dw.to(self.w_dtype),
                None if db is None else db.to(self.w_dtype))
