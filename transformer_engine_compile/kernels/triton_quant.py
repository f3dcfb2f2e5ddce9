"""Fused quantization kernels for CUDA, in Triton.

Each wrapper has the signature of the same-named function in
``kernels.reference`` and returns bit-identical buffers (tests/gpu check this
on random and special values).  What is fused:

* FP8 per-tensor: one amax pass (atomic max over the bits of ``|x|``), then
  one pass that computes the scale on the device from that amax and writes
  the rowwise copy, the transposed copy and ``scale_inv`` together.
* FP8 blockwise (1x128 and 128x128) and MXFP8 (1x32 / 32x1): one pass over
  the tiles that writes both copies and their block scales.
The transposed copy re-reads its tile transposed (from cache) instead of
transposing in registers; see ``_tile_t``.

Nothing here reads a value back to the host, so the kernels can be captured
in a CUDA graph.  Block maxima reduce the int32 bits of ``|x|``: for
non-negative floats integer order is float order, with NaN above Inf, so a
NaN in a block propagates like ``torch.amax`` does (Triton's float max would
drop it).  Divisions use ``div_rn`` (IEEE, as torch's) and the scale is
``reciprocal(amax) * fmt_max``, the two roundings of the reference's
``fmt_max / amax`` on a tensor.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import reference as ref

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_FP32_MAX = tl.constexpr(ref.FP32_MAX)


# -- device helpers ---------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    """int32 bits of |x| as fp32: ordered like the floats, NaN above Inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _recip(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _scale_from_amax(a, FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """reference.compute_scale (margin 0) after the optional amax epsilon."""
    if EPS > 0:
        a = tl.maximum(a, EPS, propagate_nan=tl.PropagateNan.ALL)
    s = _recip(a) * FMT_MAX
    s = tl.where(s == float("inf"), _FP32_MAX, s)
    finite = (a == a) & (a != float("inf"))
    s = tl.where((a > 0) & finite, s, 1.0)
    if POW2:  # frexp/ldexp rounding down to 2^n == clearing the mantissa
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _cast_fp8(x, s, FMT_MAX: tl.constexpr, OUT: tl.constexpr):
    """reference.cast_fp8: saturate x * s, ±Inf inputs become NaN."""
    xf = x.to(tl.float32)
    y = tl.clamp(xf * s, -FMT_MAX, FMT_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = tl.where((xf == float("inf")) | (xf == float("-inf")), float("nan"), y)
    return y.to(OUT)


@triton.jit
def _tile(x_ptr, sm, sk, M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    ptrs = x_ptr + rm[:, None].to(tl.int64) * sm + rk[None, :].to(tl.int64) * sk
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), rm, rk, mask


@triton.jit
def _store_rows(ptr, y, rm, rk, mask, K):
    tl.store(ptr + rm[:, None].to(tl.int64) * K + rk[None, :], y, mask=mask)


@triton.jit
def _tile_t(x_ptr, sm, sk, M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """The transpose (BK, BM) of the tile ``_tile`` loads, read from memory
    again (the bytes are in cache): no in-register transpose.  tl.trans of a
    tile that is also stored rowwise gave wrong rows on sm_90 (Triton 3.6)."""
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask_t = (rk[:, None] < K) & (rm[None, :] < M)
    ptrs = x_ptr + rk[:, None].to(tl.int64) * sk + rm[None, :].to(tl.int64) * sm
    return tl.load(ptrs, mask=mask_t, other=0.0).to(tl.float32), mask_t


@triton.jit
def _store_transposed(ptr, xt, st, rm, rk, mask_t, M, FMT_MAX: tl.constexpr, OUT: tl.constexpr):
    """Cast the transposed tile ``xt`` (BK, BM) with scale ``st`` into the (K, M) matrix."""
    tl.store(ptr + rk[:, None].to(tl.int64) * M + rm[None, :], _cast_fp8(xt, st, FMT_MAX, OUT),
             mask=mask_t)


_COPY_BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _alloc_copies(device, rowwise, columnwise, row_data, row_scale, col_data, col_scale) -> dict:
    """Output buffers of a two-copy format; each spec is (shape, dtype)."""
    specs = zip(_COPY_BUFFERS, (row_data, row_scale, col_data, col_scale))
    return {name: torch.empty(shape, dtype=dt, device=device) for name, (shape, dt) in specs
            if (rowwise if name.startswith("row") else columnwise)}


def _copy_args(out: dict) -> tuple:
    """The four buffer arguments of a two-copy kernel.  An absent copy's slot
    gets some present buffer: ROW / COL are constexpr, so it is never touched."""
    first = next(iter(out.values()))
    return tuple(out.get(name, first) for name in _COPY_BUFFERS)


# -- FP8 per-tensor ------------------------------------------------------------------
@triton.jit
def _amax_kernel(x_ptr, sm, sk, M, K, out_ptr, BM: tl.constexpr, BK: tl.constexpr):
    x, _, _, _ = _tile(x_ptr, sm, sk, M, K, tl.program_id(0), tl.program_id(1), BM, BK)
    tl.atomic_max(out_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))


@triton.jit
def _fp8_tensorwise_kernel(x_ptr, sm, sk, M, K, amax_ptr, scale_ptr, data_ptr, t_ptr, sinv_ptr,
                           FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                           FROM_AMAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                           OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    if FROM_AMAX:
        s = _scale_from_amax(tl.load(amax_ptr).to(tl.float32, bitcast=True), FMT_MAX, EPS, POW2)
    else:
        s = tl.load(scale_ptr).to(tl.float32)
    x, rm, rk, mask = _tile(x_ptr, sm, sk, M, K, pid_m, pid_k, BM, BK)
    if ROW:
        _store_rows(data_ptr, _cast_fp8(x, s, FMT_MAX, OUT), rm, rk, mask, K)
    if COL:
        xt, mask_t = _tile_t(x_ptr, sm, sk, M, K, pid_m, pid_k, BM, BK)
        _store_transposed(t_ptr, xt, s, rm, rk, mask_t, M, FMT_MAX, OUT)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(sinv_ptr, _recip(s))


_TW_BM, _TW_BK = 64, 128
_AMAX_BM, _AMAX_BK = 64, 256


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor, like reference.amax."""
    if x.numel() == 0 or x.dim() == 0:
        return ref.amax(x)
    return _amax_bits(x.detach().reshape(-1, x.shape[-1])).view(torch.float32).reshape(())


def _amax_bits(x2d: torch.Tensor) -> torch.Tensor:
    m, k = x2d.shape
    out = torch.zeros(1, dtype=torch.int32, device=x2d.device)
    grid = (triton.cdiv(m, _AMAX_BM), triton.cdiv(k, _AMAX_BK))
    _amax_kernel[grid](x2d, x2d.stride(0), x2d.stride(1), m, k, out,
                       BM=_AMAX_BM, BK=_AMAX_BK, num_warps=8)
    return out


def _fp8_tensorwise(x2d, fmt, rowwise, columnwise, *, amax_bits=None, scale=None,
                    pow2=False, eps=0.0) -> dict:
    m, k = x2d.shape
    dt = ref.FP8_DTYPE[fmt]
    dev = x2d.device
    out = {"scale_inv": torch.empty(1, dtype=torch.float32, device=dev)}
    data = torch.empty((m, k), dtype=dt, device=dev) if rowwise else None
    trans = torch.empty((k, m), dtype=dt, device=dev) if columnwise else None
    grid = (triton.cdiv(m, _TW_BM), triton.cdiv(k, _TW_BK))
    _fp8_tensorwise_kernel[grid](
        x2d, x2d.stride(0), x2d.stride(1), m, k, amax_bits, scale,
        data if rowwise else out["scale_inv"], trans if columnwise else out["scale_inv"],
        out["scale_inv"], FMT_MAX=ref.FP8_MAX[fmt], EPS=float(eps), POW2=bool(pow2),
        FROM_AMAX=amax_bits is not None, ROW=bool(rowwise), COL=bool(columnwise),
        OUT=_TL_FP8[fmt], BM=_TW_BM, BK=_TW_BK, num_warps=8)
    if rowwise:
        out["data"] = data
    if columnwise:
        out["transpose"] = trans
    return out


def quantize_fp8_tensorwise(x2d, scale, fmt, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_fp8_tensorwise(x2d, scale, fmt, rowwise, columnwise)
    return _fp8_tensorwise(x2d, fmt, rowwise, columnwise, scale=scale.reshape(1).float())


def quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise)
    return _fp8_tensorwise(x2d, fmt, rowwise, columnwise, amax_bits=_amax_bits(x2d),
                           pow2=pow2, eps=eps)


# -- FP8 blockwise ---------------------------------------------------------------------
@triton.jit
def _fp8_block_kernel(x_ptr, sm, sk, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                      FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                      TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                      OUT: tl.constexpr, B: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    x, rm, rk, mask = _tile(x_ptr, sm, sk, M, K, pid_m, pid_k, B, B)
    bits = _abs_bits(x)
    nkb = tl.cdiv(K, B)
    if TWO_D:
        a = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        s = _scale_from_amax(a, FMT_MAX, EPS, POW2)
        if ROW:
            _store_rows(rd_ptr, _cast_fp8(x, s, FMT_MAX, OUT), rm, rk, mask, K)
            tl.store(rs_ptr + pid_m * nkb + pid_k, _recip(s))
        if COL:
            xt, mask_t = _tile_t(x_ptr, sm, sk, M, K, pid_m, pid_k, B, B)
            _store_transposed(cd_ptr, xt, s, rm, rk, mask_t, M, FMT_MAX, OUT)
            tl.store(cs_ptr + pid_k * tl.cdiv(M, B) + pid_m, _recip(s))
    else:
        if ROW:  # blocks of 128 along K: one scale per row of the tile
            s = _scale_from_amax(tl.max(bits, axis=1).to(tl.float32, bitcast=True),
                                 FMT_MAX, EPS, POW2)
            _store_rows(rd_ptr, _cast_fp8(x, s[:, None], FMT_MAX, OUT), rm, rk, mask, K)
            tl.store(rs_ptr + rm.to(tl.int64) * nkb + pid_k, _recip(s), mask=rm < M)
        if COL:  # blocks of 128 along M: one scale per row of the transposed tile
            xt, mask_t = _tile_t(x_ptr, sm, sk, M, K, pid_m, pid_k, B, B)
            s = _scale_from_amax(tl.max(_abs_bits(xt), axis=1).to(tl.float32, bitcast=True),
                                 FMT_MAX, EPS, POW2)
            _store_transposed(cd_ptr, xt, s[:, None], rm, rk, mask_t, M, FMT_MAX, OUT)
            tl.store(cs_ptr + rk.to(tl.int64) * tl.cdiv(M, B) + pid_m, _recip(s), mask=rk < K)


def quantize_fp8_blockwise(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_fp8_blockwise(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise)
    m, k = x2d.shape
    b = ref.FP8_BLOCK
    dt = ref.FP8_DTYPE[fmt]
    row_s, col_s = ((m // b, k // b), (k // b, m // b)) if block_2d else ((m, k // b), (k, m // b))
    out = _alloc_copies(x2d.device, rowwise, columnwise, ((m, k), dt), (row_s, torch.float32),
                        ((k, m), dt), (col_s, torch.float32))
    grid = (triton.cdiv(m, b), triton.cdiv(k, b))
    _fp8_block_kernel[grid](
        x2d, x2d.stride(0), x2d.stride(1), m, k, *_copy_args(out),
        FMT_MAX=ref.FP8_MAX[fmt], EPS=float(eps), POW2=bool(pow2), TWO_D=bool(block_2d),
        ROW=bool(rowwise), COL=bool(columnwise), OUT=_TL_FP8[fmt], B=b, num_warps=8)
    return out


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
def _mxfp8_kernel(x_ptr, sm, sk, M, K, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                  FMT_MAX: tl.constexpr, FRAC_MAX: tl.constexpr, EXP_MAX: tl.constexpr,
                  ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, MX: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    x, rm, rk, mask = _tile(x_ptr, sm, sk, M, K, pid_m, pid_k, BM, BK)
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


_MX_BM, _MX_BK = 64, 128


def quantize_mxfp8(x2d, fmt, rowwise, columnwise) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_mxfp8(x2d, fmt, rowwise, columnwise)
    m, k = x2d.shape
    b = ref.MX_BLOCK
    dt = ref.FP8_DTYPE[fmt]
    out = _alloc_copies(x2d.device, rowwise, columnwise, ((m, k), dt), ((m, k // b), torch.uint8),
                        ((m, k), dt), ((m // b, k), torch.uint8))
    max_frac, max_exp = math.frexp(ref.FP8_MAX[fmt])
    grid = (triton.cdiv(m, _MX_BM), triton.cdiv(k, _MX_BK))
    _mxfp8_kernel[grid](
        x2d, x2d.stride(0), x2d.stride(1), m, k, *_copy_args(out),
        FMT_MAX=ref.FP8_MAX[fmt], FRAC_MAX=int((max_frac - 0.5) * 2 ** 24), EXP_MAX=max_exp,
        ROW=bool(rowwise), COL=bool(columnwise), OUT=_TL_FP8[fmt],
        BM=_MX_BM, BK=_MX_BK, MX=b, num_warps=8)
    return out
