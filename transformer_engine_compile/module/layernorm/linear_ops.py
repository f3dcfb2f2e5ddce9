"""``te.LayerNormLinear``'s two custom ops: ``y = norm(x) W^T + b``.

The argument dataclasses extend ``te.Linear``'s with the normalisation's
fields, and the impls wrap Linear's: the forward normalises ``x`` and runs
``linear_forward`` on the result (which quantizes it, gathers it under
sequence parallelism and saves what wgrad needs), the backward runs
``linear_backward`` and then the normalisation's backward on its dgrad.
So the GEMMs, TP/SP collectives, delayed-scaling state, weight caching and
``main_grad`` are Linear's, not a copy.  Op names:
``te_compile::layernorm_linear_fwd`` / ``layernorm_linear_bwd``.

Field meanings that differ from Linear's: ``inp`` is the module input
(before the norm); ``input_requires_grad`` means the normalised activation
needs a gradient (the input or a norm parameter requires grad), and
``norm_input_requires_grad`` that the module input itself does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...dynamo.arg_views import with_fields
from ...dynamo.custom_op import OpResult, register_custom_op
from ...kernels.reference import AmaxSlot
from ..norm import ops as N
from ...quantization.float8 import Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer
from ..linear.ops import LINEAR_OPS
from ..linear.args import (LinearBwdArgs, LinearFwdArgs, _input_quantizer,
                           _paired_weight_quantizer, _tp)
from ..linear.lowering import _lowers_backward, _lowers_forward
from ..delayed_step import zero_amaxes
from ..linear.compute import (linear_backward, linear_backward_fake, linear_forward,
                              linear_forward_fake, linear_setup_context)


@dataclasses.dataclass
class LayerNormLinearFwdArgs(LinearFwdArgs):
    ln_weight: Optional[torch.Tensor] = None   # gamma (in_features,)
    ln_bias: Optional[torch.Tensor] = None     # beta (LayerNorm only)
    eps: float = 1e-5
    normalization: str = "LayerNorm"           # or "RMSNorm"
    zero_centered_gamma: bool = False          # scale by 1 + gamma
    return_layernorm_output: bool = False      # also return norm(x)
    norm_input_requires_grad: bool = False
    ln_weight_requires_grad: bool = False
    ln_bias_requires_grad: bool = False


@dataclasses.dataclass
class LayerNormLinearBwdArgs(LinearBwdArgs):
    grad_ln_out: Optional[torch.Tensor] = None  # gradient of the returned norm(x)
    ln_inp: Optional[torch.Tensor] = None
    ln_mean: Optional[torch.Tensor] = None
    ln_rstd: Optional[torch.Tensor] = None
    ln_weight: Optional[torch.Tensor] = None
    normalization: str = "LayerNorm"
    zero_centered_gamma: bool = False
    norm_input_requires_grad: bool = False
    ln_weight_requires_grad: bool = False
    ln_bias_requires_grad: bool = False
    ln_bias_dtype: Optional[torch.dtype] = None


def _finish_forward(args, linear: OpResult, ln_out, mean, rstd) -> OpResult:
    outputs = {**linear.outputs,
               "ln_out": ln_out if args.return_layernorm_output else None}
    saved = {**linear.saved, **N.norm_saved(args.inp, mean, rstd, args.ln_weight,
                                            args.input_requires_grad)}
    return OpResult(outputs, saved)


def _ungathered_input_quantizer(args):
    """The input quantizer when the norm's output is the GEMM's input as it
    is: not column-parallel with sequence parallelism, where the gather
    quantizes the local shard (current scaling: with the amax reduced over
    the group first)."""
    mode, sp = _tp(args)
    return None if (mode == "column" and sp) else _input_quantizer(args)


def _amax_fused_quantizer(args):
    """The input quantizer when the norm's kernel can hand it the amax of
    its output: FP8 current scaling without a gather of the input."""
    q = _ungathered_input_quantizer(args)
    return q if isinstance(q, Float8CurrentScalingQuantizer) and args.scale_fwd is None else None


def _fp8_writing_quantizer(args):
    """The input quantizer when the norm's kernel can write its output in
    FP8 itself: delayed scaling (the scale is known before the norm runs),
    without a gather of the input and without saving the high-precision
    input."""
    q = _ungathered_input_quantizer(args)
    ok = (isinstance(q, Float8DelayedScalingQuantizer) and args.scale_fwd is not None
          and not args.save_original_input)
    return q if ok else None


def norm_linear_forward(args, linear_args) -> tuple:
    """``(linear OpResult, (ln_out, mean, rstd))``: the norm of ``args.inp``
    (``args`` has the norm's fields), then ``linear_forward`` of
    ``linear_args`` (``inp`` on the norm's device) on ``ln_out``.  Under FP8
    current scaling the norm's kernel also produces the amax of its output
    and, when this call quantizes the weight, the weight's; one cast launch
    then quantizes both (the same bytes as quantizing them separately).
    Under delayed scaling the norm's kernel writes ``ln_out``'s FP8 copy
    itself, and ``ln_out`` only when the module returns it (else None)."""
    dq = _fp8_writing_quantizer(linear_args)
    if dq is not None:
        amaxes = zero_amaxes(linear_args.amax_history_fwd)
        ln_out, mean, rstd, xq = N.norm_forward_fp8(
            args.inp, args.ln_weight, args.ln_bias, args.eps, args.normalization,
            args.zero_centered_gamma, dq, linear_args.scale_fwd[0], AmaxSlot(amaxes, 0),
            args.return_layernorm_output)
        linear = linear_forward(with_fields(linear_args, inp=ln_out), xq, amaxes=amaxes)
        return linear, (ln_out, mean, rstd)
    q = _amax_fused_quantizer(linear_args)
    wq = None if q is None else _paired_weight_quantizer(linear_args, q)
    norm = N.norm_forward(args.inp, args.ln_weight, args.ln_bias, args.eps, args.normalization,
                          args.zero_centered_gamma, q is not None,
                          None if wq is None else linear_args.weight)
    ln_out = norm[0]
    linear_args = with_fields(linear_args, inp=ln_out)
    if q is None:
        linear = linear_forward(linear_args)
    elif wq is None:  # the same bytes as q quantizing ln_out itself, without its amax pass
        linear = linear_forward(linear_args, q.quantize_with_amax(ln_out, norm[3], checked=False))
    else:
        linear = linear_forward(linear_args, *q.quantize_pair_with_amax(
            ln_out, wq, linear_args.weight, norm[3], norm[4]))
    return linear, norm[:3]


def layernorm_linear_forward(args: LayerNormLinearFwdArgs) -> OpResult:
    linear, (ln_out, mean, rstd) = norm_linear_forward(args, args)
    return _finish_forward(args, linear, ln_out, mean, rstd)


def layernorm_linear_forward_fake(args: LayerNormLinearFwdArgs) -> OpResult:
    ln_out, mean, rstd = N.norm_forward_fake(args.inp, args.normalization)
    linear = linear_forward_fake(with_fields(args, inp=ln_out))
    return _finish_forward(args, linear, ln_out, mean, rstd)


def layernorm_linear_setup_context(args: LayerNormLinearFwdArgs) -> dict:
    return {**linear_setup_context(args),
            "normalization": args.normalization,
            "zero_centered_gamma": args.zero_centered_gamma,
            "norm_input_requires_grad": args.norm_input_requires_grad,
            "ln_weight_requires_grad": args.ln_weight_requires_grad,
            "ln_bias_requires_grad": args.ln_bias_requires_grad,
            "ln_bias_dtype": None if args.ln_bias is None else args.ln_bias.dtype}


def _norm_grad_input(grads: dict, grad_ln_out):
    d_ln = grads.pop("inp")
    if d_ln is not None and grad_ln_out is not None:
        d_ln = d_ln + grad_ln_out
    return d_ln


def layernorm_linear_backward(args: LayerNormLinearBwdArgs) -> dict:
    grads = linear_backward(args)
    d_ln = _norm_grad_input(grads, args.grad_ln_out)
    return {**grads, **N.norm_backward(args, d_ln)}


def layernorm_linear_backward_fake(args: LayerNormLinearBwdArgs) -> dict:
    grads = linear_backward_fake(args)
    d_ln = _norm_grad_input(grads, None)
    return {**grads, **N.norm_backward_fake(args, d_ln)}


def _lowers_layernorm_linear_backward(args: LayerNormLinearBwdArgs) -> bool:
    """Linear's conditions (dynamo/lowering.py; the forward takes Linear's
    predicate as it is) and the norm's."""
    return _lowers_backward(args) and N.lowers_norm_backward(args)


LAYERNORM_LINEAR_OPS = register_custom_op(
    "layernorm_linear",
    fwd_args=LayerNormLinearFwdArgs, bwd_args=LayerNormLinearBwdArgs,
    forward=layernorm_linear_forward, forward_fake=layernorm_linear_forward_fake,
    backward=layernorm_linear_backward, backward_fake=layernorm_linear_backward_fake,
    setup_context=layernorm_linear_setup_context,
    grad_fields={"grad_output": "out", "grad_ln_out": "ln_out"},
    forward_updates=LINEAR_OPS.forward_updates, backward_updates=LINEAR_OPS.backward_updates,
    lower_forward=_lowers_forward, lower_backward=_lowers_layernorm_linear_backward,
)
