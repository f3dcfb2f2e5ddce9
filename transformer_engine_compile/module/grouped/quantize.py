"""Per-expert FP8 scaling of grouped operands: each expert's rows of x (or
dy), and each expert's W, quantized with a scale of their own, the values a
``te.Linear`` per expert makes (``kernels/reference.py``'s scale and
saturating cast, elementwise the same).  Current scaling takes the scale
from the expert's amax (kernel op ``quantize_fp8_grouped``); DelayedScaling
casts with the expert's scale from its amax history and records the amax
(``quantize_fp8_grouped_scaled``).  Two Triton launches each on CUDA
(``kernels/triton_grouped.py``), the reference elsewhere."""

from __future__ import annotations

import torch

from ...kernels import get


def quantize_rows(x2d: torch.Tensor, group_of_row: torch.Tensor, groups: int, q) -> tuple:
    """``(FP8 rows, fp32 scale_inv per group)`` of ``x2d``'s row groups."""
    return get("quantize_fp8_grouped", x2d)(x2d, groups, q.fp8_format, q.force_pow_2_scales,
                                            q.amax_epsilon, group_of_row=group_of_row)


def quantize_experts(w3d: torch.Tensor, q) -> tuple:
    """``(FP8 weights, fp32 scale_inv per expert)`` of ``(experts, out, in)``."""
    experts, rows, cols = w3d.shape
    data, scale_inv = get("quantize_fp8_grouped", w3d)(
        w3d.reshape(experts * rows, cols), experts, q.fp8_format, q.force_pow_2_scales,
        q.amax_epsilon, rows_per_group=rows)
    return data.view(experts, rows, cols), scale_inv


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, group_of_row) -> torch.Tensor:
    return data.float() * scale_inv[group_of_row].unsqueeze(1)


def dequantize_experts(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.float() * scale_inv.view(-1, 1, 1)


def quantize_rows_scaled(x2d: torch.Tensor, group_of_row: torch.Tensor, scale: torch.Tensor,
                         q) -> tuple:
    """``(FP8 rows, fp32 amax per group)``: ``x2d``'s row groups cast with
    the given per-group ``scale`` (DelayedScaling)."""
    return get("quantize_fp8_grouped_scaled", x2d)(x2d, scale, q.fp8_format,
                                                   group_of_row=group_of_row)


def quantize_experts_scaled(w3d: torch.Tensor, scale: torch.Tensor, q) -> tuple:
    """``(FP8 weights, fp32 amax per expert)`` of ``(experts, out, in)``,
    each expert cast with its given ``scale``."""
    experts, rows, cols = w3d.shape
    data, amax = get("quantize_fp8_grouped_scaled", w3d)(
        w3d.reshape(experts * rows, cols), scale, q.fp8_format, rows_per_group=rows)
    return data.view(experts, rows, cols), amax
