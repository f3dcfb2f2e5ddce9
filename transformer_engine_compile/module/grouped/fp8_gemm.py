"""The grouped GEMMs of per-expert FP8 current scaling on CUDA.

``torch._scaled_grouped_mm`` (CUTLASS on Hopper) takes E4M3 operands, the
left one row-major and the right one column-major, with fp32 *rowwise*
scales: a per-expert tensor scale is a rowwise scale that repeats, so the
kernel fits the recipe.  Its scales multiply the fp32 accumulator before the
output's rounding to bf16.

* fprop ``y = x W^T``: 2-D x 3-D, the groups along the rows; any group
  size works (zero included).
* dgrad ``dx = dy W``: the same, W read through its per-expert transposed
  copy (``(experts, in, out)``, column-major as the kernel wants it).
* wgrad ``dW_g = dy_g^T x_g``: 2-D x 2-D, the groups along the reduced dim.
  There the kernel asserts on the device that every group is non-empty and,
  but for the last, a multiple of 16 rows long (16-byte TMA alignment), so
  it reads dy's and x's transposed copies with the tokens in groups padded
  to 16 (``padding.py``: a static size, zeros between the groups), which
  the quantization writes (``quantize.py``).

E5M2 operands (the gradients of ``Format.HYBRID``) have no FP8 grouped
kernel on Hopper: those GEMMs run ``torch._grouped_mm`` in bf16 on the FP8
values (exact in bf16) and apply the two scales to its output per expert.

Accumulation: fprop fast, dgrad and wgrad split by default (Transformer
Engine's), each as the recipe's ``fp8_gemm_*`` says.
"""

from __future__ import annotations

import torch

# the FP8 grouped GEMM's alignment of a group along the reduced dim (16 bytes)
ALIGN = 16


def _rowwise(scale_inv: torch.Tensor, n: int) -> torch.Tensor:
    """Per-expert scales as the kernel's ``(experts, n)`` rowwise scales."""
    return scale_inv.unsqueeze(1).expand(-1, n).contiguous()


def fprop(xq, x_scale_inv, wq, w_scale_inv, rows, offs, fast_accum: bool = True) -> torch.Tensor:
    """``y_g = x_g W_g^T`` (bf16) from FP8 ``xq`` ``(tokens, in)`` and ``wq``
    ``(experts, out, in)``; ``rows`` is each row's expert."""
    if not _e4m3(xq, wq):
        return _unscaled(torch._grouped_mm(xq.to(torch.bfloat16),
                                           wq.to(torch.bfloat16).transpose(-2, -1), offs=offs),
                         (x_scale_inv * w_scale_inv)[rows], (-1, 1))
    return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), x_scale_inv[rows],
                                    _rowwise(w_scale_inv, wq.shape[1]), offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def dgrad(dyq, dy_scale_inv, wq_t, w_scale_inv, rows, offs,
          fast_accum: bool = False) -> torch.Tensor:
    """``dx_g = dy_g W_g`` (bf16) from ``wq_t``, W's ``(experts, in, out)``
    transposed copy."""
    w_cols = wq_t.transpose(-2, -1)
    if not _e4m3(dyq, wq_t):
        return _unscaled(torch._grouped_mm(dyq.to(torch.bfloat16), w_cols.to(torch.bfloat16),
                                           offs=offs),
                         (dy_scale_inv * w_scale_inv)[rows], (-1, 1))
    return torch._scaled_grouped_mm(dyq, w_cols, dy_scale_inv[rows],
                                    _rowwise(w_scale_inv, wq_t.shape[1]), offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def wgrad(dyq_t, dy_scale_inv, xq_t, x_scale_inv, pad_offs,
          fast_accum: bool = False) -> torch.Tensor:
    """``dW_g = dy_g^T x_g`` (bf16, ``(experts, out, in)``) from dy's and x's
    transposed copies, ``(out, P)`` and ``(in, P)``, the tokens in the
    padded groups that end at ``pad_offs``."""
    if not _e4m3(dyq_t, xq_t):
        return _unscaled(torch._grouped_mm(dyq_t.to(torch.bfloat16),
                                           xq_t.to(torch.bfloat16).t(), offs=pad_offs),
                         dy_scale_inv * x_scale_inv, (-1, 1, 1))
    return torch._scaled_grouped_mm(
        dyq_t, xq_t.t(), _rowwise(dy_scale_inv, dyq_t.shape[0]).view(-1),
        _rowwise(x_scale_inv, xq_t.shape[0]).view(-1), offs=pad_offs,
        out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def _e4m3(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float8_e4m3fn


def _unscaled(out: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """A bf16 GEMM's output of FP8 values times their scales, per expert."""
    return (out.float() * scale.view(shape)).to(torch.bfloat16)
