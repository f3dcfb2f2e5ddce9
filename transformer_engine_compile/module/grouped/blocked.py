"""``te.GroupedLinear`` under the block-scaled recipes (FP8 blockwise,
MXFP8, NVFP4): each expert quantized as a ``te.Linear`` of its own would
be, then grouped GEMMs of the dequantized operands.

The tokens are moved into groups padded to whole 128-row blocks
(``padding.py``): 128 is a multiple of every format's block along the
tokens (128 for blockwise, 32 for MXFP8, 16 for NVFP4), so no block of the
columnwise copies (the wgrad operands) spans two experts, and the rowwise
blocks lie within a row.  One quantizer call then quantizes every expert's
tokens as it would quantize each expert's alone (a ragged row count is
padded with zeros the same way); each expert's weight is quantized on its
own.  NVFP4's second-level (per-tensor) scale is the one exception: it
comes from the amax of all experts' tokens together.

Under ``Float8BlockScaling`` on Hopper the GEMMs run the CuTeDSL FP8
blockwise grouped GEMM on these operands (``blockwise_gemm.py``, with
``nvidia-cutlass-dsl`` installed; the forward is routed there by
``compute.py``, and keeps the columnwise FP8 copies its backward reads).
Otherwise no grouped kernel takes these block scales, so the GEMMs run on
the dequantized values: fp32 on the CPU (the reference numerics of a
``te.Linear`` per expert), bf16 ``torch._grouped_mm`` on CUDA (exact for
the power-of-two scales of blockwise and MXFP8); the forward saves the
high-precision x and W, and the backward quantizes them again for its
columnwise copies.
"""

from __future__ import annotations

import torch

from . import blockwise_gemm
from .padding import padded_rows_of, scatter_rows

# a multiple of every format's block along the tokens
_BLOCK_ROWS = 128


def _gemm_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if t.is_cuda else torch.float32


def _operand(q, t, usage: str, dtype) -> torch.Tensor:
    """The ``usage`` GEMM operand of ``t`` quantized by ``q`` (``gemm.py``'s
    convention: rowwise ``(M, K)``, columnwise ``(K, M)``)."""
    variant = q.usage_variant(usage == "rowwise", usage == "columnwise")
    return variant.quantize(t).gemm_operand(usage).to(dtype)


def _experts(q, w: torch.Tensor, usage: str, dtype) -> torch.Tensor:
    """Each expert's weight quantized alone, as ``(experts, ...)`` operands."""
    return torch.stack([_operand(q, w[g], usage, dtype) for g in range(w.shape[0])])


def fprop(x, w, q_x, q_w, rows, offs) -> torch.Tensor:
    """``y_g = x_g W_g^T`` in the GEMM dtype (fp32 on CPU, bf16 on CUDA)."""
    dtype = _gemm_dtype(x)
    dest, pad_offs, size = padded_rows_of(offs, rows, _BLOCK_ROWS)
    y = torch._grouped_mm(_operand(q_x, scatter_rows(x, dest, size), "rowwise", dtype),
                          _experts(q_w, w, "rowwise", dtype).transpose(-2, -1), offs=pad_offs)
    return y[dest]


def grads(dy, x, w, q_dy, q_x, q_w, rows, offs, dgrad: bool, wgrad: bool,
          w_dtype: torch.dtype, x_scale=None, w_scale=None) -> tuple:
    """``(dx, dW)`` (each None unless asked): dy quantized once with the
    copies the two GEMMs read; ``dx_g = dy_g W_g`` (dy rowwise, W
    columnwise ``(K, N)`` per expert), ``dW_g = dy_g^T x_g`` (both
    columnwise, their 128-row blocks within one expert).  The kernel
    rounds dW to ``w_dtype``; the dequantized path returns its GEMM's.
    ``x`` and ``w`` may be the kernel's forward's FP8 copies (with their
    scales): then the kernel runs the backward too."""
    if blockwise_gemm.is_kept_copy(x) or blockwise_gemm.is_kept_copy(w) or \
            blockwise_gemm.applies(dy, x.shape[1] if x is not None else w.shape[2],
                                   dy.shape[1], q_x, q_w, q_dy):
        return blockwise_gemm.grads(dy, x, w, q_dy, q_x, q_w, rows, offs, dgrad, wgrad,
                                    w_dtype, x_scale, w_scale)
    dtype = _gemm_dtype(dy)
    dest, pad_offs, size = padded_rows_of(offs, rows, _BLOCK_ROWS)
    dyq = q_dy.usage_variant(dgrad, wgrad).quantize(scatter_rows(dy, dest, size))
    dx = dw = None
    if dgrad:
        dx = torch._grouped_mm(dyq.gemm_operand("rowwise").to(dtype),
                               _experts(q_w, w, "columnwise", dtype).transpose(-2, -1),
                               offs=pad_offs)[dest]
    if wgrad:
        xt = _operand(q_x, scatter_rows(x, dest, size), "columnwise", dtype)
        dw = torch._grouped_mm(dyq.gemm_operand("columnwise").to(dtype), xt.t(), offs=pad_offs)
    return dx, dw
