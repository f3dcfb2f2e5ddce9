"""Per-group FP8 casts in Triton, the registered CUDA kernels of
``amax_grouped`` and ``cast_fp8_grouped``: a mixture of experts' tokens,
or its stacked expert weights, each group of rows with a scale of its own
(from its amax under current scaling, from its history under delayed
scaling; ``reference`` computes the scale from these amaxes, so the values
are the reference's bit for bit).

``_grouped_amax_kernel``: each program reduces a band of rows over all
columns and raises its group's maximum with one atomic when the band holds
one group, as sorted tokens and stacked weights mostly do.

The casts write the rowwise copy and, in the same launch, the transposed
copy a GEMM that reduces over rows reads (wgrad's x and dy, dgrad's W):
tokens into ``(K, P)`` with the groups padded apart (a program per tile of
*padded* columns, so the transposed stores are contiguous; padding columns
get zeros), stacked weights into ``(groups, K, rows)``.  The transposed
tile is loaded a second time in its own orientation (from cache), not
``tl.trans``-ed: see ``triton_quant._tile_t``.  Eager PyTorch took a
strided copy per operand for the same transposes (a third of the step of a
Mixtral-sized block, H200).

Each kernel is launched through ``triton_launch.Launcher`` (its compiled
handle, not ``kernel[grid]``): a grouped op quantizes two operands with
three launches each, and the launch is most of their host time.  The keys
are :func:`triton_launch.args_key` of the arguments: every pointer's dtype
and alignment, every int's specialization, the constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .triton_launch import Launcher, args_key, cdiv
from .triton_quant import _TL_FP8, _abs_bits, _cast_fp8, _int_slot, _recip, _scale_from_amax

_AMAX_BM, _AMAX_BK = 16, 256
_CAST_BM, _CAST_BK = 32, 128
_T_BM, _T_BK = 64, 64  # transposing casts: 64 one-byte values stored contiguously
_SCALES_BLOCK = 256


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
def _grouped_scales_kernel(amax_ptr, G, out_ptr, FMT_MAX: tl.constexpr, EPS: tl.constexpr,
                           POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Each group's current-scaling scale (row 0 of ``out``) and its
    reciprocal (row 1) from its amax: ``reference.current_scales_grouped``."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = g < G
    s = _scale_from_amax(tl.load(amax_ptr + g, mask=valid, other=0.0), FMT_MAX, EPS, POW2)
    tl.store(out_ptr + g, s, mask=valid)
    tl.store(out_ptr + G + g, _recip(s), mask=valid)


@triton.jit
def _grouped_cast_kernel(x_ptr, M, K, group_ptr, rows_per_group, scale_ptr, out_ptr,
                         FMT_MAX: tl.constexpr, OUT: tl.constexpr, BY_INDEX: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr):
    """Rowwise only."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    valid = rm < M
    mask = valid[:, None] & (rk[None, :] < K)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    g = _groups_of(rm, valid, group_ptr, rows_per_group, BY_INDEX)
    s = tl.load(scale_ptr + g, mask=valid, other=1.0)
    tl.store(out_ptr + offs, _cast_fp8(x, s[:, None], FMT_MAX, OUT), mask=mask)


@triton.jit
def _token_cast_t_kernel(x_ptr, K, P, src_ptr, group_ptr, scale_ptr, out_ptr, out_t_ptr,
                         FMT_MAX: tl.constexpr, OUT: tl.constexpr, ROWWISE: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr):
    """Tokens over a tile of padded columns ``rp``: row ``src[p]`` of x (none
    where negative), cast with its group's scale, stored at row ``src[p]``
    (rowwise) and at column ``p`` of the ``(K, P)`` transposed copy."""
    rp = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    in_p = rp < P
    src = tl.load(src_ptr + rp, mask=in_p, other=-1)
    valid = src >= 0
    g = tl.load(group_ptr + src, mask=valid, other=0)
    s = tl.load(scale_ptr + g, mask=valid, other=1.0)
    row = src.to(tl.int64) * K
    if ROWWISE:
        mask = valid[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + row[:, None] + rk[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + row[:, None] + rk[None, :], _cast_fp8(x, s[:, None], FMT_MAX, OUT),
                 mask=mask)
    mask_t = (rk[:, None] < K) & valid[None, :]
    xt = tl.load(x_ptr + row[None, :] + rk[:, None], mask=mask_t, other=0.0)
    tl.store(out_t_ptr + rk[:, None].to(tl.int64) * P + rp[None, :],
             _cast_fp8(xt, s[None, :], FMT_MAX, OUT), mask=(rk[:, None] < K) & in_p[None, :])


@triton.jit
def _stacked_cast_t_kernel(x_ptr, R, K, scale_ptr, out_ptr, out_t_ptr,
                           FMT_MAX: tl.constexpr, OUT: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr):
    """Group ``program_id(2)``'s ``(R, K)`` block: rowwise, and transposed
    into its ``(K, R)`` block."""
    e = tl.program_id(2)
    rn = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    base = e.to(tl.int64) * R * K
    s = tl.load(scale_ptr + e)
    mask = (rn[:, None] < R) & (rk[None, :] < K)
    offs = base + rn[:, None].to(tl.int64) * K + rk[None, :]
    tl.store(out_ptr + offs, _cast_fp8(tl.load(x_ptr + offs, mask=mask, other=0.0), s, FMT_MAX,
                                       OUT), mask=mask)
    mask_t = (rk[:, None] < K) & (rn[None, :] < R)
    xt = tl.load(x_ptr + base + rn[None, :].to(tl.int64) * K + rk[:, None], mask=mask_t,
                 other=0.0)
    tl.store(out_t_ptr + base + rk[:, None].to(tl.int64) * R + rn[None, :],
             _cast_fp8(xt, s, FMT_MAX, OUT), mask=mask_t)


_amax_launch = Launcher(_grouped_amax_kernel, num_warps=4)
_scales_launch = Launcher(_grouped_scales_kernel, num_warps=4)
_cast_launch = Launcher(_grouped_cast_kernel, num_warps=4)
_token_t_launch = Launcher(_token_cast_t_kernel, num_warps=4)
_stacked_t_launch = Launcher(_stacked_cast_t_kernel, num_warps=4)


def _launch(launcher: Launcher, grid: tuple, *args) -> None:
    launcher(grid, args_key(args), *args)


def amax_grouped(x2d, groups: int, group_of_row=None, rows_per_group: int = 0) -> torch.Tensor:
    """As ``reference.amax_grouped``."""
    x = x2d.contiguous()
    M, K = x.shape
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device)
    by_index = group_of_row is not None
    if M and K:
        _launch(_amax_launch, (cdiv(M, _AMAX_BM),), x, M, K,
                group_of_row.contiguous() if by_index else x, max(int(rows_per_group), 1),
                amax, by_index, _AMAX_BM, _AMAX_BK)
    return amax


def current_scales_grouped(amax, fmt: str, pow2: bool, eps: float) -> tuple:
    """As ``reference.current_scales_grouped``: one launch where eager
    torch takes a dozen small ops."""
    a = amax.float().contiguous()
    G = a.shape[0]
    out = torch.empty((2, G), dtype=torch.float32, device=a.device)
    if G:
        _launch(_scales_launch, (cdiv(G, _SCALES_BLOCK),), a, G, out, ref.FP8_MAX[fmt],
                float(eps), bool(pow2), _SCALES_BLOCK)
    return out[0], out[1]


def cast_fp8_grouped(x2d, scale, fmt: str, group_of_row=None, rows_per_group: int = 0,
                     rowwise: bool = True, columns_from=None,
                     transpose_groups: bool = False) -> tuple:
    """As ``reference.cast_fp8_grouped``."""
    x, scale = x2d.contiguous(), scale.float().contiguous()
    M, K = x.shape
    dtype, fmt_max, out_fmt = ref.FP8_DTYPE[fmt], ref.FP8_MAX[fmt], _TL_FP8[fmt]
    out = torch.empty((M, K), dtype=dtype, device=x.device) if rowwise or (
        columns_from is None) else None
    if columns_from is not None:
        P = columns_from.shape[0]
        out_t = torch.empty((K, P), dtype=dtype, device=x.device)
        if P and K:
            _launch(_token_t_launch, (cdiv(P, _T_BM), cdiv(K, _T_BK)), x, K, P,
                    columns_from.contiguous(), group_of_row.contiguous(), scale,
                    out if rowwise else out_t, out_t, fmt_max, out_fmt, bool(rowwise),
                    _T_BM, _T_BK)
        return out, out_t
    if transpose_groups:
        R = int(rows_per_group)
        out_t = torch.empty((M // R, K, R), dtype=dtype, device=x.device)
        if M and K:
            _launch(_stacked_t_launch, (cdiv(R, _T_BM), cdiv(K, _T_BK), M // R), x, R, K, scale,
                    out, out_t, fmt_max, out_fmt, _T_BM, _T_BK)
        return (out if rowwise else None), out_t
    by_index = group_of_row is not None
    if M and K:
        _launch(_cast_launch, (cdiv(M, _CAST_BM), cdiv(K, _CAST_BK)), x, M, K,
                group_of_row.contiguous() if by_index else x, max(int(rows_per_group), 1),
                scale, out, fmt_max, out_fmt, by_index, _CAST_BM, _CAST_BK)
    return out, None
