"""LayerNorm / RMSNorm forward and backward for CUDA, in Triton.

Same signatures as ``kernels.reference.norm_forward`` / ``norm_backward``;
equal to them within fp32 accumulation order (the tests give the measured
differences).  Every row is held whole in registers (hidden sizes up to
``MAX_K``; larger ones take the reference).

* Forward, one launch: the statistics of each row in fp32 (two passes over
  the registers: mean, then the centred variance), ``rstd`` as the
  correctly rounded ``1 / sqrt(var + eps)``, the output rounded once to the
  input's dtype.  ``with_amax=True`` also returns the partial maxima of
  ``|y|`` (as rounded), one per program of a grid of a few programs per
  multiprocessor that stride over the rows: FP8
  current scaling then quantizes ``y`` with that amax
  (``quantize_fp8_current(..., amax=parts)``), skipping its own amax pass
  over ``y`` and needing no zero-filled slot.  ``side=W`` adds programs that
  write the partial maxima of the layer's weight after y's (the same launch),
  so x and W are then cast together in one launch
  (``quantize_fp8_current_pair_from_parts``).
* ``norm_forward_fp8`` (delayed scaling: the scale is known before y
  exists): the same launch casts y to FP8 as it goes, records its amax, and
  writes y itself only when asked, so y is never read back; a byte
  transpose then makes the columnwise copy.
* Backward, two launches: dx per row (in the input's dtype), and per
  program the partial sums of dgamma / dbeta over the rows it strides
  over; then one small kernel sums the partials per column (fixed order:
  deterministic, no atomics) and rounds them to the parameters' dtype.

Launched through :class:`triton_launch.Launcher`; nothing reads a value
back to the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from . import triton_launch
from .triton_bias import col_sums_call
from .triton_launch import Launcher, cdiv, int_key, ptr_key
from .triton_quant import (_MAX_GIVEN_PARTS, _TL_FP8, _abs_bits, _amax_partials,
                           _cast_fp8, _int_slot, _n_amax_parts, _recip, _unused,
                           transpose_bytes)

MAX_K = 16384  # widest row held in registers
# Programs per multiprocessor of the grids that stride over the rows: the
# forward that also returns partial maxima (at most _MAX_GIVEN_PARTS of
# them), and the backward (one row of dgamma / dbeta partials per program).
# H200, 8192 x 4096 bf16 LayerNorm: the amax forward 66 us at 2, 4 or 8 per SM
# (Triton's loop pipelining depth 1, 2 or default: no difference either);
# the backward 122 us at 1, 86 at 2, 102 at 4, 131 at 8.
FWD_AMAX_PROGRAMS_PER_SM = 4
BWD_PROGRAMS_PER_SM = 2


@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, s_ptr,
                     scale_ptr, q_ptr, sinv_ptr, M, K, eps, G, Ms, Ks, Ps,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, AMAX: tl.constexpr,
                     SIDE: tl.constexpr, FP8: tl.constexpr, WRITE_Y: tl.constexpr,
                     FMT_MAX: tl.constexpr, OUT: tl.constexpr, VEC: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, SBM: tl.constexpr,
                     SBK: tl.constexpr, SLOT: tl.constexpr):
    """Programs [0, G) normalise the rows (:func:`_norm_fwd_rows`).  SIDE:
    programs [G, G + Ps) write the partial maxima of |s| (Ms, Ks), another
    matrix the caller quantizes with y (the layer's weight), to
    amax_ptr[G:G + Ps], so one cast launch can then quantize both."""
    pid = tl.program_id(0)
    if SIDE:
        if pid < G:
            _norm_fwd_rows(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, scale_ptr,
                           q_ptr, sinv_ptr, M, K, eps, G, pid, RMS, HAS_BIAS, AMAX, FP8,
                           WRITE_Y, FMT_MAX, OUT, VEC, BM, BK, SLOT)
        else:
            _amax_partials(s_ptr, Ms, Ks, amax_ptr + G, pid - G, Ps, SBM, SBK)
    else:
        _norm_fwd_rows(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, scale_ptr,
                       q_ptr, sinv_ptr, M, K, eps, G, pid, RMS, HAS_BIAS, AMAX, FP8, WRITE_Y,
                       FMT_MAX, OUT, VEC, BM, BK, SLOT)


@triton.jit
def _norm_fwd_rows(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, scale_ptr, q_ptr,
                   sinv_ptr, M, K, eps, G, pid, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   AMAX: tl.constexpr, FP8: tl.constexpr, WRITE_Y: tl.constexpr,
                   FMT_MAX: tl.constexpr, OUT: tl.constexpr, VEC: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr, SLOT: tl.constexpr):
    """Program pid normalises row blocks pid, pid + G, ... and writes y
    (rounded to x's dtype) when WRITE_Y.  AMAX: the max |y| bits of those
    rows to amax_ptr[pid].  FP8 (needs AMAX): y's FP8 copy cast with the
    fp32 scale at scale_ptr to q_ptr, the max |y| bits atomically into the
    zeroed fp32 slot amax_ptr[SLOT] instead, and 1 / scale to sinv_ptr
    (program 0)."""
    rk = tl.arange(0, BK)
    col_ok = rk < K
    w = tl.load(w_ptr + rk, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + rk, mask=col_ok, other=0.0).to(tl.float32)
    if FP8:
        s = tl.load(scale_ptr).to(tl.float32)
    kf = K * 1.0
    acc = tl.zeros((BM, BK), dtype=tl.int32)
    for blk in range(pid, tl.cdiv(M, BM), G):
        rm = blk * BM + tl.arange(0, BM)
        row_ok = rm < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rm[:, None].to(tl.int64) * K + rk[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.math.div_rn(tl.sum(x, axis=1), kf)
            tl.store(mean_ptr + rm, mean, mask=row_ok)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.math.div_rn(tl.sum(xc * xc, axis=1), kf)
        # eps arrives as fp32 from a launch, as fp64 from inductor's code and as
        # a Python float in torch's mutation analysis (tl.cast takes all three;
        # with ``eps.to`` the analysis failed on torch 2.11, which then took
        # every input as written and inductor copied x and the weights first)
        rstd = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32),
                              tl.sqrt_rn(var + tl.cast(eps, tl.float32)))
        tl.store(rstd_ptr + rm, rstd, mask=row_ok)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y = y + b[None, :]
        yo = y.to(x_ptr.dtype.element_ty)  # y's dtype is x's
        if WRITE_Y:
            tl.store(y_ptr + offs, yo, mask=mask)
        if FP8:
            # Offsets whose known contiguity is x's vector width (VEC elements of
            # 16 bytes), not BK: Triton lays the row block out for its widest store,
            # and a 16-wide one-byte store changed the reductions' order (rstd 1-2
            # ulp off in ~20% of the rows on sm_90, Triton 3.6), so y, mean and rstd
            # would no longer equal the plain forward's.
            rkv = (rk // VEC) * VEC + rk % VEC
            tl.store(q_ptr + rm[:, None].to(tl.int64) * K + rkv[None, :],
                     _cast_fp8(yo, s, FMT_MAX, OUT), mask=mask)
        if AMAX:  # int32 bits of |y| order like the floats, NaN above Inf
            acc = tl.maximum(acc, tl.where(mask, _abs_bits(yo), 0))
    if AMAX:
        part = tl.max(tl.max(acc, axis=1), axis=0)
        if FP8:
            tl.atomic_max(_int_slot(amax_ptr + SLOT), part)
        else:
            tl.store(amax_ptr + pid, part)
    if FP8:
        if pid == 0:
            tl.store(sinv_ptr, _recip(s))


@triton.jit
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, M, K, G,
                     RMS: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                     NEED_DB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Program p: dx of row blocks p, p + G, ...; the partial dgamma (and
    dbeta after it) of those rows to part_ptr[p] (and part_ptr[G + p])."""
    pid = tl.program_id(0)
    rk = tl.arange(0, BK)
    col_ok = rk < K
    w = tl.load(w_ptr + rk, mask=col_ok, other=0.0).to(tl.float32)
    kf = K * 1.0
    dw_acc = tl.zeros((BM, BK), dtype=tl.float32)
    db_acc = tl.zeros((BM, BK), dtype=tl.float32)
    for blk in range(pid, tl.cdiv(M, BM), G):
        rm = blk * BM + tl.arange(0, BM)
        row_ok = rm < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rm[:, None].to(tl.int64) * K + rk[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rm, mask=row_ok, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rm, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if NEED_DW:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
        if NEED_DX:
            g = dy * w[None, :]
            c1 = tl.math.div_rn(tl.sum(xhat * g, axis=1), kf)
            if RMS:
                dx = (g - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.math.div_rn(tl.sum(g, axis=1), kf)
                dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(part_ptr + pid.to(tl.int64) * K + rk, tl.sum(dw_acc, axis=0), mask=col_ok)
    if NEED_DB:
        if NEED_DW:
            db_row = G + pid
        else:
            db_row = pid
        tl.store(part_ptr + db_row.to(tl.int64) * K + rk, tl.sum(db_acc, axis=0), mask=col_ok)


def _warps(elements: int) -> int:
    return max(4, min(16, elements // 512))


class _ByWarps:
    """One Launcher per num_warps (a Launcher compiles with a fixed count)."""

    def __init__(self, fn):
        self.fn, self.launchers = fn, {}

    def get(self, num_warps: int) -> Launcher:
        launcher = self.launchers.get(num_warps)
        if launcher is None:
            launcher = self.launchers[num_warps] = Launcher(self.fn, num_warps=num_warps)
        return launcher


_fwd = _ByWarps(_norm_fwd_kernel)
_bwd = _ByWarps(_norm_bwd_kernel)
_BLOCKS: dict = {}


def _blocks(k: int) -> tuple:
    """(rows per block BM, padded row BK, num_warps) for rows of k elements."""
    b = _BLOCKS.get(k)
    if b is None:
        bk = 1 << (k - 1).bit_length()
        bm = max(1, min(64, 4096 // bk))
        b = _BLOCKS[k] = (bm, bk, _warps(bm * bk))
    return b


def _matrix(t):
    return t if t.is_contiguous() else t.contiguous()


def norm_forward(x2d, weight, bias, eps: float, rms: bool, with_amax: bool = False,
                 side=None) -> tuple:
    if side is not None and not with_amax:
        raise ValueError("norm_forward: side needs with_amax")
    if not _fast_case(x2d, weight, bias) or (side is not None and (
            side.dim() != 2 or side.numel() == 0)):
        return ref.norm_forward(x2d, weight, bias, eps, rms, with_amax, side)
    y, mean, rstd, parts, grid = _launch_fwd(x2d, weight, bias, eps, rms, with_amax, side)
    if side is not None:
        return y, mean, rstd, parts.view(torch.float32), grid
    if with_amax:
        return y, mean, rstd, parts.view(torch.float32)
    return y, mean, rstd


def norm_forward_fp8(x2d, weight, bias, eps: float, rms: bool, scale, fmt: str,
                     columnwise: bool, amax_out, with_y: bool) -> tuple:
    """``reference.norm_forward_fp8``: one launch writes the FP8 copy (and y
    only ``with_y``); the columnwise copy is then the transpose of its bytes."""
    if not _fast_case(x2d, weight, bias):
        return ref.norm_forward_fp8(x2d, weight, bias, eps, rms, scale, fmt, columnwise,
                                    amax_out, with_y)
    m, k = x2d.shape
    dev = x2d.device
    buffers = {"data": torch.empty((m, k), dtype=ref.FP8_DTYPE[fmt], device=dev),
               "scale_inv": torch.empty(1, dtype=torch.float32, device=dev)}
    if scale.dtype != torch.float32:
        scale = scale.float()
    y, mean, rstd, _, _ = _launch_fwd(x2d, weight, bias, eps, rms, True, None,
                                      (scale, fmt, amax_out, with_y, buffers))
    if columnwise:
        buffers["transpose"] = transpose_bytes(buffers["data"])
    return y, mean, rstd, buffers


def _fast_case(x2d, weight, bias) -> bool:
    return (x2d.shape[0] > 0 and x2d.shape[1] <= MAX_K and weight.is_contiguous()
            and (bias is None or bias.is_contiguous()))


def _launch_fwd(x2d, weight, bias, eps, rms, with_amax, side, fp8=None) -> tuple:
    """The forward launch: ``(y or None, mean, rstd, int32 partial maxima
    or None, programs that wrote y's)``.  ``fp8``: (scale, format, amax slot
    (``reference.AmaxSlot`` or one fp32 element), write y, buffers with data
    and scale_inv)."""
    launcher, grid, key, args, outputs = forward_call(x2d, weight, bias, eps, rms, with_amax,
                                                      side, fp8)
    launcher(grid, key, *args)
    return outputs


def forward_call(x2d, weight, bias, eps, rms, with_amax=False, side=None, fp8=None) -> tuple:
    """:func:`_launch_fwd`'s launch, not launched: ``(launcher, grid, key,
    args, outputs)`` (the native eager path fixes the same launch)."""
    x2d = _matrix(x2d)
    m, k = x2d.shape
    dev = x2d.device
    bm, bk, warps = _blocks(k)
    n_blk = cdiv(m, bm)
    grid = (min(n_blk, _MAX_GIVEN_PARTS, FWD_AMAX_PROGRAMS_PER_SM * triton_launch.sm_count(dev))
            if with_amax else n_blk)
    write_y = fp8 is None or fp8[3]
    y = torch.empty((m, k), dtype=x2d.dtype, device=dev) if write_y else None
    # separate allocations, not views of one: an op may not return aliases of each other
    rstd = torch.empty((m,), dtype=torch.float32, device=dev)
    mean = None if rms else torch.empty((m,), dtype=torch.float32, device=dev)
    ms, ks = (0, 0) if side is None else side.shape
    n_side = 0 if side is None else _n_amax_parts(ms, ks)
    # absent arguments (never read or written: the flags are constexpr) point at x
    absent = lambda: _unused(x2d)  # noqa: E731
    slot = 0
    if fp8 is not None:
        scale, fmt, amax_out, _, buffers = fp8
        amax_out = ref.amax_slot(amax_out)  # the whole vector: see AmaxSlot
        if amax_out.step is not None:
            raise ValueError("norm_forward_fp8 runs no delayed-scaling step (StepAfter): "
                             "give it to the op call's last quantization")
        parts, slot = amax_out.amaxes, amax_out.index
        q, sinv = buffers["data"], buffers["scale_inv"]
    else:
        scale, fmt, q, sinv = absent(), "e4m3", absent(), absent()
        parts = (torch.empty((grid + n_side,), dtype=torch.int32, device=dev) if with_amax
                 else absent())
    has_bias = bias is not None and not rms
    b = bias if has_bias else weight
    s = absent() if side is None else _matrix(side)
    flags = (bool(rms), has_bias, bool(with_amax), side is not None, fp8 is not None, write_y)
    key = (x2d.dtype, weight.dtype, b.dtype, s.dtype, ptr_key(x2d), ptr_key(weight), ptr_key(b),
           ptr_key(rstd), ptr_key(s), ptr_key(scale), ptr_key(parts), int_key(m), int_key(k),
           int_key(grid), int_key(ms), int_key(ks), int_key(n_side), flags, fmt, bm, bk, slot)
    args = (x2d, weight, b, absent() if y is None else y, absent() if mean is None else mean,
            rstd, parts, s, scale, q, sinv, m, k, float(eps), grid, ms, ks, n_side, *flags,
            ref.FP8_MAX[fmt], _TL_FP8[fmt], 16 // x2d.element_size(), bm, bk, _SIDE_BM,
            _SIDE_BK, slot)
    return (_fwd.get(warps), (grid + n_side,), key, args,
            (y, mean, rstd, (parts if with_amax else None), grid))


# tile of the side matrix's amax programs: as many elements as a norm block
# (register use); the count of partials follows triton_quant's amax pass
_SIDE_BM, _SIDE_BK = 16, 256


def norm_backward(dy2d, x2d, mean, rstd, weight, rms: bool, need_dx: bool,
                  need_dweight: bool, need_dbias: bool, grad_dtype=None) -> tuple:
    """dx in x's dtype; dgamma / dbeta in ``grad_dtype`` (fp32 if None),
    rounded once from their fp32 sums."""
    m, k = x2d.shape
    need_dbias = need_dbias and not rms
    if m == 0 or k > MAX_K or not weight.is_contiguous() or not (
            need_dx or need_dweight or need_dbias):
        return ref.norm_backward(dy2d, x2d, mean, rstd, weight, rms, need_dx, need_dweight,
                                 need_dbias, grad_dtype)
    launches, (dx, sums) = backward_calls(_matrix(dy2d), _matrix(x2d), mean, rstd, weight, rms,
                                          need_dx, need_dweight, need_dbias, grad_dtype)
    for launcher, grid, key, args in launches:
        launcher(grid, key, *args)
    dw = db = None
    if sums is not None:
        dw = sums[0] if need_dweight else None
        db = sums[sums.shape[0] - 1] if need_dbias else None
    return dx, dw, db


def backward_calls(dy2d, x2d, mean, rstd, weight, rms: bool, need_dx: bool, need_dweight: bool,
                   need_dbias: bool, grad_dtype=None) -> tuple:
    """:func:`norm_backward`'s launches on contiguous operands, not launched:
    ``([(launcher, grid, key, args), ...], (dx or None, the (n, k) dgamma /
    dbeta sums or None))`` (the native eager path fixes the same launches)."""
    m, k = x2d.shape
    dev = x2d.device
    bm, bk, warps = _blocks(k)
    n_blk = cdiv(m, bm)
    grid = min(n_blk, BWD_PROGRAMS_PER_SM * triton_launch.sm_count(dev))
    n_sums = int(need_dweight) + int(need_dbias)
    dx = torch.empty((m, k), dtype=x2d.dtype, device=dev) if need_dx else _unused(x2d)
    parts = torch.empty((max(n_sums, 1) * grid, k), dtype=torch.float32, device=dev)
    mean_arg = rstd if mean is None else mean
    key = (x2d.dtype, dy2d.dtype, weight.dtype, ptr_key(x2d), ptr_key(dy2d), ptr_key(weight),
           ptr_key(rstd), ptr_key(mean_arg), int_key(m), int_key(k), int_key(grid), bool(rms),
           bool(need_dx), bool(need_dweight), bool(need_dbias), bm, bk)
    launches = [(_bwd.get(warps), (grid,), key,
                 (dy2d, x2d, weight, mean_arg, rstd, dx, parts, m, k, grid, bool(rms),
                  bool(need_dx), bool(need_dweight), bool(need_dbias), bm, bk))]
    sums = None
    if n_sums:
        sums = torch.empty((n_sums, k), dtype=grad_dtype or torch.float32, device=dev)
        launches.append(col_sums_call(parts, sums, grid, k))
    return launches, ((dx if need_dx else None), sums)
