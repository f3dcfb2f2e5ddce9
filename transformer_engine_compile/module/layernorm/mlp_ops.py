"""``te.LayerNormMLP``'s two custom ops: ``fc2(act(fc1(norm(x))))``.

One op pair (``te_compile::layernorm_mlp_fwd`` / ``layernorm_mlp_bwd``) runs
the whole block.  The argument dataclasses are generated: the norm's and
the activation's fields, then every field of ``te.Linear``'s
:class:`LinearFwdArgs` / :class:`LinearBwdArgs` twice, as ``fc1_...`` and
``fc2_...`` (``custom_op.prefixed_fields``).  The impls wrap Linear's: each
GEMM runs ``linear_forward`` / ``linear_backward`` on a ``LinearFwdArgs`` /
``LinearBwdArgs`` view of its fields (``custom_op.field_view``), so the
GEMMs, quantization, TP/SP collectives, delayed-scaling state, weight
caching and ``main_grad`` are Linear's, not a copy.

Forward: norm (fp32, rounded once) -> fc1 ``linear_forward`` (quantizes the
normalised input; column-parallel, all-gathering it under SP) -> activation
(fp32, rounded once to the activation dtype) -> fc2 ``linear_forward``
(quantizes the activation with fc2's input quantizer; row-parallel,
reduce-scattering the output under SP).  Backward: fc2 ``linear_backward``
-> activation backward (fp32) -> fc1 ``linear_backward`` -> norm backward.

Field meanings: ``inp`` is the module input; ``fc1_input_requires_grad``:
the normalised activation needs a gradient (the input or a norm parameter
requires grad); ``fc2_input_requires_grad``: the activation needs one (fc1
needs any gradient).  Each GEMM's outputs and saved values keep Linear's
names under its prefix; ``act_inp`` is fc1's output (the activation's
input), saved for the activation's backward.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional

import torch

from ... import kernels
from ...dynamo.arg_views import field_view, prefixed_fields
from ...dynamo.custom_op import OpResult, register_custom_op
from ...dynamo.arg_views import prefixed
from ...dynamo.tensor_proto import TensorProto
from ...kernels.reference import ACTIVATIONS
from ..norm import ops as N
from .linear_ops import norm_linear_forward
from ..linear.ops import LINEAR_OPS
from ..linear.args import LinearBwdArgs, LinearFwdArgs
from ..linear.lowering import _lowers_backward, _lowers_forward
from ..linear.compute import (linear_backward, linear_backward_fake, linear_forward,
                              linear_forward_fake, linear_setup_context)

GEMMS = ("fc1_", "fc2_")  # field prefixes of the two GEMMs
GATED = tuple(name for name, (_, gated) in ACTIVATIONS.items() if gated)


class _FwdMethods:
    def gemm(self, prefix: str, inp) -> LinearFwdArgs:
        """The ``LinearFwdArgs`` of GEMM ``prefix`` (``"fc1_"`` / ``"fc2_"``)."""
        return field_view(self, LinearFwdArgs, prefix, inp=inp)

    def compile_unsupported_reason(self) -> Optional[str]:
        for prefix in GEMMS:
            reason = self.gemm(prefix, None).compile_unsupported_reason()
            if reason is not None:
                return reason
        return None


_NORM_FWD = [
    ("ln_weight", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("ln_bias", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("eps", float, dataclasses.field(default=1e-5)),
    ("normalization", str, dataclasses.field(default="LayerNorm")),
    ("zero_centered_gamma", bool, dataclasses.field(default=False)),
    ("return_layernorm_output", bool, dataclasses.field(default=False)),
    ("norm_input_requires_grad", bool, dataclasses.field(default=False)),
    ("ln_weight_requires_grad", bool, dataclasses.field(default=False)),
    ("ln_bias_requires_grad", bool, dataclasses.field(default=False)),
    ("activation", str, dataclasses.field(default="gelu")),
]
_NORM_BWD = [
    ("grad_ln_out", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("act_inp", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("activation", str, dataclasses.field(default="gelu")),
    ("ln_inp", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("ln_mean", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("ln_rstd", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("ln_weight", Optional[torch.Tensor], dataclasses.field(default=None)),
    ("normalization", str, dataclasses.field(default="LayerNorm")),
    ("zero_centered_gamma", bool, dataclasses.field(default=False)),
    ("norm_input_requires_grad", bool, dataclasses.field(default=False)),
    ("ln_weight_requires_grad", bool, dataclasses.field(default=False)),
    ("ln_bias_requires_grad", bool, dataclasses.field(default=False)),
    ("ln_bias_dtype", Optional[torch.dtype], dataclasses.field(default=None)),
]

LayerNormMLPFwdArgs = dataclasses.make_dataclass(
    "LayerNormMLPFwdArgs",
    [("inp", torch.Tensor)] + _NORM_FWD
    + [f for p in GEMMS for f in prefixed_fields(LinearFwdArgs, p, exclude=("inp",))],
    bases=(_FwdMethods,), namespace={"__module__": __name__})
LayerNormMLPFwdArgs.__doc__ = "The forward op's arguments: norm, activation, fc1_*, fc2_*."

# fc2's grad_output is the gradient of the module output; fc1's is computed
LayerNormMLPBwdArgs = dataclasses.make_dataclass(
    "LayerNormMLPBwdArgs",
    prefixed_fields(LinearBwdArgs, "fc2_")
    + prefixed_fields(LinearBwdArgs, "fc1_", exclude=("grad_output",)) + _NORM_BWD,
    namespace={"__module__": __name__})
LayerNormMLPBwdArgs.__doc__ = "The backward op's arguments: fc2_*, fc1_*, activation, norm."


# -- activation ------------------------------------------------------------------------
def activation_forward(x, name: str):
    return kernels.get("activation_forward", x)(x, name)


def activation_forward_fake(x, name: str) -> TensorProto:
    shape = (*x.shape[:-1], x.shape[-1] // 2) if name in GATED else x.shape
    return TensorProto(shape, x.dtype, device=x.device)


def activation_backward(dy, x, name: str):
    return kernels.get("activation_backward", x)(dy, x, name)


def activation_backward_fake(dy, x, name: str) -> TensorProto:
    return TensorProto(x.shape, x.dtype, device=x.device)


# -- forward -------------------------------------------------------------------------
def _finish_forward(args, ln_out, mean, rstd, fc1: OpResult, fc2: OpResult) -> OpResult:
    h = fc1.outputs["out"]
    outputs = {"out": fc2.outputs["out"],
               "ln_out": ln_out if args.return_layernorm_output else None,
               **prefixed(fc1.outputs, "fc1_", exclude=("out",)),
               **prefixed(fc2.outputs, "fc2_", exclude=("out",))}
    saved = {**prefixed(fc1.saved, "fc1_"), **prefixed(fc2.saved, "fc2_"),
             "act_inp": h if args.fc2_input_requires_grad else None,
             **N.norm_saved(args.inp, mean, rstd, args.ln_weight, args.fc1_input_requires_grad)}
    return OpResult(outputs, saved)


def layernorm_mlp_forward(args) -> OpResult:
    # as LayerNormLinear: the norm kernel's amaxes for fc1's input and weight
    fc1, (ln_out, mean, rstd) = norm_linear_forward(args, args.gemm("fc1_", args.inp))
    act = activation_forward(fc1.outputs["out"], args.activation)
    fc2 = linear_forward(args.gemm("fc2_", act))
    return _finish_forward(args, ln_out, mean, rstd, fc1, fc2)


def layernorm_mlp_forward_fake(args) -> OpResult:
    ln_out, mean, rstd = N.norm_forward_fake(args.inp, args.normalization)
    fc1 = linear_forward_fake(args.gemm("fc1_", ln_out))
    act = activation_forward_fake(fc1.outputs["out"], args.activation)
    fc2 = linear_forward_fake(args.gemm("fc2_", act))
    return _finish_forward(args, ln_out, mean, rstd, fc1, fc2)


def layernorm_mlp_setup_context(args) -> dict:
    values = {}
    for prefix in GEMMS:
        values.update(prefixed(linear_setup_context(args.gemm(prefix, None)), prefix))
    return {**values,
            "activation": args.activation,
            "normalization": args.normalization,
            "zero_centered_gamma": args.zero_centered_gamma,
            "norm_input_requires_grad": args.norm_input_requires_grad,
            "ln_weight_requires_grad": args.ln_weight_requires_grad,
            "ln_bias_requires_grad": args.ln_bias_requires_grad,
            "ln_bias_dtype": None if args.ln_bias is None else args.ln_bias.dtype}


# -- backward ------------------------------------------------------------------------
_NO_GRADS = {"inp": None, "weight": None, "bias": None}


def _norm_args(args):
    """What ``norm_ops.norm_backward`` reads: the norm's fields and fc1's
    parallel configuration (SP: the norm parameter gradients are summed)."""
    return types.SimpleNamespace(
        ln_inp=args.ln_inp, ln_mean=args.ln_mean, ln_rstd=args.ln_rstd,
        ln_weight=args.ln_weight, normalization=args.normalization,
        zero_centered_gamma=args.zero_centered_gamma,
        norm_input_requires_grad=args.norm_input_requires_grad,
        ln_weight_requires_grad=args.ln_weight_requires_grad,
        ln_bias_requires_grad=args.ln_bias_requires_grad, ln_bias_dtype=args.ln_bias_dtype,
        parallel_mode=args.fc1_parallel_mode, sequence_parallel=args.fc1_sequence_parallel,
        tp_size=args.fc1_tp_size, tp_group=args.fc1_tp_group)


def _norm_grad_input(fc1: dict, grad_ln_out):
    d_ln = fc1["inp"]  # a proto (fake) stays as it is: the sum has its layout
    if d_ln is not None and grad_ln_out is not None and not isinstance(d_ln, TensorProto):
        d_ln = d_ln + grad_ln_out
    return d_ln


def _backward(args, linear_bwd, act_bwd, norm_bwd) -> dict:
    fc2 = linear_bwd(field_view(args, LinearBwdArgs, "fc2_"))
    d_act = fc2["inp"]
    fc1 = _NO_GRADS
    if d_act is not None:  # fc1 needs some gradient
        d_h = act_bwd(d_act, args.act_inp, args.activation)
        fc1 = linear_bwd(field_view(args, LinearBwdArgs, "fc1_", grad_output=d_h))
    return {**prefixed(fc2, "fc2_", exclude=("inp",)), **prefixed(fc1, "fc1_", exclude=("inp",)),
            **norm_bwd(_norm_args(args), _norm_grad_input(fc1, args.grad_ln_out))}


def layernorm_mlp_backward(args) -> dict:
    return _backward(args, linear_backward, activation_backward, N.norm_backward)


def layernorm_mlp_backward_fake(args) -> dict:
    return _backward(args, linear_backward_fake, activation_backward_fake, N.norm_backward_fake)


# -- lowering into inductor (dynamo/lowering.py) ------------------------------------
def _lowers_mlp_forward(args) -> bool:
    """Each GEMM on Linear's conditions, seen with the module input (whose
    dtype each GEMM's input and output have: the norm and activation
    kernels produce their outputs in it)."""
    return all(_lowers_forward(args.gemm(prefix, args.inp)) for prefix in GEMMS)


def _lowers_mlp_backward(args) -> bool:
    """Each GEMM with fc2's output gradient standing for its own (same dtype)."""
    return (all(_lowers_backward(field_view(args, LinearBwdArgs, prefix,
                                            grad_output=args.fc2_grad_output))
                for prefix in GEMMS) and N.lowers_norm_backward(_norm_args(args)))


LAYERNORM_MLP_OPS = register_custom_op(
    "layernorm_mlp",
    fwd_args=LayerNormMLPFwdArgs, bwd_args=LayerNormMLPBwdArgs,
    forward=layernorm_mlp_forward, forward_fake=layernorm_mlp_forward_fake,
    backward=layernorm_mlp_backward, backward_fake=layernorm_mlp_backward_fake,
    setup_context=layernorm_mlp_setup_context,
    grad_fields={"fc2_grad_output": "out", "grad_ln_out": "ln_out"},
    # each GEMM's state, written right after the ops (see custom_op.py)
    forward_updates={k: v for p in GEMMS for k, v in prefixed(LINEAR_OPS.forward_updates,
                                                              p).items()},
    backward_updates={k: v for p in GEMMS for k, v in prefixed(LINEAR_OPS.backward_updates,
                                                               p).items()},
    lower_forward=_lowers_mlp_forward, lower_backward=_lowers_mlp_backward,
)
