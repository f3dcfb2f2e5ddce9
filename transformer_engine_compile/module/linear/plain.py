"""The linear ops' calls without a recipe, in a short path.

A ``te_compile::linear_fwd`` / ``linear_bwd`` call without a recipe (bf16
training) stays an op call where inductor does not lower it (the forward
of a layer with a bias, ``_lowers_forward``; ``backend="aot_eager"``) and in
the op host-time benchmark.  Its Python impl walks
every branch of :func:`~.compute.linear_forward` /
:func:`~.compute.linear_backward` (quantization, delayed scaling, the
weight cache, collectives) around one or two GEMMs.  The plain
configuration (no recipe, no tensor parallelism, plain tensors, no
``main_grad``) runs the same GEMM calls here directly, with the same
arguments, so the outputs are the Python impl's bit for bit; every other
call returns None and runs the Python impl.  For unquantized operands
every device's ``"gemm"`` is :func:`~..kernels.gemm.gemm_reference`
(``F.linear``; cuda_gemm.py's ``"bf16"`` path), called here without the
dispatch.  Eager calls of such a layer with a bias run the same functions
behind one autograd node, :class:`PlainLinear`.  On CUDA, once the native
extension is built, the eager calls and the backward op's calls with a
bias gradient run the native plain plan instead (module/linear/native.py,
``_plain_plan``): the same calls from C++, and a C++ autograd node.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ... import kernels
from ...checkpointing import check_forward_op_in_backward
from ...quantization.gemm import gemm_reference
from .args import _tp

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def forward(args):
    """The forward op's outputs (``[y]``) for a plain call, else None."""
    x, w, b = args.inp, args.weight, args.bias
    if (args.input_quantizer is not None or args.output_quantizer is not None
            or type(x) not in _PLAIN or type(w) not in _PLAIN
            or (b is not None and type(b) not in _PLAIN) or _tp(args)[0]
            or args.amax_history_fwd is not None or args.weight_workspace is not None
            or args.cache_weight):
        return None
    check_forward_op_in_backward(args)
    return [linear(x, w, b)]


def linear(x, w, b):
    """``x W^T + b`` as the ops compute it: the Python impl's output, a view
    made to own its storage (custom_op._owning)."""
    y = gemm_reference(x, "rowwise", w, "rowwise", x.dtype, b, fast_accum=True)
    return y.view(*x.shape[:-1], w.shape[0]).detach()


def backward(args):
    """The backward op's outputs (dgrad, wgrad, dbias, those asked for) for
    a plain call, else None."""
    dy, x, w = args.grad_output, args.inputmat, args.weightmat
    if (args.grad_output_quantizer is not None or args.input_quantizer is not None
            or args.grad_input_quantizer is not None or args.main_grad is not None
            or args.amax_history_bwd is not None or _tp(args)[0]
            or type(dy) not in _PLAIN
            or (args.weight_requires_grad and type(x) not in _PLAIN)
            or (args.input_requires_grad and type(w) not in _PLAIN)):
        return None
    grads = linear_grads(dy, x, w, args.input_requires_grad, args.weight_requires_grad,
                         args.bias_requires_grad, args.weight_dtype, args.bias_dtype)
    return [g for g in grads if g is not None]


def linear_grads(dy, x, w, dgrad: bool, wgrad: bool, dbias: bool, weight_dtype, bias_dtype):
    """(dgrad, wgrad, dbias) as the ops compute them, None where not asked for.
    A tensor-subclass ``dy`` (the eager nodes' gradient only: the ops take
    plain tensors) gets its bias gradient from torch's sum."""
    dx = dw = db = None
    if dgrad:
        dx = gemm_reference(dy, "rowwise", w, "columnwise", dy.dtype).view(
            *dy.shape[:-1], w.shape[-1])
    if wgrad:
        dw = gemm_reference(dy, "columnwise", x, "columnwise", weight_dtype)
    if dbias:
        dy2d = dy.reshape(-1, dy.shape[-1])
        # the kernel reads raw pointers: a subclass gradient (a DTensor, say)
        # has none of its own and sums through torch, which dispatches through it
        column_sum = (kernels.reference.column_sum if is_traceable_wrapper_subclass(dy2d)
                      else kernels.get("column_sum", dy2d))
        db = column_sum(dy2d, bias_dtype)
    return dx, dw, db


class PlainLinear(torch.autograd.Function):
    """An eager bf16 ``te.Linear`` call with a bias (``Linear._forward``):
    the ops' GEMMs and bias-gradient kernel behind one lean autograd node,
    instead of the eager path's argument building and generic node.  A
    compiled call keeps the ops (whose forward then runs :func:`forward`),
    so compiled equals eager bit for bit.  Without a bias the layer runs
    ``F.linear`` itself."""

    @staticmethod
    def forward(ctx, x, w, b):
        # as the ops: x only for the weight's gradient, W only for the input's
        dgrad, wgrad = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if wgrad else None, w if dgrad else None)
        ctx.weight_dtype, ctx.bias_dtype = w.dtype, b.dtype
        return linear(x, w, b)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return linear_grads(dy, x, w, *ctx.needs_input_grad, ctx.weight_dtype, ctx.bias_dtype)


def runs(inp, bias) -> bool:
    """Whether an eager call the layer found plain (no recipe, a plain
    weight, no tensor parallelism, no fused wgrad accumulation) with
    ``bias`` added takes :class:`PlainLinear`."""
    return (type(inp) in _PLAIN and type(bias) in _PLAIN and bias.dtype == inp.dtype
            and not torch.compiler.is_compiling())
