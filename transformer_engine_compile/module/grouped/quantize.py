"""Per-expert FP8 current scaling of grouped operands: each expert's rows of
x (or dy), and each expert's W, quantized with a scale from their own amax,
the values a ``te.Linear`` per expert makes (``kernels/reference.py``'s
scale and saturating cast, elementwise the same)."""

from __future__ import annotations

import torch

from ...kernels import reference as ref


def quantize_rows(x2d: torch.Tensor, group_of_row: torch.Tensor, groups: int, q) -> tuple:
    """``(FP8 rows, fp32 scale_inv per group)`` of ``x2d``'s row groups."""
    row_amax = x2d.abs().amax(dim=1).float() if x2d.shape[1] else \
        x2d.new_zeros(x2d.shape[0], dtype=torch.float32)
    amax = torch.zeros(groups, dtype=torch.float32, device=x2d.device).scatter_reduce(
        0, group_of_row, row_amax, "amax")
    scale = ref.current_scale(amax, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon)
    return ref.cast_fp8(x2d, scale[group_of_row].unsqueeze(1), q.fp8_format), \
        torch.reciprocal(scale)


def quantize_experts(w3d: torch.Tensor, q) -> tuple:
    """``(FP8 weights, fp32 scale_inv per expert)`` of ``(experts, out, in)``."""
    amax = w3d.abs().amax(dim=(1, 2)).float()
    scale = ref.current_scale(amax, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon)
    return ref.cast_fp8(w3d, scale.view(-1, 1, 1), q.fp8_format), torch.reciprocal(scale)


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, group_of_row) -> torch.Tensor:
    return data.float() * scale_inv[group_of_row].unsqueeze(1)


def dequantize_experts(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.float() * scale_inv.view(-1, 1, 1)
