"""Per-group FP8 scaling in Triton (the registered CUDA kernels of
``quantize_fp8_grouped``, current scaling, and ``quantize_fp8_grouped_scaled``,
delayed scaling's given scales): a mixture of experts' tokens, or its stacked
expert weights, each group of rows scaled by its own amax.

Two launches each: the groups' amaxes (each program reduces a band of rows over
all columns and raises its group's maximum with one atomic when the band
holds one group, as sorted tokens and stacked weights mostly do), then the
cast with each row's group scale.  Under current scaling the scale comes from
``reference.current_scale`` on the ``groups`` amaxes, so the values are the
reference's bit for bit; eager PyTorch took ~7 full passes with fp32
temporaries for the same cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .triton_quant import _TL_FP8, _abs_bits, _cast_fp8, _int_slot

_AMAX_BM, _AMAX_BK = 16, 256
_CAST_BM, _CAST_BK = 32, 128


@triton.jit
def _groups_of(rm, valid, group_ptr, rows_per_group, BY_INDEX: tl.constexpr):
    if BY_INDEX:
        return tl.load(group_ptr + rm, mask=valid, other=0).to(tl.int32)
    return (rm // rows_per_group).to(tl.int32)


@triton.jit
def _grouped_amax_kernel(x_ptr, M, K, group_ptr, rows_per_group, amax_ptr,
                         BY_INDEX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = rm < M
    bits = tl.zeros((BM,), dtype=tl.int32)
    for k in range(0, K, BK):
        rk = k + tl.arange(0, BK)
        mask = valid[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0)
        bits = tl.maximum(bits, tl.max(_abs_bits(x), axis=1))
    g = _groups_of(rm, valid, group_ptr, rows_per_group, BY_INDEX)
    first = tl.min(tl.where(valid, g, 2147483647), axis=0)
    last = tl.max(tl.where(valid, g, -1), axis=0)
    slots = _int_slot(amax_ptr)
    if first == last:  # one group in the band: one atomic
        tl.atomic_max(slots + first, tl.max(bits, axis=0))
    else:
        tl.atomic_max(slots + g, bits, mask=valid)


@triton.jit
def _grouped_cast_kernel(x_ptr, M, K, group_ptr, rows_per_group, scale_ptr, out_ptr,
                         FMT_MAX: tl.constexpr, OUT: tl.constexpr, BY_INDEX: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    valid = rm < M
    mask = valid[:, None] & (rk[None, :] < K)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    g = _groups_of(rm, valid, group_ptr, rows_per_group, BY_INDEX)
    s = tl.load(scale_ptr + g, mask=valid, other=1.0)
    tl.store(out_ptr + offs, _cast_fp8(x, s[:, None], FMT_MAX, OUT), mask=mask)


def _index(x, groups: int, group_of_row, rows_per_group: int) -> tuple:
    """``(by_index, group index tensor, rows per group)`` of the kernels'
    arguments (without an index a pointer never read stands in)."""
    by_index = group_of_row is not None
    index = group_of_row.contiguous() if by_index else x
    return by_index, index, max(int(rows_per_group), 1)


def _amax(x, groups: int, by_index: bool, index, per_group: int) -> torch.Tensor:
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device)
    M, K = x.shape
    if M and K:
        _grouped_amax_kernel[(triton.cdiv(M, _AMAX_BM),)](
            x, M, K, index, per_group, amax, BY_INDEX=by_index, BM=_AMAX_BM, BK=_AMAX_BK)
    return amax


def _cast(x, scale, fmt: str, by_index: bool, index, per_group: int) -> torch.Tensor:
    M, K = x.shape
    out = torch.empty((M, K), dtype=ref.FP8_DTYPE[fmt], device=x.device)
    if M and K:
        _grouped_cast_kernel[(triton.cdiv(M, _CAST_BM), triton.cdiv(K, _CAST_BK))](
            x, M, K, index, per_group, scale, out, FMT_MAX=ref.FP8_MAX[fmt], OUT=_TL_FP8[fmt],
            BY_INDEX=by_index, BM=_CAST_BM, BK=_CAST_BK)
    return out


def quantize_fp8_grouped(x2d, groups: int, fmt: str, pow2: bool, eps: float,
                         group_of_row=None, rows_per_group: int = 0) -> tuple:
    """As ``reference.quantize_fp8_grouped``."""
    x = x2d.contiguous()
    grouping = _index(x, groups, group_of_row, rows_per_group)
    scale = ref.current_scale(_amax(x, groups, *grouping), fmt, pow2, eps)
    return _cast(x, scale, fmt, *grouping), torch.reciprocal(scale)


def quantize_fp8_grouped_scaled(x2d, scale, fmt: str, group_of_row=None,
                                rows_per_group: int = 0) -> tuple:
    """As ``reference.quantize_fp8_grouped_scaled``."""
    x = x2d.contiguous()
    grouping = _index(x, scale.shape[0], group_of_row, rows_per_group)
    amax = _amax(x, scale.shape[0], *grouping)
    return _cast(x, scale.float().contiguous(), fmt, *grouping), amax
