"""The linear ops' calls without a recipe, in a short path (issue 14).

A ``te_compile::linear_fwd`` / ``linear_bwd`` call without a recipe (bf16
training) stays an op call where inductor does not lower it (the forward
of a layer with a bias, ``_lowers_forward``; ``backend="aot_eager"``) and in
the op host-time benchmark.  Its Python impl walks
every branch of :func:`~.linear_ops.linear_forward` /
:func:`~.linear_ops.linear_backward` (quantization, delayed scaling, the
weight cache, collectives) around one or two GEMMs.  The plain
configuration (no recipe, no tensor parallelism, plain tensors, no
``main_grad``) runs the same GEMM calls here directly, with the same
arguments, so the outputs are the Python impl's bit for bit; every other
call returns None and runs the Python impl.  For unquantized operands
every device's ``"gemm"`` is :func:`~..kernels.gemm.gemm_reference`
(``F.linear``; cuda_gemm.py's ``"bf16"`` path), called here without the
dispatch.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..checkpointing import check_forward_op_in_backward
from ..kernels.gemm import gemm_reference

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def forward(args):
    """The forward op's outputs (``[y]``) for a plain call, else None."""
    x, w, b = args.inp, args.weight, args.bias
    if (args.input_quantizer is not None or args.output_quantizer is not None
            or type(x) not in _PLAIN or type(w) not in _PLAIN
            or (b is not None and type(b) not in _PLAIN) or _split(args)
            or args.amax_history_fwd is not None or args.weight_workspace is not None
            or args.cache_weight):
        return None
    check_forward_op_in_backward(args)
    y = gemm_reference(x, "rowwise", w, "rowwise", x.dtype, b, fast_accum=True)
    # the Python impl's output: a view made to own its storage (custom_op._owning)
    return [y.view(*x.shape[:-1], w.shape[0]).detach()]


def backward(args):
    """The backward op's outputs (dgrad, wgrad, dbias, those asked for) for
    a plain call, else None."""
    dy, x, w = args.grad_output, args.inputmat, args.weightmat
    if (args.grad_output_quantizer is not None or args.input_quantizer is not None
            or args.grad_input_quantizer is not None or args.main_grad is not None
            or args.amax_history_bwd is not None or _split(args) or type(dy) not in _PLAIN
            or (args.weight_requires_grad and type(x) not in _PLAIN)
            or (args.input_requires_grad and type(w) not in _PLAIN)):
        return None
    out = []
    if args.input_requires_grad:
        out.append(gemm_reference(dy, "rowwise", w, "columnwise", dy.dtype).view(
            *dy.shape[:-1], w.shape[-1]))
    if args.weight_requires_grad:
        out.append(gemm_reference(dy, "columnwise", x, "columnwise", args.weight_dtype))
    if args.bias_requires_grad:
        dy2d = dy.reshape(-1, dy.shape[-1])
        out.append(kernels.get("column_sum", dy2d)(dy2d, args.bias_dtype))
    return out


def _split(args) -> bool:
    """Whether the layer is split over more than one rank."""
    return args.parallel_mode is not None and args.tp_size != 1
