"""NVFP4 in Triton: ``quantize_nvfp4`` with the signature of
``reference.quantize_nvfp4``, returning bit-identical buffers, and the
emulated GEMM's operand and epilogue kernels.

Quantization: one launch for calls of up to ``_ONE_LAUNCH_MAX`` elements
(x and W of a layer together: ``quantize_nvfp4_pair``), whose programs share
a ``grid_state`` counter slot, take the amax pass's tiles, wait for all of
them and then quantize (``triton_current``'s protocol); else, and where no
slot may be used (CUDA-graph capture, AOTInductor), two launches per tensor.
Stochastic rounding adds its uniform draws from ``torch.rand`` in the
reference's order (rowwise copy first, then x before W), so both paths round
alike under one seed.  The two launches:

* an amax pass: each of at most 256 programs writes the max |x| bits of its
  tiles, and with the RHT the max of the transformed transpose, to a
  partials buffer (no zero fill, no atomics);
* a quantize pass over (32, 64) tiles that reduces the partials, computes
  the global scale on the device and writes both copies (data, E4M3 block
  scales, amax).  The columnwise copy re-reads its tile transposed from
  memory (see ``triton_quant._tile_t``).

For the emulated GEMM (quantization/cuda_gemm.py), ``dequantize_nvfp4_blocks``
writes a copy's values times their block scales in bf16 (exact) and
``nvfp4_gemm_epilogue`` divides the fp32 product by both per-tensor scales
and adds the bias, one pass each.

The RHT is the reference's butterfly (``reference._fwht16``) in the same
order of fp32 operations, so it matches bit for bit.  Nothing reads a value
back to the host (CUDA-graph capture works).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import grid_state, native, triton_launch
from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, ptr_key
from .triton_current import _arrive_and_wait, _leave, _pair_tiles, _slot_ptr
from .triton_quant import (_abs_bits, _load_tile, _matrix, _pair_tile, _scale_from_amax,
                           _store_rows, _tile_index, _unused, _x_key)

_RHT_NEG = tl.constexpr(ref.RHT_NEGATIVE)
_INV_E2M1_MAX = tl.constexpr(1.0 / ref.E2M1_MAX)  # rounded to fp32 where used, as in torch
_GLOBAL_MAX = tl.constexpr(ref.E2M1_MAX * ref.E4M3_MAX)


# -- device helpers ---------------------------------------------------------------
# The columnwise copy quantizes runs of 16 along M, a strided axis of x.  Its
# tile is read as 16 (BK, BM // 16) tensors, tensor j holding m = 16 g + j
# (each read is coalesced along K), so the RHT butterfly is elementwise, and
# _join16 stacks them into a (BK, BM // 16, 16) tile whose runs of 16 sit in
# one thread's registers: no data moves between threads.
@triton.jit
def _load16(ptr, base, step, mask):
    """16 fp32 tensors: ``ptr[base + j * step]`` for j = 0..15 (0 where not mask)."""
    t = ()
    for j in tl.static_range(16):
        t = t + (tl.load(ptr + base + j * step, mask=mask, other=0.0).to(tl.float32),)
    return t


@triton.jit
def _join16(t):
    """Stack 16 (R, G) tensors into one (R, G, 16), tensor j at [:, :, j]."""
    for level in tl.static_range(4):  # join(t[j], t[j + n]), n = 8, 4, 2, 1: last dim = bit n
        u = ()
        for j in tl.static_range(8 >> level):
            u = u + (tl.join(t[j], t[j + (8 >> level)]),)
        t = u
    x = t[0]
    return tl.reshape(x, (x.shape[0], x.shape[1], 16))


@triton.jit
def _rht16(t):
    """reference.apply_rht of the 16 tensors t (element j of each run in
    t[j]): signs, the butterfly stages of reference._fwht16 in its order
    (stride h: (t[i], t[i + h]) -> (t[i] + t[i + h], t[i] - t[i + h])), then /4 (exact)."""
    u = ()
    for j in tl.static_range(16):
        if (_RHT_NEG >> j) & 1:
            u = u + (-t[j],)
        else:
            u = u + (t[j],)
    t = u
    for stage in tl.static_range(4):  # stride h = 1 << stage
        u = ()
        for i in tl.static_range(16):
            if i & (1 << stage):
                u = u + (t[i - (1 << stage)] - t[i],)
            else:
                u = u + (t[i] + t[i + (1 << stage)],)
        t = u
    u = ()
    for j in tl.static_range(16):
        u = u + (t[j] * 0.25,)
    return u


@triton.jit
def _max16_bits(t):
    """Elementwise max of the |x| bits of 16 tensors."""
    m = _abs_bits(t[0])
    for j in tl.static_range(1, 16):
        m = tl.maximum(m, _abs_bits(t[j]))
    return m


@triton.jit
def _e2m1_value(code):
    """reference._e2m1_magnitude of int32 codes 0..7."""
    e = code >> 1
    m = (code & 1).to(tl.float32)
    return tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * ((e + 126) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_codes(v, r, SR: tl.constexpr):
    """reference.round_to_e2m1: 4-bit codes (sign in bit 3) of v, to nearest
    even, or (SR) up with probability p when the uniform draw r < p."""
    a = tl.abs(v)
    a = tl.minimum(tl.where(a != a, 0.0, a), 6.0)
    if SR:
        lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
              + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
              + (a >= 6.0).to(tl.int32))
        base = _e2m1_value(lo)
        gap = _e2m1_value(tl.minimum(lo + 1, 7)) - base
        p = tl.where(gap > 0, tl.math.div_rn(a - base, tl.where(gap > 0, gap, 1.0)), 0.0)
        code = lo + (r < p).to(tl.int32)
    else:
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
    return code + tl.where(v < 0, 8, 0)


@triton.jit
def _quantize_tile(x, g, r, TWO_D: tl.constexpr, SR: tl.constexpr, R: tl.constexpr,
                   G: tl.constexpr):
    """reference._nvfp4_rows on the fp32 (R, G, 16) tile x (runs of 16 along
    its rows) with global scale g: packed codes (R, G * 8) uint8 and E4M3
    block scales (R, G)."""
    bmax = tl.max(_abs_bits(x), axis=2)
    if TWO_D:  # 16x16 tiles; each row of a tile repeats its scale
        t = tl.max(tl.reshape(bmax, (R // 16, 16, G)), axis=1)
        bmax = tl.reshape(tl.broadcast_to(t[:, None, :], (R // 16, 16, G)), (R, G))
    s = bmax.to(tl.float32, bitcast=True) * _INV_E2M1_MAX * g
    s = tl.where((s == s) & (s != float("inf")), tl.minimum(s, 448.0), float("nan"))
    s_q = s.to(tl.float8e4nv)
    s_f = s_q.to(tl.float32)
    enc = tl.where(s_f > 0, tl.math.div_rn(tl.zeros_like(s_f) + g, tl.where(s_f > 0, s_f, 1.0)),
                   0.0)
    lo, hi = tl.split(tl.reshape(_e2m1_codes(x * enc[:, :, None], r, SR), (R, G, 8, 2)))
    return tl.reshape((lo | (hi << 4)).to(tl.uint8), (R, G * 8)), s_q


@triton.jit
def _parts_amax(part_ptr, n, NP: tl.constexpr):
    """The fp32 amax from n partial maxima (int32 bits of |x|)."""
    parts = tl.load(part_ptr + tl.arange(0, NP), mask=tl.arange(0, NP) < n, other=0)
    return tl.max(parts, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _store_copy(d_ptr, s_ptr, data, scale, rows, g0, R_ALL, C_ALL, R: tl.constexpr,
                G: tl.constexpr):
    """Store a quantized tile (rows ``rows``, blocks g0 .. g0 + G - 1) into a
    copy of R_ALL rows and C_ALL columns (before packing)."""
    cd = g0 * 8 + tl.arange(0, G * 8)
    cs = g0 + tl.arange(0, G)
    r = rows[:, None].to(tl.int64)
    ok = rows[:, None] < R_ALL
    tl.store(d_ptr + r * (C_ALL // 2) + cd[None, :], data, mask=ok & (cd[None, :] < C_ALL // 2))
    tl.store(s_ptr + r * (C_ALL // 16) + cs[None, :], scale, mask=ok & (cs[None, :] < C_ALL // 16))


@triton.jit
def _col_offsets(M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """Rows k, run indices g and mask of the columnwise (BK, BM // 16) tile,
    and the offsets of x[16 g, k] (step K to element j of each run)."""
    rk = pid_k * BK + tl.arange(0, BK)
    rg = pid_m * (BM // 16) + tl.arange(0, BM // 16)
    mask = (rk[:, None] < K) & (rg[None, :] < M // 16)
    return rk, rg, mask, (rg[None, :] * 16).to(tl.int64) * K + rk[:, None]


# -- kernels --------------------------------------------------------------------------
@triton.jit
def _nvfp4_amax_kernel(x_ptr, M, K, part_ptr, P, X_AMAX: tl.constexpr, RHT_AMAX: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """Program p of P: max |x| bits of tiles p, p + P, ... to part_ptr[p]
    (X_AMAX) and of their RHT-transformed transposes to part_ptr[P + p]."""
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BK)
    n = tl.cdiv(tl.cdiv(M, BM) * n_k, P)
    if RHT_AMAX:
        acc_x = tl.zeros((BK, BM // 16), dtype=tl.int32)
        acc_h = tl.zeros((BK, BM // 16), dtype=tl.int32)
        for i in range(0, n):
            t = pid + i * P  # past the last tile: rows beyond M, a masked (zero) tile
            _, _, mask, offs = _col_offsets(M, K, t // n_k, t % n_k, BM, BK)
            xs = _load16(x_ptr, offs, K, mask)
            if X_AMAX:
                acc_x = tl.maximum(acc_x, _max16_bits(xs))
            acc_h = tl.maximum(acc_h, _max16_bits(_rht16(xs)))
        tl.store(part_ptr + P + pid, tl.max(tl.max(acc_h, axis=1), axis=0))
    else:
        acc_x = tl.zeros((BM, BK), dtype=tl.int32)
        for i in range(0, n):
            t = pid + i * P
            rm, rk, mask = _tile_index(M, K, t // n_k, t % n_k, BM, BK)
            x = _load_tile(x_ptr, rm, rk, mask, K)
            acc_x = tl.maximum(acc_x, _abs_bits(x))
    if X_AMAX:
        tl.store(part_ptr + pid, tl.max(tl.max(acc_x, axis=1), axis=0))


@triton.jit
def _nvfp4_kernel(x_ptr, M, K, part_ptr, n_parts, rr_ptr, rc_ptr,
                  rd_ptr, rs_ptr, ra_ptr, cd_ptr, cs_ptr, ca_ptr,
                  TWO_D: tl.constexpr, RHT: tl.constexpr, SR: tl.constexpr,
                  ROW: tl.constexpr, COL: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr):
    """Both copies of one (BM, BK) tile (:func:`_nvfp4_tile`), the amaxes
    from the partial maxima at part_ptr: the x maxima, and with the RHT the
    transformed transposes' at part_ptr + n_parts."""
    a_row = 0.0
    a_col = 0.0
    if ROW:
        a_row = _parts_amax(part_ptr, n_parts, NP)
    if COL:
        if RHT:
            a_col = _parts_amax(part_ptr + n_parts, n_parts, NP)
        else:
            a_col = _parts_amax(part_ptr, n_parts, NP)
    _nvfp4_tile(x_ptr, M, K, tl.program_id(0), tl.program_id(1), a_row, a_col, rr_ptr, rc_ptr,
                rd_ptr, rs_ptr, ra_ptr, cd_ptr, cs_ptr, ca_ptr, TWO_D, RHT, SR, ROW, COL, BM, BK)


@triton.jit
def _nvfp4_tile(x_ptr, M, K, pid_m, pid_k, a_row, a_col, rr_ptr, rc_ptr,
                rd_ptr, rs_ptr, ra_ptr, cd_ptr, cs_ptr, ca_ptr,
                TWO_D: tl.constexpr, RHT: tl.constexpr, SR: tl.constexpr,
                ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Both copies of tile (pid_m, pid_k): rowwise (M, K) with amax a_row,
    columnwise (K, M) with amax a_col (of the RHT-transformed transpose
    where RHT); rr/rc: uniform draws (M, K) / (K, M) when SR.  Tile (0, 0)
    also stores the amaxes."""
    first = (pid_m == 0) & (pid_k == 0)
    if ROW:
        rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
        x = _load_tile(x_ptr, rm, rk, mask, K)
        r = x
        if SR:
            r = tl.load(rr_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=1.0)
        data, scale = _quantize_tile(tl.reshape(x, (BM, BK // 16, 16)),
                                     _scale_from_amax(a_row, _GLOBAL_MAX, 0.0, False),
                                     tl.reshape(r, (BM, BK // 16, 16)), TWO_D, SR, BM, BK // 16)
        _store_copy(rd_ptr, rs_ptr, data, scale, rm, pid_k * (BK // 16), M, K, BM, BK // 16)
        if first:
            tl.store(ra_ptr, a_row)
    if COL:
        rk, rg, mask, offs = _col_offsets(M, K, pid_m, pid_k, BM, BK)
        xs = _load16(x_ptr, offs, K, mask)
        if RHT:
            xs = _rht16(xs)
        xt = _join16(xs)
        r = xt
        if SR:  # draws (K, M), read along M (coalesced) and moved to xt's layout
            offs = (rk[:, None].to(tl.int64) * M + rg[None, :] * 16)[:, :, None] + tl.arange(0, 16)
            r = tl.load(rc_ptr + offs, mask=mask[:, :, None], other=1.0)
        data, scale = _quantize_tile(xt, _scale_from_amax(a_col, _GLOBAL_MAX, 0.0, False), r,
                                     TWO_D, SR, BK, BM // 16)
        _store_copy(cd_ptr, cs_ptr, data, scale, rk, pid_m * (BM // 16), K, M, BK, BM // 16)
        if first:
            tl.store(ca_ptr, a_col)


@triton.jit
def _amax_tile_bits(x_ptr, M, K, t, n_k, X_AMAX: tl.constexpr, RHT_AMAX: tl.constexpr,
                    BM: tl.constexpr, BK: tl.constexpr):
    """Max |x| bits of amax tile t (row-major over the (M, K) grid of (BM, BK)
    tiles; X_AMAX) and of its RHT-transformed transpose (RHT_AMAX); 0 where
    not asked."""
    mx = tl.zeros((), dtype=tl.int32)
    mh = tl.zeros((), dtype=tl.int32)
    if RHT_AMAX:
        _, _, mask, offs = _col_offsets(M, K, t // n_k, t % n_k, BM, BK)
        xs = _load16(x_ptr, offs, K, mask)
        if X_AMAX:
            mx = tl.max(tl.max(_max16_bits(xs), axis=1), axis=0)
        mh = tl.max(tl.max(_max16_bits(_rht16(xs)), axis=1), axis=0)
    else:
        rm, rk, mask = _tile_index(M, K, t // n_k, t % n_k, BM, BK)
        mx = tl.max(tl.max(_abs_bits(_load_tile(x_ptr, rm, rk, mask, K)), axis=1), axis=0)
    return mx, mh


@triton.jit
def _nvfp4_one_kernel(a_ptr, Ma, Ka, a_rr, a_rc, a_rd, a_rs, a_ra, a_cd, a_cs, a_ca,
                      b_ptr, Mb, Kb, b_rr, b_rc, b_rd, b_rs, b_ra, b_cd, b_cs, b_ca, lo, hi,
                      A_TWO_D: tl.constexpr, A_RHT: tl.constexpr, A_SR: tl.constexpr,
                      A_ROW: tl.constexpr, A_COL: tl.constexpr, A_X_AMAX: tl.constexpr,
                      A_RHT_AMAX: tl.constexpr, B_TWO_D: tl.constexpr, B_RHT: tl.constexpr,
                      B_SR: tl.constexpr, B_ROW: tl.constexpr, B_COL: tl.constexpr,
                      B_X_AMAX: tl.constexpr, B_RHT_AMAX: tl.constexpr, HAS_B: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, ABM: tl.constexpr, ABK: tl.constexpr):
    """The amax pass and the quantize pass of a (and b) in one launch, with
    the zeroed counters of slot (lo, hi) (``triton_current``'s protocol:
    programs claim (ABM, ABK) amax tiles, a's then b's, raise [64] / [65]
    (a's x and RHT maxima) and [66] / [67] (b's), wait for every tile, then
    quantize (BM, BK) tiles, a's then b's, striding by the grid)."""
    slot = _slot_ptr(lo, hi)
    nka, ta, nkb, total = _pair_tiles(Ma, Ka, Mb, Kb, HAS_B, ABM, ABK)
    ax = tl.zeros((), dtype=tl.int32)
    ah = tl.zeros((), dtype=tl.int32)
    bx = tl.zeros((), dtype=tl.int32)
    bh = tl.zeros((), dtype=tl.int32)
    done = 0
    t = tl.atomic_add(slot, 1, sem="relaxed")
    while t < total:
        after = tl.atomic_add(slot, 1, sem="relaxed")  # claimed while tile t loads
        if t < ta:
            mx, mh = _amax_tile_bits(a_ptr, Ma, Ka, t, nka, A_X_AMAX, A_RHT_AMAX, ABM, ABK)
            ax = tl.maximum(ax, mx)
            ah = tl.maximum(ah, mh)
        else:
            if HAS_B:
                mx, mh = _amax_tile_bits(b_ptr, Mb, Kb, t - ta, nkb, B_X_AMAX, B_RHT_AMAX, ABM,
                                         ABK)
                bx = tl.maximum(bx, mx)
                bh = tl.maximum(bh, mh)
        done += 1
        t = after
    tl.atomic_max(slot + 64, ax, sem="relaxed")
    tl.atomic_max(slot + 65, ah, sem="relaxed")
    if HAS_B:
        tl.atomic_max(slot + 66, bx, sem="relaxed")
        tl.atomic_max(slot + 67, bh, sem="relaxed")
    _arrive_and_wait(slot, done, total)
    a_row = tl.load(slot + 64, volatile=True).to(tl.float32, bitcast=True)
    a_col = a_row
    if A_RHT_AMAX:
        a_col = tl.load(slot + 65, volatile=True).to(tl.float32, bitcast=True)
    b_row = a_row
    b_col = a_row
    if HAS_B:
        b_row = tl.load(slot + 66, volatile=True).to(tl.float32, bitcast=True)
        b_col = b_row
        if B_RHT_AMAX:
            b_col = tl.load(slot + 67, volatile=True).to(tl.float32, bitcast=True)
    qka, qa, qkb, qtotal = _pair_tiles(Ma, Ka, Mb, Kb, HAS_B, BM, BK)
    for u in range(tl.program_id(0), qtotal, tl.num_programs(0)):
        if u < qa:
            _nvfp4_tile(a_ptr, Ma, Ka, u // qka, u % qka, a_row, a_col, a_rr, a_rc, a_rd, a_rs,
                        a_ra, a_cd, a_cs, a_ca, A_TWO_D, A_RHT, A_SR, A_ROW, A_COL, BM, BK)
        else:
            if HAS_B:
                v = u - qa
                _nvfp4_tile(b_ptr, Mb, Kb, v // qkb, v % qkb, b_row, b_col, b_rr, b_rc, b_rd,
                            b_rs, b_ra, b_cd, b_cs, b_ca, B_TWO_D, B_RHT, B_SR, B_ROW, B_COL, BM,
                            BK)
    _leave(slot)


# (32, 64) tiles, 4 warps: tuned at 4096 x 4096 on an H200 (CUDA-graph replay):
# 85 / 84 / 260 us for an activation with the RHT / a 16x16 weight / a gradient
# with the RHT and stochastic rounding, against 82 / 80 / 348 with (64, 128), 8 warps
_BM, _BK = 32, 64
_AMAX_BM, _AMAX_BK = 64, 128  # the amax pass: 16.5 us at 4096 x 4096 against 33.3 with (32, 64)
_MAX_PARTS = 256  # programs of the amax pass (a power of two: the quantize pass loads them all)
_amax_launch = Launcher(_nvfp4_amax_kernel)
_nvfp4_launch = Launcher(_nvfp4_kernel, num_warps=4)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUFFERS = ("rowwise_data", "rowwise_scale_inv", "rowwise_amax",
            "columnwise_data", "columnwise_scale_inv", "columnwise_amax")


# One launch saves a launch's host time (~6-10 us) but its fused passes take
# more GPU time from about 1M elements on (H200, us: 512^2 x (RHT, stochastic) /
# x with a 512^2 W: 12.7 / 9.3 against 12.1 / 11.8 in two launches; 1024^2:
# 25.1 / 25.7 against 16.0 / 17.2; 4096 x 2048: 131.6 / 83.7 against 101.7 /
# 68.1; ``benchmarks --configs host`` on an H200), so it serves small calls
# (the host-bound ones) only.
_ONE_LAUNCH_MAX = 1 << 19  # elements quantized in one launch (both operands)
_one_launch = Launcher(_nvfp4_one_kernel, num_warps=4)
_ONE_PROGRAMS_PER_SM = 8  # of 4 warps, as the quantize pass's
_ONE_ABM, _ONE_ABK = 32, 128  # the one launch's amax tiles (fastest of 64x128, 32x64, 32x128)


def _fast_case(x2d, rowwise, columnwise) -> bool:
    m, k = x2d.shape
    b = ref.NVFP4_BLOCK
    return (x2d.numel() > 0 and not m % b and not k % b and x2d.dtype in _DTYPES
            and bool(rowwise or columnwise))


def quantize_nvfp4(x2d, block_2d, rht, stochastic, rowwise, columnwise) -> dict:
    if not _fast_case(x2d, rowwise, columnwise):
        return ref.quantize_nvfp4(x2d, block_2d, rht, stochastic, rowwise, columnwise)
    x2d = _matrix(x2d)
    slot = grid_state.slot(x2d.device) if x2d.numel() <= _ONE_LAUNCH_MAX else None
    if slot is not None:
        grid, key, args, outs = one_launch_call(
            ((x2d, (block_2d, rht, stochastic, rowwise, columnwise)),), slot)
        _one_launch(grid, key, *args)
        return outs[0]
    launches, out = quantize_calls(x2d, block_2d, rht, stochastic, rowwise, columnwise)
    for launcher, grid, key, args in launches:
        launcher(grid, key, *args)
    return out


def quantize_nvfp4_pair(x2d, w2d, x_config, w_config) -> tuple:
    """``reference.quantize_nvfp4_pair``: x and W (each config ``(block_2d,
    rht, stochastic, rowwise, columnwise)``) in one launch where a counter
    slot may be used, both are the kernels' case and small enough
    (``_ONE_LAUNCH_MAX``); else one quantization each."""
    if (x2d.numel() + w2d.numel() <= _ONE_LAUNCH_MAX and _fast_case(x2d, *x_config[3:])
            and _fast_case(w2d, *w_config[3:])):
        x2d, w2d = _matrix(x2d), _matrix(w2d)
        slot = grid_state.slot(x2d.device)
        if slot is not None:
            grid, key, args, outs = one_launch_call(((x2d, x_config), (w2d, w_config)), slot)
            _one_launch(grid, key, *args)
            return outs
    return quantize_nvfp4(x2d, *x_config), quantize_nvfp4(w2d, *w_config)


def one_launch_call(operands, slot) -> tuple:
    """``(grid, key, args, outs)`` of one :func:`_nvfp4_one_kernel` launch
    quantizing one or two ``(x2d, (block_2d, rht, stochastic, rowwise,
    columnwise))`` operands (contiguous, of the kernels' case) with counter
    slot ``slot`` (``(lo, hi)``, grid_state.py), their buffers allocated
    (one call) and stochastic draws made in the reference's order."""
    b = ref.NVFP4_BLOCK
    first = operands[0][0]
    names, specs, ends = [], [], []
    for x2d, (_, _, _, rowwise, columnwise) in operands:
        m, k = x2d.shape
        if rowwise:
            names += _BUFFERS[:3]
            specs += (((m, k // 2), torch.uint8), ((m, k // b), torch.float8_e4m3fn),
                      ((1,), torch.float32))
        if columnwise:
            names += _BUFFERS[3:]
            specs += (((k, m // 2), torch.uint8), ((k, m // b), torch.float8_e4m3fn),
                      ((1,), torch.float32))
        ends.append(len(names))
    made = native.empty_many(first, *specs)
    outs, args, key, tiles, start = [], [], [], 0, 0
    for (x2d, config), end in zip(operands, ends):
        m, k = x2d.shape
        block_2d, rht, stochastic, rowwise, columnwise = map(bool, config)
        out = dict(zip(names[start:end], made[start:end]))
        start = end
        r_row = (torch.rand((m, k), dtype=torch.float32, device=x2d.device)
                 if stochastic and rowwise else _unused(x2d))
        r_col = (torch.rand((k, m), dtype=torch.float32, device=x2d.device)
                 if stochastic and columnwise else _unused(x2d))
        rht_amax = columnwise and rht
        flags = (block_2d, rht, stochastic, rowwise, columnwise, rowwise or not rht_amax,
                 rht_amax)
        args.append(((x2d, m, k, r_row, r_col)
                     + tuple([out.get(n, x2d) for n in _BUFFERS]), flags))  # absent: _unused
        key.append((_x_key(x2d, m, k), flags))
        tiles += cdiv(m, _BM) * cdiv(k, _BK)
        outs.append(out)
    has_b = len(operands) == 2
    if not has_b:  # b's pointers are never read or written (HAS_B is a constexpr): a's input
        args.append(((first, 1, 1) + (first,) * 8, (False,) * 7))
    lo, hi = slot
    programs = min(tiles, triton_launch.sm_count(first.device) * _ONE_PROGRAMS_PER_SM)
    flat = (*args[0][0], *args[1][0], lo, hi, *args[0][1], *args[1][1], has_b, _BM, _BK,
            _ONE_ABM, _ONE_ABK)
    return (programs,), (*key, has_b, int_key(lo), int_key(hi)), flat, outs


def quantize_calls(x2d, block_2d, rht, stochastic, rowwise, columnwise) -> tuple:
    """:func:`quantize_nvfp4`'s launches on a contiguous ``x2d`` of its fast
    case, not launched: ``([(launcher, grid, key, args)] * 2, out)`` (the
    amax pass, then the quantize pass; the native eager path fixes the same
    launches).  The buffers and the stochastic draws are made here."""
    m, k = x2d.shape
    b = ref.NVFP4_BLOCK
    dev = x2d.device
    n_parts = min(cdiv(m, _AMAX_BM) * cdiv(k, _AMAX_BK), _MAX_PARTS)
    specs = {"parts": ((2 * n_parts,), torch.int32)}
    for name, rows, cols, on in (("rowwise", m, k, rowwise), ("columnwise", k, m, columnwise)):
        if on:
            specs[name + "_data"] = ((rows, cols // 2), torch.uint8)
            specs[name + "_scale_inv"] = ((rows, cols // b), torch.float8_e4m3fn)
            specs[name + "_amax"] = ((1,), torch.float32)
    out = dict(zip(specs, native.empty_many(x2d, *specs.values())))
    parts = out.pop("parts")
    rht_amax = bool(columnwise and rht)
    x_amax = bool(rowwise or not rht_amax)
    xkey = _x_key(x2d, m, k)
    amax = (_amax_launch, (n_parts,), (xkey, int_key(n_parts), x_amax, rht_amax),
            (x2d, m, k, parts, n_parts, x_amax, rht_amax, _AMAX_BM, _AMAX_BK))
    # the reference's draws: rand_like of the rowwise copy, then the columnwise one;
    # without them the kernel gets ``parts`` (read only), as do absent copies
    r_row = (torch.rand((m, k), dtype=torch.float32, device=dev) if stochastic and rowwise
             else parts)
    r_col = (torch.rand((k, m), dtype=torch.float32, device=dev) if stochastic and columnwise
             else parts)
    bufs = tuple(out[name] if name in out else _unused(parts) for name in _BUFFERS)
    flags = (bool(block_2d), bool(rht), bool(stochastic), bool(rowwise), bool(columnwise))
    quant = (_nvfp4_launch, (cdiv(m, _BM), cdiv(k, _BK)), (xkey, int_key(n_parts), flags),
             (x2d, m, k, parts, n_parts, r_row, r_col, *bufs, *flags, _BM, _BK, _MAX_PARTS))
    return [amax, quant], out


# -- the emulated GEMM's operands and epilogue ----------------------------------------
@triton.jit
def _nvfp4_blocks_kernel(d_ptr, s_ptr, out_ptr, R, C, OUT: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr):
    """reference.dequantize_nvfp4_blocks of one (BR, BC) tile of an (R, C)
    copy: its (BR, BC / 2) bytes and (BR, BC / 16) scales read as tiles
    (coalesced, each once), the two codes of a byte joined side by side."""
    _nvfp4_blocks_tile(d_ptr, s_ptr, out_ptr, R, C, tl.program_id(0), tl.program_id(1), OUT,
                       BR, BC)


@triton.jit
def _nvfp4_blocks_pair_kernel(a_ptr, as_ptr, a_out, Ra, Ca, b_ptr, bs_ptr, b_out, Rb, Cb,
                              OUT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """A GEMM's two operands (:func:`_nvfp4_blocks_kernel`) in one 1-D grid."""
    in_a, pid_r, pid_c = _pair_tile(tl.program_id(0), Ra, Ca, Rb, Cb, BR, BC)
    if in_a:
        _nvfp4_blocks_tile(a_ptr, as_ptr, a_out, Ra, Ca, pid_r, pid_c, OUT, BR, BC)
    else:
        _nvfp4_blocks_tile(b_ptr, bs_ptr, b_out, Rb, Cb, pid_r, pid_c, OUT, BR, BC)


@triton.jit
def _nvfp4_blocks_tile(d_ptr, s_ptr, out_ptr, R, C, pid_r, pid_c, OUT: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    rows = pid_r * BR + tl.arange(0, BR)
    v = _blocks_values(d_ptr, s_ptr, rows, R, C, pid_c * BC, BR, BC)
    cols = pid_c * BC + tl.arange(0, BC)
    _store_rows(out_ptr, v.to(OUT), rows, cols, (rows[:, None] < R) & (cols[None, :] < C), C)


@triton.jit
def _blocks_values(d_ptr, s_ptr, rows, R, C, c0, BR: tl.constexpr, BC: tl.constexpr):
    """reference.dequantize_nvfp4_blocks of columns c0..c0+BC of the rows
    ``rows`` of an (R, C) copy, fp32 (each value exact in bf16), zeros
    outside it: the (BR, BC / 2) bytes and (BR, BC / 16) scales read as
    tiles (coalesced, each once), the two codes of a byte side by side.
    The blocks kernel stores them; the one-kernel GEMM
    (triton_nvfp4_gemm.py) multiplies them."""
    r = rows[:, None].to(tl.int64)
    cb = c0 // 2 + tl.arange(0, BC // 2)
    byte = tl.load(d_ptr + r * (C // 2) + cb[None, :],
                   mask=(rows[:, None] < R) & (cb[None, :] < C // 2), other=0).to(tl.int32)
    cs = c0 // 16 + tl.arange(0, BC // 16)
    s = tl.load(s_ptr + r * (C // 16) + cs[None, :],
                mask=(rows[:, None] < R) & (cs[None, :] < C // 16), other=0.0).to(tl.float32)
    code = tl.reshape(tl.join(byte & 15, byte >> 4), (BR, BC))  # low nibble: even element
    v = tl.reshape(_e2m1_fp32(code), (BR, BC // 16, 16)) * s[:, :, None]
    return tl.reshape(v, (BR, BC))


@triton.jit
def _e2m1_fp32(code):
    """The fp32 values of int32 E2M1 codes (sign in bit 3), built as bits:
    exponent e + 126 and mantissa bit m for e > 0 ((1 + m / 2) 2^(e - 1)),
    0.5 or 0 for e == 0; :func:`_e2m1_value` with the sign, in fewer
    instructions (the one-kernel GEMM decodes each tile many times)."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_epilogue_kernel(acc_ptr, amax_a_ptr, amax_b_ptr, bias_ptr, out_ptr, M, N,
                           HAS_BIAS: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr):
    """reference.nvfp4_gemm_epilogue of one (BM, BN) tile."""
    rm, rn, mask = _tile_index(M, N, tl.program_id(0), tl.program_id(1), BM, BN)
    ga = _scale_from_amax(tl.load(amax_a_ptr), _GLOBAL_MAX, 0.0, False)
    gb = _scale_from_amax(tl.load(amax_b_ptr), _GLOBAL_MAX, 0.0, False)
    y = _load_tile(acc_ptr, rm, rn, mask, N)
    y = tl.math.div_rn(tl.math.div_rn(y, tl.zeros_like(y) + ga), tl.zeros_like(y) + gb)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    _store_rows(out_ptr, y.to(OUT), rm, rn, mask, N)


_blocks_launch = Launcher(_nvfp4_blocks_kernel)
_blocks_pair_launch = Launcher(_nvfp4_blocks_pair_kernel)
_epilogue_launch = Launcher(_nvfp4_epilogue_kernel)
_G_BM, _G_BK = 64, 128  # 16.7 us for a 4096 x 4096 copy (H200)
_TL_OUT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dequantize_nvfp4_blocks(packed, scale_q, out_dtype=torch.bfloat16) -> torch.Tensor:
    if not _blocks_fast(packed, scale_q, out_dtype):
        return ref.dequantize_nvfp4_blocks(packed, scale_q, out_dtype)
    r, c = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((r, c), dtype=out_dtype, device=packed.device)
    launcher, grid, key, args = dequantize_call(_matrix(packed), _matrix(scale_q), out)
    launcher(grid, key, *args)
    return out


def _blocks_fast(packed, scale_q, out_dtype) -> bool:
    r, c = packed.shape[0], packed.shape[1] * 2
    return (packed.numel() > 0 and out_dtype in _TL_OUT and scale_q.shape == (r, c // 16)
            and packed.dtype == torch.uint8 and scale_q.dtype == torch.float8_e4m3fn)


def dequantize_nvfp4_blocks_pair(a_packed, a_scale, b_packed, b_scale,
                                 out_dtype=torch.bfloat16) -> tuple:
    """``reference.dequantize_nvfp4_blocks_pair``: both operands in one launch."""
    if not (_blocks_fast(a_packed, a_scale, out_dtype)
            and _blocks_fast(b_packed, b_scale, out_dtype)):
        return ref.dequantize_nvfp4_blocks_pair(a_packed, a_scale, b_packed, b_scale, out_dtype)
    a_packed, a_scale, b_packed, b_scale = map(_matrix, (a_packed, a_scale, b_packed, b_scale))
    (ra, ca), (rb, cb) = (a_packed.shape[0], a_packed.shape[1] * 2), (b_packed.shape[0],
                                                                      b_packed.shape[1] * 2)
    a_out, b_out = native.empty_many(a_packed, ((ra, ca), out_dtype), ((rb, cb), out_dtype))
    grid = (cdiv(ra, _G_BM) * cdiv(ca, _G_BK) + cdiv(rb, _G_BM) * cdiv(cb, _G_BK),)
    key = (ptr_key(a_packed), ptr_key(a_scale), int_key(ra), int_key(ca), ptr_key(b_packed),
           ptr_key(b_scale), int_key(rb), int_key(cb), out_dtype)
    _blocks_pair_launch(grid, key, a_packed, a_scale, a_out, ra, ca, b_packed, b_scale, b_out,
                        rb, cb, _TL_OUT[out_dtype], _G_BM, _G_BK)
    return a_out, b_out


def dequantize_call(packed, scale_q, out) -> tuple:
    """:func:`dequantize_nvfp4_blocks`' launch into ``out`` (contiguous
    operands of its fast case), not launched: ``(launcher, grid, key, args)``."""
    r, c = out.shape
    return (_blocks_launch, (cdiv(r, _G_BM), cdiv(c, _G_BK)),
            (ptr_key(packed), ptr_key(scale_q), int_key(r), int_key(c), out.dtype),
            (packed, scale_q, out, r, c, _TL_OUT[out.dtype], _G_BM, _G_BK))


def nvfp4_gemm_epilogue(acc, amax_a, amax_b, bias, out_dtype) -> torch.Tensor:
    if (acc.numel() == 0 or acc.dim() != 2 or acc.dtype != torch.float32
            or out_dtype not in _TL_OUT or (bias is not None and bias.dtype not in _TL_OUT)):
        return ref.nvfp4_gemm_epilogue(acc, amax_a, amax_b, bias, out_dtype)
    acc = _matrix(acc)
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    launcher, grid, key, args = epilogue_call(acc, amax_a, amax_b,
                                              None if bias is None else _matrix(bias), out)
    launcher(grid, key, *args)
    return out


def epilogue_call(acc, amax_a, amax_b, bias, out) -> tuple:
    """:func:`nvfp4_gemm_epilogue`'s launch into ``out`` (contiguous operands
    of its fast case), not launched: ``(launcher, grid, key, args)``."""
    m, n = acc.shape
    has_bias = bias is not None
    bias_arg = bias if has_bias else acc
    return (_epilogue_launch, (cdiv(m, _G_BM), cdiv(n, _G_BK)),
            (_x_key(acc, m, n), amax_a.dtype, ptr_key(amax_a), amax_b.dtype,
             ptr_key(amax_b), bias_arg.dtype, ptr_key(bias_arg), has_bias, out.dtype),
            (acc, amax_a, amax_b, bias_arg, out, m, n, has_bias, _TL_OUT[out.dtype],
             _G_BM, _G_BK))
