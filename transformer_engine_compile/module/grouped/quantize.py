"""Per-expert FP8 scaling of grouped operands: each expert's rows of x (or
dy), and each expert's W, quantized with a scale of their own, the values a
``te.Linear`` per expert makes (``kernels/reference.py``'s scale and
saturating cast, elementwise the same).  Current scaling takes the scale
from the expert's amax; DelayedScaling passes the expert's scale from its
amax history, and the amax is recorded for the next.

Kernel ops, one launch each on CUDA (``kernels/triton_grouped.py``):
``amax_grouped``; under current scaling ``current_scales_grouped``, each
group's scale and its reciprocal (a dozen small torch ops otherwise,
about 40% of the grouped ops' host time); then ``cast_fp8_grouped``,
which writes the rowwise copy and, where a GEMM reduces over the rows,
the transposed copy it reads: x's and dy's with the experts' tokens in
16-aligned groups (``padding.py``: wgrad), W's per expert (dgrad)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ...kernels import get


class Quantized(NamedTuple):
    data: Optional[torch.Tensor]        # rowwise FP8, the operand's own shape
    transposed: Optional[torch.Tensor]  # x, dy: (cols, padded rows); W: (experts, in, out)
    scale_inv: torch.Tensor             # (groups,) fp32
    amax: torch.Tensor                  # (groups,) fp32: this call's (DelayedScaling records it)


def _scales(amax: torch.Tensor, q, scale: Optional[torch.Tensor]) -> tuple:
    """``(scale, scale_inv)``: the given (delayed) scale, else current
    scaling's from ``amax`` (one kernel on CUDA)."""
    if scale is not None:
        return scale, torch.reciprocal(scale)
    return get("current_scales_grouped", amax)(amax, q.fp8_format, q.force_pow_2_scales,
                                               q.amax_epsilon)


def quantize_tokens(x2d: torch.Tensor, group_of_row: torch.Tensor, groups: int, q,
                    scale: Optional[torch.Tensor] = None,
                    columns_from: Optional[torch.Tensor] = None) -> Quantized:
    """``x2d``'s row groups in FP8; with ``columns_from`` (``padding.padded_sources``)
    also the ``(cols, padded rows)`` transposed copy."""
    amax = get("amax_grouped", x2d)(x2d, groups, group_of_row=group_of_row)
    s, s_inv = _scales(amax, q, scale)
    data, transposed = get("cast_fp8_grouped", x2d)(x2d, s, q.fp8_format,
                                                   group_of_row=group_of_row,
                                                   columns_from=columns_from)
    return Quantized(data, transposed, s_inv, amax)


def quantize_experts(w3d: torch.Tensor, q, scale: Optional[torch.Tensor] = None,
                     transposed: bool = False) -> Quantized:
    """``(experts, out, in)`` weights in FP8, each expert with its scale;
    with ``transposed`` also the ``(experts, in, out)`` copy."""
    experts, rows, cols = w3d.shape
    w2d = w3d.reshape(experts * rows, cols)
    amax = amax_experts(w3d)
    s, s_inv = _scales(amax, q, scale)
    data, t = get("cast_fp8_grouped", w2d)(w2d, s, q.fp8_format, rows_per_group=rows,
                                           transpose_groups=transposed)
    return Quantized(data.view(experts, rows, cols), t, s_inv, amax)


def amax_experts(w3d: torch.Tensor) -> torch.Tensor:
    """Each expert's amax of ``(experts, out, in)`` weights (fp32,
    ``(experts,)``): what :func:`quantize_experts` records, without the cast."""
    experts, rows, cols = w3d.shape
    w2d = w3d.reshape(experts * rows, cols)
    return get("amax_grouped", w2d)(w2d, experts, rows_per_group=rows)


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, group_of_row) -> torch.Tensor:
    return data.float() * scale_inv[group_of_row].unsqueeze(1)


def dequantize_experts(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.float() * scale_inv.view(-1, 1, 1)
