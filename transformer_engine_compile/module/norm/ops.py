"""The normalisation inside ``LayerNormLinear`` / ``LayerNormMLP``'s ops.

Numerics (``kernels.reference.norm_forward``): LayerNorm or RMSNorm over the
last dim, computed in fp32 and rounded once to the input's dtype; with
``zero_centered_gamma`` the scale is ``1 + gamma`` (added in fp32).  The
forward saves the input, the fp32 ``mean`` (LayerNorm) and ``rstd`` per
row; the backward returns gradients in the parameters' and input's dtypes.
Real and fake helpers sit side by side; callers pass their args' fields.
"""

from __future__ import annotations

import functools
import operator

import torch

from ... import distributed as D
from ... import kernels
from ...dynamo.tensor_proto import TensorProto

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _rows(shape) -> int:
    return functools.reduce(operator.mul, shape[:-1], 1)


def _gamma(weight, zero_centered_gamma: bool):
    return weight.float() + 1 if zero_centered_gamma else weight


def norm_forward(x, weight, bias, eps: float, normalization: str,
                 zero_centered_gamma: bool, with_amax: bool = False, side=None) -> tuple:
    """``(y, mean, rstd)``: y shaped like x; mean (None for RMSNorm) and rstd (rows,) fp32.
    ``with_amax``: also the partial maxima of ``|y|`` (1-D fp32; their max is
    amax(y)), which FP8 current scaling quantizes y with
    (``Float8CurrentScalingQuantizer.quantize_with_amax``): on CUDA the
    norm kernel produces them, so quantizing y skips its amax pass.
    ``side``: the weight quantized with y; its partial maxima follow y's in
    the same tensor and a fifth element counts y's
    (``Float8CurrentScalingQuantizer.quantize_pair_with_amax``)."""
    x2d = x.reshape(-1, x.shape[-1])
    out = kernels.get("norm_forward", x2d)(
        x2d, _gamma(weight, zero_centered_gamma), bias, eps, normalization == "RMSNorm",
        with_amax, side)
    return (out[0].view(x.shape), *out[1:])


def norm_forward_fp8(x, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool,
                     quantizer, scale, amax_out, with_y: bool) -> tuple:
    """``(y or None, mean, rstd, y quantized)`` under delayed scaling: y as
    :func:`norm_forward` gives it, quantized by the FP8 ``quantizer`` with the
    layer's ``scale``, its amax raised into ``amax_out``, exactly as
    ``quantizer.quantize_with_scale(y, scale, amax_out=amax_out)`` would.  On
    CUDA the norm's kernel writes the FP8 bytes as it normalises and y
    only ``with_y``, so y is not read back (3 of 8 bytes per element moved)."""
    x2d = x.reshape(-1, x.shape[-1])
    y, mean, rstd, buffers = kernels.get("norm_forward_fp8", x2d)(
        x2d, _gamma(weight, zero_centered_gamma), bias, eps, normalization == "RMSNorm", scale,
        quantizer.fp8_format, quantizer.columnwise_usage, amax_out, with_y)
    return ((None if y is None else y.view(x.shape)), mean, rstd,
            quantizer.from_buffers(x.shape, x.dtype, buffers))


def norm_forward_fake(x, normalization: str) -> tuple:
    rows = (_rows(x.shape),)
    stat = lambda: TensorProto(rows, torch.float32, device=x.device)  # noqa: E731
    return (TensorProto(x.shape, x.dtype, device=x.device),
            None if normalization == "RMSNorm" else stat(), stat())


def norm_saved(x, mean, rstd, weight, needed: bool) -> dict:
    """What the backward needs (aliases of the arguments x and weight)."""
    if not needed:
        return {"ln_inp": None, "ln_mean": None, "ln_rstd": None, "ln_weight": None}
    return {"ln_inp": x, "ln_mean": mean, "ln_rstd": rstd, "ln_weight": weight}


def norm_backward(args, d_ln) -> dict:
    """``{"inp", "ln_weight", "ln_bias"}`` gradients from the gradient of the
    normalised activation ``d_ln`` (None when nothing before the norm needs
    one).  Under sequence parallelism each rank saw its own tokens: the
    parameter gradients are summed over the group here."""
    if d_ln is None:
        return {"inp": None, "ln_weight": None, "ln_bias": None}
    x = args.ln_inp
    x2d, dy2d = x.reshape(-1, x.shape[-1]), d_ln.reshape(-1, x.shape[-1])
    rms = args.normalization == "RMSNorm"
    sp_sum = args.sequence_parallel and args.tp_size > 1 and args.parallel_mode is not None
    dx, dw, db = kernels.get("norm_backward", x2d)(  # dgamma in the param dtype unless summed
        dy2d, x2d, args.ln_mean, args.ln_rstd, _gamma(args.ln_weight, args.zero_centered_gamma),
        rms, args.norm_input_requires_grad, args.ln_weight_requires_grad,
        args.ln_bias_requires_grad, None if sp_sum else args.ln_weight.dtype)
    if sp_sum:
        dw = None if dw is None else D.all_reduce_sum(dw, args.tp_group)
        db = None if db is None else D.all_reduce_sum(db, args.tp_group)
    return {"inp": None if dx is None else dx.to(x.dtype).view(x.shape),
            "ln_weight": None if dw is None else dw.to(args.ln_weight.dtype),
            "ln_bias": None if db is None else db.to(args.ln_bias_dtype)}


def lowers_norm_backward(args) -> bool:
    """Whether inductor may lower the norm's part of a backward call
    (dynamo/lowering.py): every gradient must leave the kernels in its
    final dtype.  A dbeta in another dtype than gamma's would be cast by
    a torch op, which inductor fuses into the cast's consumers without
    rounding to the narrower dtype, unlike eager."""
    return not args.ln_bias_requires_grad or args.ln_bias_dtype == args.ln_weight.dtype


def norm_backward_fake(args, d_ln) -> dict:
    if d_ln is None:
        return {"inp": None, "ln_weight": None, "ln_bias": None}
    x, w = args.ln_inp, args.ln_weight
    return {"inp": TensorProto(x.shape, x.dtype, device=x.device)
            if args.norm_input_requires_grad else None,
            "ln_weight": TensorProto(w.shape, w.dtype, device=w.device)
            if args.ln_weight_requires_grad else None,
            "ln_bias": TensorProto(w.shape, args.ln_bias_dtype, device=w.device)
            if args.ln_bias_requires_grad else None}
