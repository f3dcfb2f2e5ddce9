"""Fused quantization kernels for CUDA, in Triton.

Each wrapper has the signature of the same-named function in
``kernels.reference`` and returns bit-identical buffers (tests/gpu check this
on random and special values).  What is fused:

* FP8 per-tensor, current scaling in two launches: an amax pass whose
  programs (at most 256) each write the max of their tiles (no zero-filled
  buffer, so no fill kernel), then one pass that reduces those partial
  maxima, computes the scale on the device and writes the rowwise copy,
  the transposed copy and ``scale_inv`` together (``triton_current.py``
  does both in one launch where it may, and falls back to these).  With a
  given scale (delayed scaling) the cast pass alone, optionally recording
  the tensor's amax.
* The delayed-scaling history/scale update: run by the cast that records
  an op call's last amax, or in one small kernel of its own.
* The device helpers (casts, tiles, amax bits) the other Triton modules
  share; FP8 blockwise and MXFP8 are in ``triton_block.py``.
The transposed copy re-reads its tile transposed (from cache) instead of
transposing in registers; see ``_tile_t``.  Inputs are made contiguous
(M, K) matrices; kernels launch through :class:`triton_launch.Launcher`,
whose keys are built here from what Triton specializes on.

Nothing here reads a value back to the host, so the kernels can be captured
in a CUDA graph.  Block maxima reduce the int32 bits of ``|x|``: for
non-negative floats integer order is float order, with NaN above Inf, so a
NaN in a block propagates like ``torch.amax`` does (Triton's float max would
drop it).  Divisions use ``div_rn`` (IEEE, as torch's) and the scale is
``reciprocal(amax) * fmt_max``, the two roundings of the reference's
``fmt_max / amax`` on a tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import native
from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, next_pow2, ptr_key

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_FP32_MAX = tl.constexpr(ref.FP32_MAX)


# -- device helpers ---------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    """int32 bits of |x| as fp32: ordered like the floats, NaN above Inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _int_slot(fp32_ptr):
    """An fp32 amax slot as int32, for an atomic max of ``_abs_bits``.  The
    cast is here, not a torch dtype view of the slot: inductor cannot lower a
    dtype view of one element of a buffer as a kernel argument (torch 2.11),
    which delayed scaling's per-tensor amax slots are."""
    return fp32_ptr.to(tl.pointer_type(tl.int32), bitcast=True)


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
def _tile_index(M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """Rows, columns and in-bounds mask of tile (pid_m, pid_k) of an (M, K)
    matrix.  Computed apart from the load on purpose: torch's mutation
    analysis of a traced kernel (``wrap_triton``, kernels/tracing.py) takes
    every pointer passed to a call whose results feed a store address as
    written, and inductor then copies that input before each launch."""
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    return rm, rk, (rm[:, None] < M) & (rk[None, :] < K)


@triton.jit
def _load_tile(x_ptr, rm, rk, mask, K):
    """The tile (rm, rk) of the contiguous matrix at x_ptr (K columns), fp32, zeros outside."""
    return tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, y, rm, rk, mask, K):
    tl.store(ptr + rm[:, None].to(tl.int64) * K + rk[None, :], y, mask=mask)


@triton.jit
def _tile_t(x_ptr, M, K, pid_m, pid_k, BM: tl.constexpr, BK: tl.constexpr):
    """The transpose (BK, BM) of the tile ``_load_tile`` loads, read from memory
    again (the bytes are in cache): no in-register transpose.  tl.trans of a
    tile that is also stored rowwise gave wrong rows on sm_90 (Triton 3.6)."""
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask_t = (rk[:, None] < K) & (rm[None, :] < M)
    ptrs = x_ptr + rk[:, None] + rm[None, :].to(tl.int64) * K
    return tl.load(ptrs, mask=mask_t, other=0.0).to(tl.float32), mask_t


@triton.jit
def _store_transposed(ptr, xt, st, rm, rk, mask_t, M, FMT_MAX: tl.constexpr, OUT: tl.constexpr):
    """Cast the transposed tile ``xt`` (BK, BM) with scale ``st`` into the (K, M) matrix."""
    tl.store(ptr + rk[:, None].to(tl.int64) * M + rm[None, :], _cast_fp8(xt, st, FMT_MAX, OUT),
             mask=mask_t)


@triton.jit
def _pair_tile(pid, Ma, Ka, Mb, Kb, BM: tl.constexpr, BK: tl.constexpr):
    """``(in_a, pid_m, pid_k)`` of program ``pid`` of a 1-D grid over matrix
    a's (BM, BK) tiles, then b's: the pair kernels quantize or dequantize
    two matrices (a layer's x and W, a GEMM's operands) in one launch."""
    a_tiles_k = tl.cdiv(Ka, BK)
    a_tiles = tl.cdiv(Ma, BM) * a_tiles_k
    in_a = pid < a_tiles
    u = tl.where(in_a, pid, pid - a_tiles)
    tiles_k = tl.where(in_a, a_tiles_k, tl.cdiv(Kb, BK))
    return in_a, u // tiles_k, u % tiles_k


def _matrix(x2d: torch.Tensor) -> torch.Tensor:
    """The kernels read a contiguous (M, K) matrix."""
    return x2d if x2d.is_contiguous() else x2d.contiguous()


def _x_key(x2d: torch.Tensor, m: int, k: int) -> tuple:
    """Launch-key part of the input matrix (see triton_launch)."""
    return x2d.dtype, ptr_key(x2d), int_key(m), int_key(k)


def _unused(src: torch.Tensor) -> torch.Tensor:
    """The pointer argument for a buffer a kernel never touches (its flag is
    a constexpr): ``src``, an input the kernel only reads.  Torch's mutation
    analysis of a traced kernel finds no store through it, so a lowered
    graph allocates nothing for it (a separate unused argument would cost a
    one-element allocation per call)."""
    return src


# -- layout ------------------------------------------------------------------------
@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    """y (K, M) = x (M, K) transposed, one (BM, BK) tile per program: both
    the load and the store are coalesced (a strided copy is not)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask)
    mask_t = (rk[:, None] < K) & (rm[None, :] < M)
    tl.store(y_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(x), mask=mask_t)


_transpose_launch = Launcher(_transpose_kernel, num_warps=4)
_T_BLOCK = 64


def transpose_bytes(x2d: torch.Tensor, out=None) -> torch.Tensor:
    m, k = x2d.shape
    if out is None:
        out = torch.empty((k, m), dtype=x2d.dtype, device=x2d.device)
    if x2d.numel() == 0:
        return out
    launcher, grid, key, args = transpose_call(x2d, out)
    launcher(grid, key, *args)
    return out


def transpose_call(x2d: torch.Tensor, out: torch.Tensor) -> tuple:
    """:func:`transpose_bytes`'s launch into ``out``, not launched:
    ``(launcher, grid, key, args)`` (the native eager path fixes the same
    launch; its pointers are byte views of ``x2d`` and ``out``)."""
    m, k = x2d.shape
    x8, y8 = _matrix(x2d).view(torch.uint8), out.view(torch.uint8)
    return (_transpose_launch, (cdiv(m, _T_BLOCK), cdiv(k, _T_BLOCK)),
            (ptr_key(x8), ptr_key(y8), int_key(m), int_key(k)), (x8, y8, m, k, _T_BLOCK, _T_BLOCK))


# -- FP8 per-tensor ------------------------------------------------------------------
@triton.jit
def _amax_kernel(x_ptr, M, K, out_ptr, index, BM: tl.constexpr, BK: tl.constexpr):
    """Atomic max of |x| into the fp32 slot ``out_ptr[index]`` (zero or
    another amax: non-negative, so its bits order as its values; one tile a
    program)."""
    rm, rk, mask = _tile_index(M, K, tl.program_id(0), tl.program_id(1), BM, BK)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    tl.atomic_max(_int_slot(out_ptr + index), tl.max(tl.max(_abs_bits(x), axis=1), axis=0))


@triton.jit
def _amax_partials(x_ptr, M, K, part_ptr, pid, P, BM: tl.constexpr, BK: tl.constexpr):
    """Program ``pid`` of P writes the max |x| bits of tiles pid, pid + P, ... to part_ptr[pid]."""
    n_k = tl.cdiv(K, BK)
    acc = tl.zeros((BM, BK), dtype=tl.int32)
    for i in range(0, tl.cdiv(tl.cdiv(M, BM) * n_k, P)):
        t = pid + i * P  # past the last tile: rows beyond M, a masked (zero) tile
        rm, rk, mask = _tile_index(M, K, t // n_k, t % n_k, BM, BK)
        x = _load_tile(x_ptr, rm, rk, mask, K)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.store(part_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _amax_partials_kernel(x_ptr, M, K, part_ptr, P, BM: tl.constexpr, BK: tl.constexpr):
    _amax_partials(x_ptr, M, K, part_ptr, tl.program_id(0), P, BM, BK)


@triton.jit
def _amax_partials_pair_kernel(a_ptr, Ma, Ka, b_ptr, Mb, Kb, part_ptr, Pa, Pb,
                               BM: tl.constexpr, BK: tl.constexpr):
    """Programs [0, Pa) do a's partial maxima into part_ptr[:Pa], the next Pb b's after them."""
    pid = tl.program_id(0)
    if pid < Pa:
        _amax_partials(a_ptr, Ma, Ka, part_ptr, pid, Pa, BM, BK)
    else:
        _amax_partials(b_ptr, Mb, Kb, part_ptr + Pa, pid - Pa, Pb, BM, BK)


@triton.jit
def _scale_from_parts(part_ptr, n_parts, FMT_MAX: tl.constexpr, EPS: tl.constexpr,
                      POW2: tl.constexpr, NP: tl.constexpr):
    """The current-scaling scale from the max of n_parts (<= NP) partial maxima."""
    parts = tl.load(part_ptr + tl.arange(0, NP), mask=tl.arange(0, NP) < n_parts, other=0)
    return _scale_from_amax(tl.max(parts, axis=0).to(tl.float32, bitcast=True), FMT_MAX, EPS,
                            POW2)


@triton.jit
def _store_fp8_copies(x, s, rm, rk, mask, x_ptr, M, K, pid_m, pid_k, data_ptr, t_ptr, sinv_ptr,
                      FMT_MAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                      OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Write tile (pid_m, pid_k)'s rowwise and transposed FP8 copies with scale s
    (``x`` is the tile ``_load_tile`` loaded); the first tile writes ``scale_inv``."""
    if ROW:
        _store_rows(data_ptr, _cast_fp8(x, s, FMT_MAX, OUT), rm, rk, mask, K)
    if COL:
        xt, mask_t = _tile_t(x_ptr, M, K, pid_m, pid_k, BM, BK)
        _store_transposed(t_ptr, xt, s, rm, rk, mask_t, M, FMT_MAX, OUT)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(sinv_ptr, _recip(s))


@triton.jit
def _cast_tile(x_ptr, M, K, t, n_k, s, data_ptr, t_ptr, sinv_ptr, FMT_MAX: tl.constexpr,
               ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr):
    """Cast tile t (row-major over the (M, K) tile grid) with scale s."""
    pid_m, pid_k = t // n_k, t % n_k
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    _store_fp8_copies(x, s, rm, rk, mask, x_ptr, M, K, pid_m, pid_k, data_ptr, t_ptr, sinv_ptr,
                      FMT_MAX, ROW, COL, OUT, BM, BK)


@triton.jit
def _fp8_tensorwise_kernel(x_ptr, M, K, amax_ptr, n_parts, scale_ptr, data_ptr, t_ptr, sinv_ptr,
                           hist_ptr, new_hist_ptr, new_scale_ptr, L, N,
                           FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                           FROM_AMAX: tl.constexpr, RECORD_AMAX: tl.constexpr,
                           ROW: tl.constexpr, COL: tl.constexpr, OUT: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr,
                           SLOT: tl.constexpr, STEP: tl.constexpr, STEP_MAX: tl.constexpr,
                           MARGIN_FACTOR: tl.constexpr, MOST_RECENT: tl.constexpr,
                           BL: tl.constexpr, BN: tl.constexpr):
    """FROM_AMAX: the scale from the n_parts int32 partial maxima at
    amax_ptr; else the fp32 scale at scale_ptr, and RECORD_AMAX raises the
    zeroed fp32 slot amax_ptr[SLOT] to this tensor's max |x| (atomic max of
    the bits).  STEP (with RECORD_AMAX, the last amax of an op call): the
    program that finishes last (counted in amax_ptr[STEP_COUNTER], zeroed)
    then runs the delayed-scaling step over the (L, N) history with the N
    amaxes, as ``_delayed_step_kernel`` does, so the step needs no launch
    of its own; all N columns in one (BL, BN) tile, which keeps the last
    program's tail short.  Every program reads the scale before it is
    counted, so new_scale_ptr may hold the scale read here."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    if FROM_AMAX:
        s = _scale_from_parts(amax_ptr, n_parts, FMT_MAX, EPS, POW2, NP)
    else:
        s = tl.load(scale_ptr).to(tl.float32)
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    if RECORD_AMAX:
        tl.atomic_max(_int_slot(amax_ptr + SLOT),
                      tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    _store_fp8_copies(x, s, rm, rk, mask, x_ptr, M, K, pid_m, pid_k, data_ptr, t_ptr, sinv_ptr,
                      FMT_MAX, ROW, COL, OUT, BM, BK)
    if STEP:  # counted after the stores (before them the wait on the count delays them)
        tl.debug_barrier()  # the scale is read and the amax raised before the count
        done = tl.atomic_add(_int_slot(amax_ptr + _STEP_COUNTER), 1)  # acq_rel
        if done == tl.num_programs(0) * tl.num_programs(1) - 1:
            _step_tile(hist_ptr, amax_ptr, new_hist_ptr, new_scale_ptr, L, N, STEP_MAX,
                       MARGIN_FACTOR, MOST_RECENT, BL, BN)


@triton.jit
def _fp8_current_pair_kernel(a_ptr, Ma, Ka, b_ptr, Mb, Kb, part_ptr, Pa, Pb,
                             a_data, a_t, a_sinv, b_data, b_t, b_sinv,
                             FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                             A_ROW: tl.constexpr, A_COL: tl.constexpr, B_ROW: tl.constexpr,
                             B_COL: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr, NP: tl.constexpr):
    """The cast pass of two current-scaling quantizations: programs
    [0, tiles of a) cast a's tiles with the scale of part_ptr[:Pa], the
    rest b's with that of the Pb maxima after them (1-D grid)."""
    pid = tl.program_id(0)
    nka = tl.cdiv(Ka, BK)
    ta = tl.cdiv(Ma, BM) * nka
    if pid < ta:
        s = _scale_from_parts(part_ptr, Pa, FMT_MAX, EPS, POW2, NP)
        _cast_tile(a_ptr, Ma, Ka, pid, nka, s, a_data, a_t, a_sinv, FMT_MAX, A_ROW, A_COL, OUT,
                   BM, BK)
    else:
        s = _scale_from_parts(part_ptr + Pa, Pb, FMT_MAX, EPS, POW2, NP)
        _cast_tile(b_ptr, Mb, Kb, pid - ta, tl.cdiv(Kb, BK), s, b_data, b_t, b_sinv, FMT_MAX,
                   B_ROW, B_COL, OUT, BM, BK)


_TW_BM, _TW_BK = 64, 128
_STEP_COUNTER = tl.constexpr(ref.STEP_COUNTER)
_AMAX_BM, _AMAX_BK = 64, 256
_MAX_PARTS = 256  # programs of the amax pass (a power of two: the cast pass loads them all)
_MAX_GIVEN_PARTS = 1024  # partial maxima a caller may give quantize_fp8_current
_amax_launch = Launcher(_amax_kernel)
_amax_partials_launch = Launcher(_amax_partials_kernel)
_fp8_tensorwise_launch = Launcher(_fp8_tensorwise_kernel)
_amax_partials_pair_launch = Launcher(_amax_partials_pair_kernel)
_fp8_current_pair_launch = Launcher(_fp8_current_pair_kernel)


def amax(x: torch.Tensor, out=None) -> torch.Tensor:
    """reference.amax: max |x| as a 0-dim fp32 tensor, or raised into the
    ``AmaxSlot`` ``out`` (the kernel takes the whole vector, see AmaxSlot)."""
    if x.numel() == 0 or x.dim() == 0:
        return ref.amax(x, out)
    x2d = _matrix(x.detach().reshape(-1, x.shape[-1]))
    m, k = x2d.shape
    if out is None:
        vector, index = torch.zeros(1, dtype=torch.float32, device=x2d.device), 0
    else:
        vector, index = out.amaxes, out.index
    launcher, grid, key, args = amax_call(x2d, vector, index)
    launcher(grid, key, *args)
    return vector.reshape(()) if out is None else out.element()


def amax_call(x2d: torch.Tensor, vector: torch.Tensor, index: int) -> tuple:
    """The launch of :func:`amax` on a contiguous ``x2d`` raising ``vector[index]``:
    ``(launcher, grid, key, args)`` (the native eager path fixes the same launch)."""
    m, k = x2d.shape
    return (_amax_launch, (cdiv(m, _AMAX_BM), cdiv(k, _AMAX_BK)),
            (_x_key(x2d, m, k), ptr_key(vector), int_key(index)),
            (x2d, m, k, vector, index, _AMAX_BM, _AMAX_BK))


def _fp8_outputs(like, dt, m, k, rowwise, columnwise) -> dict:
    """The buffers an FP8 cast writes, on ``like``'s device (one allocation call)."""
    specs = {"scale_inv": ((1,), torch.float32)}
    if rowwise:
        specs["data"] = ((m, k), dt)
    if columnwise:
        specs["transpose"] = ((k, m), dt)
    return dict(zip(specs, native.empty_many(like, *specs.values())))


def _fp8_copy_args(out: dict, src: torch.Tensor) -> tuple:
    """data, transpose, scale_inv pointers; an absent copy gets ``src``, the
    kernel's input (never written: :func:`_unused`)."""
    return (out["data"] if "data" in out else _unused(src),
            out["transpose"] if "transpose" in out else _unused(src), out["scale_inv"])


def _n_amax_parts(m, k) -> int:
    """Programs of the amax pass over an (m, k) matrix."""
    return min(cdiv(m, _AMAX_BM) * cdiv(k, _AMAX_BK), _MAX_PARTS)


def _fp8_tensorwise(x2d, fmt, rowwise, columnwise, *, scale=None, amax_out=None,
                    pow2=False, eps=0.0, amax_parts=None) -> dict:
    """Current scaling without ``scale`` (amax pass, then cast; the cast
    alone when the partial maxima ``amax_parts`` are given), else the cast
    with ``scale``, recording the amax into ``amax_out`` when given."""
    launches, out = fp8_tensorwise_calls(_matrix(x2d), fmt, rowwise, columnwise, scale=scale,
                                         amax_out=amax_out, pow2=pow2, eps=eps,
                                         amax_parts=amax_parts)
    for launcher, grid, key, args in launches:
        launcher(grid, key, *args)
    return out


def fp8_tensorwise_calls(x2d, fmt, rowwise, columnwise, *, scale=None, amax_out=None,
                         pow2=False, eps=0.0, amax_parts=None) -> tuple:
    """The launches of :func:`_fp8_tensorwise` on a contiguous ``x2d``, in
    order: ``(launches, out)``, each launch ``(launcher, grid, key, args)``,
    ``out`` the buffers they write (the native eager path fixes the same
    launches, kernels/native.py).  The allocations are made here."""
    m, k = x2d.shape
    launches = []
    out = _fp8_outputs(x2d, ref.FP8_DTYPE[fmt], m, k, rowwise, columnwise)
    dev = x2d.device
    xkey = _x_key(x2d, m, k)
    slot, index = None, 0  # delayed scaling's amax slot and its index in amax_arg
    if scale is None and amax_parts is not None:
        n_parts = amax_parts.shape[0]
        amax_arg, scale_arg = amax_parts.view(torch.int32), out["scale_inv"]
        key = (xkey, int_key(n_parts), ptr_key(amax_arg))
    elif scale is None:
        n_parts = _n_amax_parts(m, k)
        parts = torch.empty(n_parts, dtype=torch.int32, device=dev)
        key = (xkey, int_key(n_parts))
        launches.append((_amax_partials_launch, (n_parts,), key,
                         (x2d, m, k, parts, n_parts, _AMAX_BM, _AMAX_BK)))
        amax_arg, scale_arg = parts, out["scale_inv"]
    else:
        n_parts = 0
        slot = ref.amax_slot(amax_out)
        # fp32 (the kernel casts the slot's pointer); the whole vector, see AmaxSlot
        amax_arg = out["scale_inv"] if slot is None else slot.amaxes
        index = 0 if slot is None else slot.index
        scale_arg = scale
        key = (xkey, ptr_key(scale), ptr_key(amax_arg))
    grid = (cdiv(m, _TW_BM), cdiv(k, _TW_BK))
    flags = (fmt, float(eps), bool(pow2), scale is None, amax_out is not None, bool(rowwise),
             bool(columnwise))
    n_load = _MAX_PARTS if n_parts <= _MAX_PARTS else 1 << (n_parts - 1).bit_length()
    step = None if scale is None or slot is None else slot.step
    step_args, step_consts = _step_args(step, x2d, grid[0] * grid[1])
    step_key = step_consts + tuple(int_key(v) for v in step_args[3:])
    launches.append((_fp8_tensorwise_launch, grid, (key, flags, n_load, index, step_key),
                     (x2d, m, k, amax_arg, n_parts, scale_arg, *_fp8_copy_args(out, x2d),
                      *step_args, ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], _TW_BM, _TW_BK,
                      n_load, index, *step_consts)))
    if step is not None and not step_consts[0]:
        launches.append(_step_call(step.history, amax_arg, step.new_history, step.new_scale,
                                   step.fmt, step.margin, step.algo))
    return launches, out


_MAX_STEP_TILE = 4096  # history elements the cast kernel's last program steps over
# Cast programs beyond which the step is a launch of its own: every program's
# count is an atomic on one address, ~1.8 ns of GPU time each (measured on
# an H200 in the llama-a DelayedScaling step), against ~2 us for the step kernel
# and ~20 us of host time for its launch.
_MAX_STEP_PROGRAMS = 2048


def _step_args(step, x2d, programs: int) -> tuple:
    """(history, new history, new scale, L, N), (STEP, STEP_MAX, MARGIN_FACTOR,
    MOST_RECENT, BL, BN) of the cast kernel of ``programs`` programs for a
    ``reference.StepAfter`` it runs, or for none (a history longer than one
    tile, or a large grid: then the step is a launch of its own).  Without a
    step the pointers are the kernel's input (``_unused``)."""
    if (step is None or _step_tile_size(step.history) > _MAX_STEP_TILE
            or step.history.shape[1] > ref.STEP_COUNTER or programs > _MAX_STEP_PROGRAMS):
        return (_unused(x2d),) * 3 + (0, 0), (False, 1.0, 1.0, False, 1, 1)
    n_len, n_cols = step.history.shape
    return ((step.history, step.new_history, step.new_scale, n_len, n_cols),
            (True, ref.FP8_MAX[step.fmt], 2.0 ** -step.margin, step.algo == "most_recent",
             next_pow2(n_len), next_pow2(n_cols)))


def _step_tile_size(history) -> int:
    return next_pow2(history.shape[0]) * next_pow2(history.shape[1])


def quantize_fp8_tensorwise(x2d, scale, fmt, rowwise, columnwise, amax_out=None) -> dict:
    if x2d.numel() == 0:
        return ref.quantize_fp8_tensorwise(x2d, scale, fmt, rowwise, columnwise, amax_out)
    if scale.dtype != torch.float32:
        scale = scale.float()
    return _fp8_tensorwise(x2d, fmt, rowwise, columnwise, scale=scale, amax_out=amax_out)


def quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise, amax=None) -> dict:
    """``amax``: 1-D fp32 partial maxima (at most ``_MAX_GIVEN_PARTS``) computed
    elsewhere (the normalisation that produced x2d, a tensor-parallel
    all-reduce): the scale comes from their max and the amax pass is skipped."""
    if x2d.numel() == 0 or (amax is not None and (
            amax.dim() != 1 or amax.shape[0] > _MAX_GIVEN_PARTS or amax.dtype != torch.float32
            or not amax.is_contiguous())):
        return ref.quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise, amax)
    return _fp8_tensorwise(x2d, fmt, rowwise, columnwise, pow2=pow2, eps=eps, amax_parts=amax)


def quantize_fp8_current_pair(a2d, b2d, fmt, pow2, eps, a_usage, b_usage) -> tuple:
    """reference.quantize_fp8_current_pair in two launches instead of four:
    one amax pass over both matrices, one cast pass over both (a layer's
    input and weight; ``triton_current`` does it in one where it may)."""
    if a2d.numel() == 0 or b2d.numel() == 0:
        return (quantize_fp8_current(a2d, fmt, pow2, eps, *a_usage),
                quantize_fp8_current(b2d, fmt, pow2, eps, *b_usage))
    a2d, b2d = _matrix(a2d), _matrix(b2d)
    (ma, ka), (mb, kb) = a2d.shape, b2d.shape
    pa, pb = _n_amax_parts(ma, ka), _n_amax_parts(mb, kb)
    parts = torch.empty(pa + pb, dtype=torch.int32, device=a2d.device)
    key = (_x_key(a2d, ma, ka), _x_key(b2d, mb, kb), int_key(pa), int_key(pb))
    _amax_partials_pair_launch((pa + pb,), key, a2d, ma, ka, b2d, mb, kb, parts, pa, pb,
                               _AMAX_BM, _AMAX_BK)
    return _fp8_current_pair_cast(a2d, b2d, parts, pa, pb, fmt, pow2, eps, a_usage, b_usage, key,
                                  _MAX_PARTS)


def quantize_fp8_current_pair_from_parts(a2d, b2d, parts, n_a, fmt, pow2, eps, a_usage,
                                         b_usage) -> tuple:
    """reference.quantize_fp8_current_pair_from_parts: the cast pass of
    :func:`quantize_fp8_current_pair` alone, one launch for both matrices
    (the partial maxima came from the normalisation that produced a2d)."""
    n_b = parts.shape[0] - n_a
    if (a2d.numel() == 0 or b2d.numel() == 0 or parts.dim() != 1 or not parts.is_contiguous()
            or parts.dtype != torch.float32 or max(n_a, n_b) > _MAX_GIVEN_PARTS
            or min(n_a, n_b) < 1):
        return ref.quantize_fp8_current_pair_from_parts(a2d, b2d, parts, n_a, fmt, pow2, eps,
                                                        a_usage, b_usage)
    a2d, b2d = _matrix(a2d), _matrix(b2d)
    (ma, ka), (mb, kb) = a2d.shape, b2d.shape
    parts = parts.view(torch.int32)
    key = (_x_key(a2d, ma, ka), _x_key(b2d, mb, kb), int_key(n_a), int_key(n_b),
           ptr_key(parts), _MAX_GIVEN_PARTS)
    return _fp8_current_pair_cast(a2d, b2d, parts, n_a, n_b, fmt, pow2, eps, a_usage, b_usage,
                                  key, _MAX_GIVEN_PARTS)


def _fp8_current_pair_cast(a2d, b2d, parts, pa, pb, fmt, pow2, eps, a_usage, b_usage, key,
                           n_load) -> tuple:
    """The one cast launch of a pair: a's scale from the int32 bits of
    parts[:pa], b's from the pb after them (``n_load``: a power of two >= both;
    a constant, so a symbolic token count needs no guard on it)."""
    (ma, ka), (mb, kb) = a2d.shape, b2d.shape
    dt = ref.FP8_DTYPE[fmt]
    out_a = _fp8_outputs(a2d, dt, ma, ka, *a_usage)
    out_b = _fp8_outputs(a2d, dt, mb, kb, *b_usage)
    flags = (fmt, float(eps), bool(pow2), bool(a_usage[0]), bool(a_usage[1]),
             bool(b_usage[0]), bool(b_usage[1]))
    tiles = cdiv(ma, _TW_BM) * cdiv(ka, _TW_BK) + cdiv(mb, _TW_BM) * cdiv(kb, _TW_BK)
    _fp8_current_pair_launch((tiles,), (key, flags), a2d, ma, ka, b2d, mb, kb, parts, pa, pb,
                             *_fp8_copy_args(out_a, a2d), *_fp8_copy_args(out_b, b2d),
                             ref.FP8_MAX[fmt],
                             *flags[1:], _TL_FP8[fmt], _TW_BM, _TW_BK, n_load)
    return out_a, out_b


# -- delayed scaling ---------------------------------------------------------------------
@triton.jit
def _step_scale(top, FMT_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr):
    """reference.compute_scale of the history's max ``top``."""
    s = _recip(top) * FMT_MAX * MARGIN_FACTOR
    s = tl.where(s == float("inf"), _FP32_MAX, s)
    return tl.where((top > 0) & (top == top) & (top != float("inf")), s, 1.0)


@triton.jit
def _step_column(hist_ptr, a, new_hist_ptr, new_scale_ptr, L, N, j, FMT_MAX: tl.constexpr,
                 MARGIN_FACTOR: tl.constexpr, MOST_RECENT: tl.constexpr, BL: tl.constexpr):
    """reference.delayed_scaling_step for column j of the (L, N) history with
    this step's amax ``a``: row 0 becomes a, the scale comes from the max of
    the column (or row 0), then the column rolls down and row 0 is zeroed.
    new_hist_ptr may be hist_ptr (in place): every load precedes the barrier."""
    rows = tl.arange(0, BL)
    h = tl.load(hist_ptr + rows * N + j, mask=(rows > 0) & (rows < L), other=0.0)
    h = tl.where(rows == 0, a, h)
    if MOST_RECENT:
        top = a
    else:  # max over the bits of non-negative floats: NaN wins, as torch.amax
        top = tl.max(h.to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
    s = _step_scale(top, FMT_MAX, MARGIN_FACTOR)
    # rolled: new[i] = h[i - 1] for i >= 1, new[0] = 0
    prev = tl.load(hist_ptr + (rows - 1) * N + j, mask=(rows > 1) & (rows < L), other=0.0)
    prev = tl.where(rows == 1, a, prev)
    tl.debug_barrier()  # all of the column read before any of it is overwritten
    tl.store(new_scale_ptr + j, s)
    tl.store(new_hist_ptr + rows * N + j, prev, mask=rows < L)


@triton.jit
def _step_tile(hist_ptr, amax_ptr, new_hist_ptr, new_scale_ptr, L, N, FMT_MAX: tl.constexpr,
               MARGIN_FACTOR: tl.constexpr, MOST_RECENT: tl.constexpr, BL: tl.constexpr,
               BN: tl.constexpr):
    """:func:`_step_column` for all N columns at once, a (BL, BN) tile (one
    round of loads instead of one per column), the amaxes read past L1."""
    rows = tl.arange(0, BL)[:, None]
    cols = tl.arange(0, BN)[None, :]
    col_ok = cols < N
    a = tl.load(amax_ptr + cols, mask=col_ok, other=0.0, volatile=True)
    h = tl.load(hist_ptr + rows * N + cols, mask=(rows > 0) & (rows < L) & col_ok, other=0.0)
    prev = tl.load(hist_ptr + (rows - 1) * N + cols, mask=(rows > 1) & (rows < L) & col_ok,
                   other=0.0)
    h = tl.where(rows == 0, a, h)
    if MOST_RECENT:
        h = a
    top = tl.max(h.to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
    s = _step_scale(top, FMT_MAX, MARGIN_FACTOR)
    prev = tl.where(rows == 1, a, prev)
    tl.debug_barrier()  # all of the history read before any of it is overwritten
    tl.store(new_scale_ptr + tl.arange(0, BN), s, mask=tl.arange(0, BN) < N)
    tl.store(new_hist_ptr + rows * N + cols, prev, mask=(rows < L) & col_ok)


@triton.jit
def _delayed_step_kernel(hist_ptr, amax_ptr, new_hist_ptr, new_scale_ptr, L, N,
                         FMT_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr,
                         MOST_RECENT: tl.constexpr, BL: tl.constexpr):
    """The delayed-scaling step of column j = program_id(0) (:func:`_step_column`)."""
    j = tl.program_id(0)
    _step_column(hist_ptr, tl.load(amax_ptr + j), new_hist_ptr, new_scale_ptr, L, N, j,
                 FMT_MAX, MARGIN_FACTOR, MOST_RECENT, BL)


_delayed_step_launch = Launcher(_delayed_step_kernel, num_warps=4)


def delayed_scaling_step(amax_history, amaxes, fmt, margin, algo) -> tuple:
    """``reference.delayed_scaling_step`` as one launch (:func:`run_step`), into new buffers."""
    shape = amax_history.shape
    hist = amax_history.reshape(shape[0], -1)
    step = ref.StepAfter(hist, torch.empty_like(hist),
                         torch.empty(hist.shape[1], dtype=torch.float32, device=hist.device),
                         fmt, margin, algo)
    run_step(step, amaxes.reshape(-1))
    return step.new_history.reshape(shape), step.new_scale.reshape(shape[1:])


def run_step(step, amaxes) -> None:
    """``reference.run_step``: the :class:`reference.StepAfter` as a launch of
    its own.  Inside a lowered trace its outputs are the history and scale
    buffers themselves (``Float8DelayedScalingQuantizer.step_after``): the
    kernel is traced as writing over them, functionalized, and inductor's
    reinplacing pass then drops the two copies that fresh outputs cost."""
    hist = step.history
    if (hist.dim() != 2 or hist.shape[0] > 65536 or not hist.is_contiguous()
            or not step.new_history.is_contiguous() or not step.new_scale.is_contiguous()
            or step.new_scale.dtype != torch.float32 or step.new_scale.numel() != hist.shape[1]):
        ref.run_step(step, amaxes)
        return
    n_cols = hist.shape[1]
    _step_into(hist, amaxes[:n_cols].reshape(-1).float().contiguous(), step.new_history,
               step.new_scale, step.fmt, step.margin, step.algo)


def _step_into(hist, amaxes, new_hist, new_scale, fmt, margin, algo) -> None:
    """One step launch over the contiguous (L, n) ``hist`` into ``new_hist``
    (which may be ``hist``) and ``new_scale``."""
    launcher, grid, key, args = _step_call(hist, amaxes, new_hist, new_scale, fmt, margin, algo)
    launcher(grid, key, *args)


def _step_call(hist, amaxes, new_hist, new_scale, fmt, margin, algo) -> tuple:
    """The launch of :func:`_step_into`: ``(launcher, grid, key, args)``."""
    n_len, n_cols = hist.shape
    consts = (ref.FP8_MAX[fmt], 2.0 ** -margin, algo == "most_recent",
              next_pow2(n_len))
    return (_delayed_step_launch, (n_cols,),
            (ptr_key(amaxes), int_key(n_len), int_key(n_cols), consts),
            (hist, amaxes, new_hist, new_scale, n_len, n_cols, *consts))
