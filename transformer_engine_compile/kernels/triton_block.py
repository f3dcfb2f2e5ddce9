"""FP8 blockwise and MXFP8 quantization kernels for CUDA, in Triton.

Same contract as ``triton_quant`` (whose device helpers they use): each
wrapper has the signature of the same-named function in
``kernels.reference`` and returns bit-identical buffers.  FP8 blockwise
(1x128 and 128x128) and MXFP8 (1x32 / 32x1) take one pass over the tiles
that writes both copies and their block scales (1x128 scales blocks outer,
128x128 ones padded, as the reference stores them), a layer's x and W
under FP8 blockwise one pass together; MXFP8 dequantization to
bf16 (the emulated GEMM's operands) is one pass too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import native
from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, ptr_key
from .triton_quant import (_TL_FP8, _abs_bits, _cast_fp8, _load_tile, _matrix, _pair_tile,
                           _recip, _scale_from_amax, _store_rows, _store_transposed, _tile_index,
                           _tile_t, _unused, _x_key)

_COPY_BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _alloc_copies(like, rowwise, columnwise, row_data, row_scale, col_data, col_scale) -> dict:
    """Output buffers of a two-copy format on ``like``'s device (one
    allocation call); each spec is (shape, dtype)."""
    specs = {name: spec for name, spec in zip(_COPY_BUFFERS, (row_data, row_scale, col_data,
                                                               col_scale))
             if (rowwise if name.startswith("row") else columnwise)}
    return dict(zip(specs, native.empty_many(like, *specs.values())))


def _tiles(m, k, bm, bk) -> int:
    """(bm, bk) tiles of an (m, k) matrix: a pair kernel's grid is both matrices'."""
    return cdiv(m, bm) * cdiv(k, bk)


def _copy_args(out: dict, src: torch.Tensor) -> tuple:
    """The four buffer arguments of a two-copy kernel.  An absent copy's slot
    gets the kernel's input ``src``: ROW / COL are constexpr, so it is never
    touched (``triton_quant._unused``)."""
    return tuple(out[name] if name in out else _unused(src) for name in _COPY_BUFFERS)



# -- FP8 blockwise ---------------------------------------------------------------------
@triton.jit
def _fp8_block_kernel(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                      FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                      TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                      OUT: tl.constexpr, B: tl.constexpr):
    _fp8_block_tile(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr, tl.program_id(0),
                    tl.program_id(1), FMT_MAX, EPS, POW2, TWO_D, ROW, COL, OUT, B)


@triton.jit
def _fp8_block_rows_kernel(x_ptr, src_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                           FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                           ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr,
                           B: tl.constexpr):
    """1x128 tiles of the (M, K) matrix whose row i is x's row src[i], zeros
    where src[i] < 0: :func:`_fp8_block_tile`'s 1x128 branch, its loads
    gathered (a padding row is never read)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, B, B)
    src = tl.load(src_ptr + rm, mask=rm < M, other=-1).to(tl.int64)
    live = mask & (src[:, None] >= 0)
    x = tl.load(x_ptr + src[:, None] * K + rk[None, :], mask=live, other=0.0).to(tl.float32)
    if ROW:
        _block_1d_rows(x, rm, rk, mask, M, K, pid_k, rd_ptr, rs_ptr, FMT_MAX, EPS, POW2, OUT)
    if COL:
        live_t = (rk[:, None] < K) & (rm[None, :] < M) & (src[None, :] >= 0)
        xt = tl.load(x_ptr + rk[:, None] + src[None, :] * K, mask=live_t,
                     other=0.0).to(tl.float32)
        mask_t = (rk[:, None] < K) & (rm[None, :] < M)
        _block_1d_cols(xt, mask_t, rm, rk, M, K, pid_m, cd_ptr, cs_ptr, FMT_MAX, EPS, POW2, OUT)


@triton.jit
def _fp8_block_pair_kernel(x_ptr, Mx, Kx, xrd_ptr, xrs_ptr, xcd_ptr, xcs_ptr,
                           w_ptr, Mw, Kw, wrd_ptr, wrs_ptr, wcd_ptr, wcs_ptr,
                           FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                           X_2D: tl.constexpr, X_ROW: tl.constexpr, X_COL: tl.constexpr,
                           W_2D: tl.constexpr, W_ROW: tl.constexpr, W_COL: tl.constexpr,
                           OUT: tl.constexpr, B: tl.constexpr):
    """x's tiles, then W's, in one 1-D grid: the two launches of a layer's
    forward in one, each tile computed as :func:`_fp8_block_kernel` does."""
    in_x, pid_m, pid_k = _pair_tile(tl.program_id(0), Mx, Kx, Mw, Kw, B, B)
    if in_x:
        _fp8_block_tile(x_ptr, Mx, Kx, xrd_ptr, xrs_ptr, xcd_ptr, xcs_ptr, pid_m, pid_k,
                        FMT_MAX, EPS, POW2, X_2D, X_ROW, X_COL, OUT, B)
    else:
        _fp8_block_tile(w_ptr, Mw, Kw, wrd_ptr, wrs_ptr, wcd_ptr, wcs_ptr, pid_m, pid_k,
                        FMT_MAX, EPS, POW2, W_2D, W_ROW, W_COL, OUT, B)


@triton.jit
def _fp8_block_tile(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr, pid_m, pid_k,
                    FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                    TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                    OUT: tl.constexpr, B: tl.constexpr):
    """Tile (pid_m, pid_k) of one matrix: its copies and block scales."""
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, B, B)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    bits = _abs_bits(x)
    if TWO_D:  # scale rows padded with zeros to a multiple of 4 (reference.padded_blocks)
        a = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        s = _scale_from_amax(a, FMT_MAX, EPS, POW2)
        if ROW:
            _store_rows(rd_ptr, _cast_fp8(x, s, FMT_MAX, OUT), rm, rk, mask, K)
            _store_padded_scale(rs_ptr, pid_m, pid_k, tl.cdiv(K, B), _recip(s))
        if COL:
            xt, mask_t = _tile_t(x_ptr, M, K, pid_m, pid_k, B, B)
            _store_transposed(cd_ptr, xt, s, rm, rk, mask_t, M, FMT_MAX, OUT)
            _store_padded_scale(cs_ptr, pid_k, pid_m, tl.cdiv(M, B), _recip(s))
    else:
        if ROW:
            _block_1d_rows(x, rm, rk, mask, M, K, pid_k, rd_ptr, rs_ptr, FMT_MAX, EPS, POW2,
                           OUT)
        if COL:
            xt, mask_t = _tile_t(x_ptr, M, K, pid_m, pid_k, B, B)
            _block_1d_cols(xt, mask_t, rm, rk, M, K, pid_m, cd_ptr, cs_ptr, FMT_MAX, EPS, POW2,
                           OUT)


@triton.jit
def _block_1d_rows(x, rm, rk, mask, M, K, pid_k, rd_ptr, rs_ptr, FMT_MAX: tl.constexpr,
                   EPS: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr):
    """The rowwise copy of tile ``x``: blocks of 128 along K, one scale per row."""
    s = _scale_from_amax(tl.max(_abs_bits(x), axis=1).to(tl.float32, bitcast=True),
                         FMT_MAX, EPS, POW2)
    _store_rows(rd_ptr, _cast_fp8(x, s[:, None], FMT_MAX, OUT), rm, rk, mask, K)
    tl.store(rs_ptr + pid_k.to(tl.int64) * M + rm, _recip(s), mask=rm < M)


@triton.jit
def _block_1d_cols(xt, mask_t, rm, rk, M, K, pid_m, cd_ptr, cs_ptr, FMT_MAX: tl.constexpr,
                   EPS: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr):
    """The columnwise copy from the transposed tile ``xt``: blocks of 128
    along M, one scale per row of ``xt``."""
    s = _scale_from_amax(tl.max(_abs_bits(xt), axis=1).to(tl.float32, bitcast=True),
                         FMT_MAX, EPS, POW2)
    _store_transposed(cd_ptr, xt, s[:, None], rm, rk, mask_t, M, FMT_MAX, OUT)
    tl.store(cs_ptr + pid_m.to(tl.int64) * K + rk, _recip(s), mask=rk < K)


@triton.jit
def _store_padded_scale(s_ptr, row, col, ncols, value):
    """One 128x128 scale at (row, col) of a (rows, ncols padded to 4) buffer;
    the program of a row's last block also writes the row's padding zeros."""
    stride = (ncols + 3) // 4 * 4
    tl.store(s_ptr + row * stride + col, value)
    if col == ncols - 1:
        pad = ncols + tl.arange(0, 4)
        tl.store(s_ptr + row * stride + pad, tl.zeros((4,), tl.float32), mask=pad < stride)


# 4 warps per 128x128 tile: on an H200 1.3-1.5x faster than 8 for both copies of a large
# matrix and for x and W paired, one copy within 10% (docs/benchmarks.md)
_fp8_block_launch = Launcher(_fp8_block_kernel, num_warps=4)


def _block_outputs(x2d, fmt, block_2d, rowwise, columnwise, shape=None) -> dict:
    """The buffers the blockwise kernel writes for ``x2d`` (M, K), or for an
    (M, K) ``shape`` on ``x2d``'s device."""
    m, k = x2d.shape if shape is None else shape
    b = ref.FP8_BLOCK
    dt = ref.FP8_DTYPE[fmt]
    if block_2d:
        row_s, col_s = (m // b, ref.padded_blocks(k // b)), (k // b, ref.padded_blocks(m // b))
    else:
        row_s, col_s = (k // b, m), (m // b, k)
    return _alloc_copies(x2d, rowwise, columnwise, ((m, k), dt), (row_s, torch.float32),
                         ((k, m), dt), (col_s, torch.float32))


def fp8_block_call(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise):
    """The launch of ``quantize_fp8_blockwise`` on a contiguous, non-empty
    ``x2d``: ``(grid, key, args, out)``, ``out`` the buffers it writes (the
    native eager path fixes the same launch, kernels/native.py)."""
    m, k = x2d.shape
    b = ref.FP8_BLOCK
    out = _block_outputs(x2d, fmt, block_2d, rowwise, columnwise)
    flags = (fmt, float(eps), bool(pow2), bool(block_2d), bool(rowwise), bool(columnwise))
    args = (x2d, m, k, *_copy_args(out, x2d), ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], b)
    return (cdiv(m, b), cdiv(k, b)), (_x_key(x2d, m, k), flags), args, out


def fp8_block_pair_call(x2d, w2d, fmt, pow2, eps, x_flags, w_flags):
    """The launch of ``quantize_fp8_blockwise_pair`` on contiguous, non-empty
    matrices: ``(grid, key, args, out_x, out_w)``; each ``*_flags`` is
    ``(block_2d, rowwise, columnwise)``."""
    (mx, kx), (mw, kw) = x2d.shape, w2d.shape
    b = ref.FP8_BLOCK
    x_flags, w_flags = tuple(map(bool, x_flags)), tuple(map(bool, w_flags))
    out_x = _block_outputs(x2d, fmt, *x_flags)
    out_w = _block_outputs(w2d, fmt, *w_flags)
    flags = (fmt, float(eps), bool(pow2), *x_flags, *w_flags)
    args = (x2d, mx, kx, *_copy_args(out_x, x2d), w2d, mw, kw, *_copy_args(out_w, w2d),
            ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], b)
    grid = (_tiles(mx, kx, b, b) + _tiles(mw, kw, b, b),)
    return grid, (_x_key(x2d, mx, kx), _x_key(w2d, mw, kw), flags), args, out_x, out_w


def quantize_fp8_blockwise(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_fp8_blockwise(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise)
    grid, key, args, out = fp8_block_call(_matrix(x2d), fmt, block_2d, pow2, eps, rowwise,
                                          columnwise)
    _fp8_block_launch(grid, key, *args)
    return out


_fp8_block_pair_launch = Launcher(_fp8_block_pair_kernel, num_warps=4)
_fp8_block_rows_launch = Launcher(_fp8_block_rows_kernel, num_warps=4)


def quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, rowwise, columnwise) -> dict:
    """``reference.quantize_fp8_blockwise_rows`` in one launch: the gathered
    rows are never written out in high precision, and padding rows never read."""
    m, k = sources.shape[0], t.shape[1]
    if m == 0 or k == 0 or t.shape[0] == 0:
        return ref.quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, rowwise, columnwise)
    t, sources = _matrix(t), sources.contiguous()
    b = ref.FP8_BLOCK
    out = _block_outputs(t, fmt, False, rowwise, columnwise, shape=(m, k))
    flags = (fmt, float(eps), bool(pow2), bool(rowwise), bool(columnwise))
    args = (t, sources, m, k, *_copy_args(out, t), ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], b)
    key = (_x_key(t, t.shape[0], k), sources.dtype, ptr_key(sources), int_key(m), flags)
    _fp8_block_rows_launch((cdiv(m, b), cdiv(k, b)), key, *args)
    return out


def quantize_fp8_blockwise_pair(x2d, w2d, fmt, pow2, eps, x_flags, w_flags) -> tuple:
    """``reference.quantize_fp8_blockwise_pair`` (x's and W's buffers) in one launch."""
    if x2d.numel() == 0 or w2d.numel() == 0:
        return ref.quantize_fp8_blockwise_pair(x2d, w2d, fmt, pow2, eps, x_flags, w_flags)
    grid, key, args, out_x, out_w = fp8_block_pair_call(_matrix(x2d), _matrix(w2d), fmt, pow2,
                                                        eps, x_flags, w_flags)
    _fp8_block_pair_launch(grid, key, *args)
    return out_x, out_w


# -- MXFP8 -------------------------------------------------------------------------------
@triton.jit
def _mx_biased_exponent(bits, FRAC_MAX: tl.constexpr, EXP_MAX: tl.constexpr):
    """reference.mx_biased_exponent from the int32 bits of a block amax (>= 0)."""
    sub = bits < 0x00800000  # zero or subnormal: normalise by 2^64 first
    a = bits.to(tl.float32, bitcast=True)
    nb = tl.where(sub, a * 18446744073709551616.0, a).to(tl.int32, bitcast=True)
    exp = ((nb >> 23) & 0xFF) - 126 - tl.where(sub, 64, 0)  # frexp exponent
    e = exp - EXP_MAX + ((nb & 0x7FFFFF) > FRAC_MAX).to(tl.int32)
    e = tl.where(bits > 0, e, -127)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(bits < 0x7F800000, e + 127, 255)


@triton.jit
def _mx_inverse_scale(biased):
    """2^(127 - min(biased, 254)) in fp32 (2^-127 is subnormal)."""
    e = 127 - tl.minimum(biased, 254)
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, (tl.zeros_like(e) + 0x00400000).to(tl.float32, bitcast=True))


@triton.jit
def _e8m0_value(biased):
    """reference.e8m0_to_float: 2^(b - 127), NaN for 255 (2^-127 is subnormal)."""
    b = biased.to(tl.int32)
    v = tl.where(b == 0, tl.zeros_like(b) + 0x00400000, b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _mxfp8_kernel(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                  FMT_MAX: tl.constexpr, FRAC_MAX: tl.constexpr, EXP_MAX: tl.constexpr,
                  ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, MX: tl.constexpr):
    _mxfp8_tile(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr, tl.program_id(0), tl.program_id(1),
                FMT_MAX, FRAC_MAX, EXP_MAX, ROW, COL, OUT, BM, BK, MX)


@triton.jit
def _mxfp8_pair_kernel(x_ptr, Mx, Kx, xrd_ptr, xrs_ptr, xcd_ptr, xcs_ptr,
                       w_ptr, Mw, Kw, wrd_ptr, wrs_ptr, wcd_ptr, wcs_ptr,
                       FMT_MAX: tl.constexpr, FRAC_MAX: tl.constexpr, EXP_MAX: tl.constexpr,
                       X_ROW: tl.constexpr, X_COL: tl.constexpr, W_ROW: tl.constexpr,
                       W_COL: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr,
                       BK: tl.constexpr, MX: tl.constexpr):
    """x's tiles, then W's, in one 1-D grid (as :func:`_fp8_block_pair_kernel`)."""
    in_x, pid_m, pid_k = _pair_tile(tl.program_id(0), Mx, Kx, Mw, Kw, BM, BK)
    if in_x:
        _mxfp8_tile(x_ptr, Mx, Kx, xrd_ptr, xrs_ptr, xcd_ptr, xcs_ptr, pid_m, pid_k, FMT_MAX,
                    FRAC_MAX, EXP_MAX, X_ROW, X_COL, OUT, BM, BK, MX)
    else:
        _mxfp8_tile(w_ptr, Mw, Kw, wrd_ptr, wrs_ptr, wcd_ptr, wcs_ptr, pid_m, pid_k, FMT_MAX,
                    FRAC_MAX, EXP_MAX, W_ROW, W_COL, OUT, BM, BK, MX)


@triton.jit
def _mxfp8_tile(x_ptr, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr, pid_m, pid_k,
                FMT_MAX: tl.constexpr, FRAC_MAX: tl.constexpr, EXP_MAX: tl.constexpr,
                ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, MX: tl.constexpr):
    """Tile (pid_m, pid_k) of one matrix: its MXFP8 copies and scales."""
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    bits = _abs_bits(x)
    if ROW:  # blocks of MX along K
        biased = _mx_biased_exponent(tl.max(tl.reshape(bits, (BM, BK // MX, MX)), axis=2),
                                     FRAC_MAX, EXP_MAX)
        inv = tl.reshape(tl.broadcast_to(_mx_inverse_scale(biased)[:, :, None], (BM, BK // MX, MX)),
                         (BM, BK))
        _store_rows(rd_ptr, _cast_fp8(x, inv, FMT_MAX, OUT), rm, rk, mask, K)
        sk_idx = pid_k * (BK // MX) + tl.arange(0, BK // MX)
        tl.store(rs_ptr + rm[:, None].to(tl.int64) * (K // MX) + sk_idx[None, :],
                 biased.to(tl.uint8), mask=(rm[:, None] < M) & (sk_idx[None, :] < K // MX))
    if COL:  # blocks of MX along M, stored in the (M, K) orientation
        biased = _mx_biased_exponent(tl.max(tl.reshape(bits, (BM // MX, MX, BK)), axis=1),
                                     FRAC_MAX, EXP_MAX)
        inv = tl.reshape(tl.broadcast_to(_mx_inverse_scale(biased)[:, None, :], (BM // MX, MX, BK)),
                         (BM, BK))
        _store_rows(cd_ptr, _cast_fp8(x, inv, FMT_MAX, OUT), rm, rk, mask, K)
        sm_idx = pid_m * (BM // MX) + tl.arange(0, BM // MX)
        tl.store(cs_ptr + sm_idx[:, None].to(tl.int64) * K + rk[None, :],
                 biased.to(tl.uint8), mask=(sm_idx[:, None] < M // MX) & (rk[None, :] < K))


@triton.jit
def _mxfp8_dequantize_kernel(d_ptr, s_ptr, out_ptr, M, K, ROWWISE: tl.constexpr,
                             OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                             MX: tl.constexpr):
    """One MXFP8 copy in its (M, K) orientation times its block scales, in OUT."""
    _mxfp8_dequantize_tile(d_ptr, s_ptr, out_ptr, M, K, tl.program_id(0), tl.program_id(1),
                           ROWWISE, OUT, BM, BK, MX)


@triton.jit
def _mxfp8_dequantize_pair_kernel(a_ptr, as_ptr, a_out, Ma, Ka, b_ptr, bs_ptr, b_out, Mb, Kb,
                                  A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
                                  OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                  MX: tl.constexpr):
    """A GEMM's two operands dequantized in one 1-D grid, a's tiles first."""
    in_a, pid_m, pid_k = _pair_tile(tl.program_id(0), Ma, Ka, Mb, Kb, BM, BK)
    if in_a:
        _mxfp8_dequantize_tile(a_ptr, as_ptr, a_out, Ma, Ka, pid_m, pid_k, A_ROWWISE, OUT, BM,
                               BK, MX)
    else:
        _mxfp8_dequantize_tile(b_ptr, bs_ptr, b_out, Mb, Kb, pid_m, pid_k, B_ROWWISE, OUT, BM,
                               BK, MX)


@triton.jit
def _mxfp8_dequantize_tile(d_ptr, s_ptr, out_ptr, M, K, pid_m, pid_k, ROWWISE: tl.constexpr,
                           OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                           MX: tl.constexpr):
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
    d = _load_tile(d_ptr, rm, rk, mask, K)
    if ROWWISE:
        s_ptrs = s_ptr + rm[:, None].to(tl.int64) * (K // MX) + rk[None, :] // MX
    else:
        s_ptrs = s_ptr + (rm[:, None] // MX).to(tl.int64) * K + rk[None, :]
    scale = _e8m0_value(tl.load(s_ptrs, mask=mask, other=127))
    _store_rows(out_ptr, (d * scale).to(OUT), rm, rk, mask, K)


_MX_BM, _MX_BK = 64, 128
# 2 warps per 64x128 tile: 2.0-2.6x the speed of 8 on an H200
_mxfp8_launch = Launcher(_mxfp8_kernel, num_warps=2)
_mxfp8_pair_launch = Launcher(_mxfp8_pair_kernel, num_warps=2)
_mxfp8_dequantize_launch = Launcher(_mxfp8_dequantize_kernel)
_mxfp8_dequantize_pair_launch = Launcher(_mxfp8_dequantize_pair_kernel)
_TL_OUT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _mx_outputs(x2d, fmt, rowwise, columnwise) -> dict:
    """The buffers the MXFP8 kernel writes for ``x2d`` (M, K)."""
    m, k = x2d.shape
    b = ref.MX_BLOCK
    dt = ref.FP8_DTYPE[fmt]
    return _alloc_copies(x2d, rowwise, columnwise, ((m, k), dt),
                         ((m, k // b), torch.uint8), ((m, k), dt), ((m // b, k), torch.uint8))


def _mx_format_args(fmt) -> tuple:
    """FMT_MAX, FRAC_MAX, EXP_MAX of the MXFP8 kernels for ``fmt``."""
    max_frac, max_exp = math.frexp(ref.FP8_MAX[fmt])
    return ref.FP8_MAX[fmt], int((max_frac - 0.5) * 2 ** 24), max_exp


def mxfp8_call(x2d, fmt, rowwise, columnwise):
    """The launch of ``quantize_mxfp8`` on a contiguous, non-empty ``x2d``:
    ``(grid, key, args, out)`` (the native eager path fixes the same launch)."""
    m, k = x2d.shape
    out = _mx_outputs(x2d, fmt, rowwise, columnwise)
    flags = (fmt, bool(rowwise), bool(columnwise))
    args = (x2d, m, k, *_copy_args(out, x2d), *_mx_format_args(fmt), *flags[1:], _TL_FP8[fmt],
            _MX_BM, _MX_BK, ref.MX_BLOCK)
    return (cdiv(m, _MX_BM), cdiv(k, _MX_BK)), (_x_key(x2d, m, k), flags), args, out


def quantize_mxfp8_pair(x2d, w2d, fmt, x_usage, w_usage) -> tuple:
    """``reference.quantize_mxfp8_pair`` in one launch."""
    if x2d.numel() == 0 or w2d.numel() == 0:
        return ref.quantize_mxfp8_pair(x2d, w2d, fmt, x_usage, w_usage)
    x2d, w2d = _matrix(x2d), _matrix(w2d)
    (mx, kx), (mw, kw) = x2d.shape, w2d.shape
    x_usage, w_usage = tuple(map(bool, x_usage)), tuple(map(bool, w_usage))
    out_x, out_w = _mx_outputs(x2d, fmt, *x_usage), _mx_outputs(w2d, fmt, *w_usage)
    args = (x2d, mx, kx, *_copy_args(out_x, x2d), w2d, mw, kw, *_copy_args(out_w, w2d),
            *_mx_format_args(fmt), *x_usage, *w_usage, _TL_FP8[fmt], _MX_BM, _MX_BK,
            ref.MX_BLOCK)
    grid = (_tiles(mx, kx, _MX_BM, _MX_BK) + _tiles(mw, kw, _MX_BM, _MX_BK),)
    _mxfp8_pair_launch(grid, (_x_key(x2d, mx, kx), _x_key(w2d, mw, kw), fmt, x_usage, w_usage),
                       *args)
    return out_x, out_w


def quantize_mxfp8(x2d, fmt, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_mxfp8(x2d, fmt, rowwise, columnwise)
    grid, key, args, out = mxfp8_call(_matrix(x2d), fmt, rowwise, columnwise)
    _mxfp8_launch(grid, key, *args)
    return out


def mxfp8_dequantize_call(data2d, biased, rowwise: bool, out_dtype):
    """The launch of ``dequantize_mxfp8`` on contiguous, non-empty operands:
    ``(grid, key, args, out)``."""
    m, k = data2d.shape
    out = torch.empty((m, k), dtype=out_dtype, device=data2d.device)
    args = (data2d, biased, out, m, k, bool(rowwise), _TL_OUT[out_dtype], _MX_BM, _MX_BK,
            ref.MX_BLOCK)
    key = (_x_key(data2d, m, k), ptr_key(biased), bool(rowwise), out_dtype)
    return (cdiv(m, _MX_BM), cdiv(k, _MX_BK)), key, args, out


def dequantize_mxfp8(data2d, biased, rowwise: bool, out_dtype=torch.float32) -> torch.Tensor:
    """reference.dequantize_mxfp8 (then ``.to(out_dtype)``) in one pass."""
    if data2d.numel() == 0 or out_dtype not in _TL_OUT:
        return ref.dequantize_mxfp8(data2d, biased, rowwise).to(out_dtype)
    grid, key, args, out = mxfp8_dequantize_call(_matrix(data2d), _matrix(biased), rowwise,
                                                 out_dtype)
    _mxfp8_dequantize_launch(grid, key, *args)
    return out


def dequantize_mxfp8_pair(a_data, a_scale, a_rowwise: bool, b_data, b_scale, b_rowwise: bool,
                          out_dtype) -> tuple:
    """``reference.dequantize_mxfp8_pair``: a GEMM's two operands in one launch."""
    if a_data.numel() == 0 or b_data.numel() == 0 or out_dtype not in _TL_OUT:
        return ref.dequantize_mxfp8_pair(a_data, a_scale, a_rowwise, b_data, b_scale, b_rowwise,
                                         out_dtype)
    a_data, a_scale, b_data, b_scale = map(_matrix, (a_data, a_scale, b_data, b_scale))
    (ma, ka), (mb, kb) = a_data.shape, b_data.shape
    a_out, b_out = native.empty_many(a_data, ((ma, ka), out_dtype), ((mb, kb), out_dtype))
    args = (a_data, a_scale, a_out, ma, ka, b_data, b_scale, b_out, mb, kb, bool(a_rowwise),
            bool(b_rowwise), _TL_OUT[out_dtype], _MX_BM, _MX_BK, ref.MX_BLOCK)
    key = (_x_key(a_data, ma, ka), ptr_key(a_scale), _x_key(b_data, mb, kb), ptr_key(b_scale),
           bool(a_rowwise), bool(b_rowwise), out_dtype)
    grid = (_tiles(ma, ka, _MX_BM, _MX_BK) + _tiles(mb, kb, _MX_BM, _MX_BK),)
    _mxfp8_dequantize_pair_launch(grid, key, *args)
    return a_out, b_out
