"""When and how an eager ``te.LayerNormLinear`` call runs natively (kernels/native.py).

The call becomes two native calls: the normalisation (``native_norm.cpp``:
the Python path's norm kernels, a C++ autograd node saving x, mean, rstd
and gamma as its op does) and the layer's native linear call on its
output (module/linear/native.py, the same plan as a ``te.Linear``'s).  That
is bit for bit the Python path, whose fused op runs the same norm kernel
and then quantizes the norm's output exactly as ``te.Linear`` quantizes an
input (under current scaling the norm kernel hands the cast its amax, the
same bytes as the cast's own amax pass; ``tests/gpu/test_gpu_native_fused.py``
compares every output and gradient), and autograd adds ``ln_out``'s
gradient to the linear call's dgrad as the op adds them.

Under DelayedScaling the Python path's norm kernel writes the FP8 copy of
its output itself with the layer's scale (other bytes than casting the
rounded output), and the high-precision output only where the module
returns it.  Natively that is one call (``native_linear.cpp``'s
``norm_linear``): the same norm launch and the copy's transpose, then the
linear call's weight cast and step, reading x's copies from the norm; the
norm's node and the linear's are joined by the norm's output, which holds
no data where it is not returned.

Without a recipe (bf16 / fp16 training) the linear call is the plain plan
a te.Linear with a bias gets (``linear_native._plain_plan``: ``F.linear``'s
GEMMs from C++), with or without a bias; the Python path's op runs the same
GEMMs and the same bias-gradient kernel.

Covered: what the native linear path covers (module/linear/native.py);
LayerNorm or RMSNorm, zero-centred gamma, ``return_layernorm_output``;
norm parameters of one dtype, rows of at most ``triton_norm.MAX_K``.
Anything else keeps the Python path.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import native
from .linear_ops import LayerNormLinearFwdArgs
from ..linear.native_node import _DTYPE_NAMES
from ..linear.native import plan_for
from ..linear.args import _input_quantizer
from ..norm.ops import _gamma


class NativeLayerNormLinear:
    """One configuration's plans: ``plan(layer, x, w, bias)`` is the layer's
    outputs, or None where this call must take the Python path."""

    __slots__ = ("ext", "norm", "linear", "fp8_norm")

    def __init__(self, ext, norm, linear, fp8_norm):
        self.ext, self.norm, self.linear, self.fp8_norm = ext, norm, linear, fp8_norm

    def gemms(self):
        return (("", self.linear),)

    def __call__(self, layer, x, w, bias):
        first = norm_then_linear(self.ext, self.norm, self.linear, self.fp8_norm, layer, x, w,
                                 bias)
        return None if first is None else first[0]


def norm_then_linear(ext, norm, linear, fp8_norm, layer, x, w, bias):
    """``(outputs, slot)``: a fused module's norm and first linear call run
    natively (``outputs``: ``{"out": y, "ln_out": ln_out}``, ln_out None
    where an FP8-writing norm (``fp8_norm``) does not write it), once the
    linear call's conditions hold (``linear.slot_for``: checked before the
    norm runs); else None."""
    slot = linear.slot_for(x)
    if slot is None:
        return None
    ln_w, ln_b = layer.layer_norm_weight, layer.layer_norm_bias
    if fp8_norm:  # one call, which checks both plans before running either
        out = linear.with_norm(norm, x, ln_w, ln_b, w, bias, slot)
        return None if out is None else (out, slot)
    ln_out = ext.norm(norm, x, ln_w, ln_b)
    if ln_out is None:
        return None
    # where the linear call declines now (the weight or bias moved, other
    # gradients), the Python path runs the whole layer again; the norm's
    # output is dropped
    out = linear(layer, ln_out, w, bias, slot)
    if out is None:
        return None
    out["ln_out"] = ln_out
    return out, slot


def plan_for_layernorm_linear(args: LayerNormLinearFwdArgs):
    """A :class:`NativeLayerNormLinear` for this call's configuration, None
    where it has none, ``...`` while the extension is being built."""
    if not (native.ENABLED and norm_eligible(args)):
        return None
    fp8_norm = args.amax_history_fwd is not None  # DelayedScaling: see the module's docstring
    # args.inp stands for the norm's output: same shape, dtype, device
    linear = plan_for(args, given_x=fp8_norm, plain=True)
    if linear is None or linear is ...:  # none, or the extension still building
        return linear
    ext = linear.ext
    norm = norm_plan(ext, args, args if fp8_norm else None)
    return None if norm is None else NativeLayerNormLinear(ext, norm, linear, fp8_norm)


def norm_eligible(args) -> bool:
    """Whether the norm of a fused module's call (its ``inp``, ``ln_weight``,
    ``ln_bias``, ``normalization``) can run natively."""
    x, w, b = args.inp, args.ln_weight, args.ln_bias
    rms = args.normalization == "RMSNorm"
    if type(x) is not torch.Tensor or not x.is_cuda or (b is not None) == rms:
        return False
    from ...kernels import triton_norm  # Triton: imported on CUDA only
    params = (w,) if rms else (w, b)
    return (all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device == x.device
                and p.dtype == w.dtype and p.dim() == 1 and p.is_contiguous()
                and p.data_ptr() % 16 == 0 for p in params)
            and x.dim() >= 2 and 0 < x.shape[-1] <= triton_norm.MAX_K
            and w.dtype in _DTYPE_NAMES and kernels.has_fast("norm_forward", "cuda"))


def norm_plan(ext, args, fp8_args=None):
    """The native norm plan (``native_norm.cpp``'s slot tables) of a fused
    module's call, compiled on zeroed scratch tensors of the call's shapes;
    None where a launch cannot be native.  ``fp8_args``: the first GEMM's
    arguments under DelayedScaling, whose input quantizer the norm kernel
    writes the FP8 copy for (``triton_norm.norm_forward_fp8``)."""
    from ...kernels import triton_norm as tn  # Triton: imported on CUDA only
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
        if fp8_args is None:
            launcher, grid, key, largs, (y, mean, rstd, _, _) = tn.forward_call(
                x2d, gamma, beta, args.eps, rms)
            launcher(grid, key, *largs)
            fwd = native.launch_spec(ext, launcher, dev.index, grid, key, largs,
                                     [x2d, gamma, gamma if rms else beta, y,
                                      x2d if rms else mean, rstd])
            fp8 = None
        else:
            fwd, fp8, mean, rstd = _fp8_launches(ext, fp8_args, x2d, gamma, beta, args.eps, rms,
                                                 args.return_layernorm_output)
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
    if fwd is None or (fp8_args is not None and fp8 is None):
        return None
    plan = ext.NormPlan(fwd, bwd if bwd is not None else fwd, sums, _NormPythonBackward(args),
                        rms, args.zero_centered_gamma, need_dx, need_dw, need_db,
                        _DTYPE_NAMES[x.dtype], _DTYPE_NAMES[w.dtype], dev.index, parts_rows,
                        n_sums, list(x.shape))
    if fp8 is not None:
        plan.set_fp8(*fp8, args.return_layernorm_output)
    return plan


def _fp8_launches(ext, args, x2d, gamma, beta, eps, rms, with_y):
    """``(forward, (transpose or None, FP8 dtype name), mean, rstd)``: the
    native launch of ``triton_norm.norm_forward_fp8`` for the GEMM ``args``
    (its input quantizer and forward scale) on the scratch ``x2d``,
    ``gamma``, ``beta`` (and its mean and rstd scratch, which the backward
    launches are compiled on), then the transpose of the copy where the GEMM
    keeps x's columnwise copy; the first two None where a launch cannot be
    native."""
    from ...kernels import reference as ref
    from ...kernels import triton_norm as tn
    from ...kernels import triton_quant as tq
    q = _input_quantizer(args)
    m, k, dev = x2d.shape[0], x2d.shape[1], x2d.device
    dtype = ref.FP8_DTYPE[q.fp8_format]
    amaxes = torch.zeros(ref.STEP_COUNTER + 1, dtype=torch.float32, device=dev)
    s0 = torch.zeros_like(args.scale_fwd)[0]
    data = torch.empty((m, k), dtype=dtype, device=dev)
    sinv = torch.empty(1, dtype=torch.float32, device=dev)
    t = torch.empty((k, m), dtype=dtype, device=dev) if q.columnwise_usage else x2d
    launcher, grid, key, largs, (y, mean, rstd, _, _) = tn.forward_call(
        x2d, gamma, beta, eps, rms, True, None,
        (s0, q.fp8_format, ref.AmaxSlot(amaxes, 0), with_y,
         {"data": data, "scale_inv": sinv}))
    launcher(grid, key, *largs)
    # native_norm.cpp's forward slot table under delayed scaling
    slots = [x2d, gamma, gamma if rms else beta, x2d if y is None else y,
             x2d if rms else mean, rstd, amaxes, s0, data, sinv, t]
    fwd = native.launch_spec(ext, launcher, dev.index, grid, key, largs, slots)
    tr = None
    if q.columnwise_usage:
        launcher, grid, key, largs = tq.transpose_call(data, t)
        launcher(grid, key, *largs)
        by_bytes = list(slots)
        by_bytes[8], by_bytes[10] = largs[0], largs[1]  # the launch takes byte views
        tr = native.launch_spec(ext, launcher, dev.index, grid, key, largs, by_bytes)
        if tr is None:
            return None, None, mean, rstd
    return fwd, (tr, _DTYPE_NAMES[dtype]), mean, rstd


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
