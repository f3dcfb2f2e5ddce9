"""``te.GroupedLinear``'s forward and backward, written once against
:class:`~.args.GroupedLinearFwdArgs` / :class:`~.args.GroupedLinearBwdArgs`,
each impl with its fake next to it.

Every GEMM is one ``torch._grouped_mm`` over all experts, the groups given
by ``m_offsets`` (an expert with no tokens contributes nothing and gets a
zero weight gradient):

* fprop ``y_g = x_g W_g^T``: ``_grouped_mm(x, W^T, offs)`` (2-D x 3-D);
* dgrad ``dx_g = dy_g W_g``: ``_grouped_mm(dy, W, offs)``;
* wgrad ``dW_g = dy_g^T x_g``: ``_grouped_mm(dy^T, x, offs)`` (2-D x 2-D,
  the groups along the reduced dim);
* the bias gradient ``db_g = sum of dy_g's rows`` the same way against a
  block of ones: a GEMM's fixed reduction order, where a scatter-add's
  atomics would differ from run to run.
"""

from __future__ import annotations

import torch

from ...dynamo.custom_op import OpResult
from ...dynamo.tensor_proto import TensorProto
from .args import GroupedLinearBwdArgs, GroupedLinearFwdArgs

# the ones block of the bias gradient: a few columns keep its rows 16-byte
# aligned, as the CUDA grouped GEMM requires of its operands
_ONES_COLS = 8


def group_ids(m_offsets: torch.Tensor, tokens: int) -> torch.Tensor:
    """The expert of every row (int64, ``(tokens,)``), from the end rows."""
    rows = torch.arange(tokens, device=m_offsets.device, dtype=m_offsets.dtype)
    return torch.searchsorted(m_offsets, rows, right=True)


def grouped_linear_forward(args: GroupedLinearFwdArgs) -> OpResult:
    x, w, offs = args.inp, args.weight, args.m_offsets
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if args.bias is not None:
        y = y + args.bias[group_ids(offs, x.shape[0])]
    return OpResult({"out": y}, {"inputmat": x if args.weight_requires_grad else None,
                                 "weightmat": w if args.input_requires_grad else None,
                                 "m_offsets": offs})


def grouped_linear_forward_fake(args: GroupedLinearFwdArgs) -> OpResult:
    x, w = args.inp, args.weight
    y = TensorProto((x.shape[0], w.shape[1]), x.dtype, device=x.device)
    return OpResult({"out": y}, {"inputmat": x if args.weight_requires_grad else None,
                                 "weightmat": w if args.input_requires_grad else None,
                                 "m_offsets": args.m_offsets})


def grouped_linear_setup_context(args: GroupedLinearFwdArgs) -> dict:
    """Non-tensor fields of GroupedLinearBwdArgs (tensors come from ``saved``)."""
    return {"input_requires_grad": args.input_requires_grad,
            "weight_requires_grad": args.weight_requires_grad,
            "bias_requires_grad": args.bias_requires_grad,
            "weight_dtype": args.weight.dtype,
            "bias_dtype": None if args.bias is None else args.bias.dtype}


def grouped_linear_backward(args: GroupedLinearBwdArgs) -> dict:
    # an expanded gradient (of ``y.sum()``) has zero strides, which the
    # grouped GEMM refuses
    dy, offs = args.grad_output.contiguous(), args.m_offsets
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        dgrad = torch._grouped_mm(dy, args.weightmat, offs=offs)
    if args.weight_requires_grad:
        wgrad = torch._grouped_mm(dy.t(), args.inputmat, offs=offs).to(args.weight_dtype)
    if args.bias_requires_grad:
        ones = torch.ones(dy.shape[0], _ONES_COLS, dtype=dy.dtype, device=dy.device)
        dbias = torch._grouped_mm(dy.t(), ones, offs=offs)[..., 0].to(args.bias_dtype).contiguous()
    return {"inp": dgrad, "weight": wgrad, "bias": dbias}


def grouped_linear_backward_fake(args: GroupedLinearBwdArgs) -> dict:
    dy = args.grad_output
    groups = args.m_offsets.shape[0]
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        dgrad = TensorProto((dy.shape[0], args.weightmat.shape[2]), dy.dtype, device=dy.device)
    if args.weight_requires_grad:
        wgrad = TensorProto((groups, dy.shape[1], args.inputmat.shape[1]), args.weight_dtype,
                            device=dy.device)
    if args.bias_requires_grad:
        dbias = TensorProto((groups, dy.shape[1]), args.bias_dtype, device=dy.device)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias}
