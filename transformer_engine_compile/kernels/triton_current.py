"""FP8 current scaling in one launch, in Triton (the registered CUDA kernels).

A current-scaling quantization (one tensor, or a layer's input and weight
together) needs the amax of the whole tensor before any element is cast.
:func:`_fp8_current_kernel` does both passes in one launch: its programs
claim amax tiles, wait until every tile is counted, then compute the scale
on the device and write the rowwise copy, the transposed copy and
``scale_inv``, bit for bit as the reference.  The counters live in a
zeroed slot of ``grid_state.py``'s pool.  Where no slot may be used (CUDA
graph capture, AOTInductor, a graph that does not name the pool) the
two-launch kernels of ``triton_quant.py`` run instead.  One launch saves
its host time (~11-13 us per call in a lowered llama-a step) for 0-4 us
more GPU time per call (``benchmarks --configs llama-a`` on an H200).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import grid_state, triton_launch
from . import reference as ref
from . import triton_quant as tq
from .triton_quant import (_TL_FP8, _TW_BK, _TW_BM, _abs_bits, _cast_tile,
                           _fp8_copy_args, _fp8_outputs, _load_tile, _matrix, _scale_from_amax,
                           _tile_index, _unused, _x_key)
from .triton_launch import Launcher, cdiv, int_key


@triton.jit
def _slot_ptr(lo, hi):
    """The int32 counters at address ``hi * 2**31 + lo`` (grid_state.py).
    ``tl.cast``, not ``.to``: torch's mutation analysis of a traced kernel
    passes ints as Python constants, and a failed analysis counts every
    input as written (inductor then copies each before the launch)."""
    return ((tl.cast(hi, tl.int64) << 31) | tl.cast(lo, tl.int64)).to(tl.pointer_type(tl.int32))


@triton.jit
def _wait_until_counted(counter, total):
    """Spin until the int32 at ``counter`` reaches ``total``, read by one
    thread of the program (the others hold masked lanes; the max shares
    its value).  When every thread of every waiting program read it, the
    loads queued at the counter's L2 slice ahead of the last programs'
    atomic adds, and the wait took ~5 us longer on an H200.  Plain
    Triton, no asm: torch
    analyses a traced kernel's mutations, and inline asm with side effects
    makes that analysis fail (inductor then copies every input)."""
    lane = tl.arange(0, 256)  # one lane per thread of 8 warps: lane 0 is one thread's
    n = tl.zeros((), dtype=tl.int32)
    while n < total:
        n = tl.max(tl.load(counter + lane * 0, mask=lane == 0, other=0, volatile=True), axis=0)


@triton.jit
def _pair_tiles(Ma, Ka, Mb, Kb, HAS_B: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Over (BM, BK) tiles, row-major, a's first: a's tiles per row, a's
    tiles, b's tiles per row, and all tiles (a's alone without b)."""
    nka = tl.cdiv(Ka, BK)
    ta = tl.cdiv(Ma, BM) * nka
    nkb = tl.cdiv(Kb, BK)
    total = ta
    if HAS_B:
        total = ta + tl.cdiv(Mb, BM) * nkb
    return nka, ta, nkb, total


@triton.jit
def _arrive_and_wait(slot, done, total):
    """Count this program's ``done`` tiles at [32] (after its maxima were
    raised at [64:68]) and wait until all ``total`` are counted; the loads
    after it see every maximum raised."""
    tl.debug_barrier()
    tl.atomic_add(slot + 32, done, sem="release")
    _wait_until_counted(slot + 32, total)
    tl.atomic_add(slot + 32, 0, sem="acquire")  # the loads below see every max raised
    tl.debug_barrier()  # and those of the threads that did not take part in the acquire


@triton.jit
def _leave(slot):
    """Count this program as gone at [96]; the last one zeroes the slot for
    the next kernel."""
    tl.debug_barrier()  # the maxima are read before this program counts as gone
    if tl.atomic_add(slot + 96, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        # plain stores: every other program's atomics happen before this
        # one's acquire, and nothing reads the slot until the next kernel
        # (an atomic exchange waits for its old value, one after the other)
        tl.store(slot, 0)
        tl.store(slot + 32, 0)
        tl.store(slot + 64, 0)
        tl.store(slot + 65, 0)
        tl.store(slot + 66, 0)
        tl.store(slot + 67, 0)
        tl.store(slot + 96, 0)


@triton.jit
def _tile_max_bits(x_ptr, M, K, t, n_k, BM: tl.constexpr, BK: tl.constexpr):
    """Max ``_abs_bits`` of tile t (row-major over the (M, K) tile grid)."""
    rm, rk, mask = _tile_index(M, K, t // n_k, t % n_k, BM, BK)
    return tl.max(tl.max(_abs_bits(_load_tile(x_ptr, rm, rk, mask, K)), axis=1), axis=0)


@triton.jit
def _fp8_current_kernel(a_ptr, Ma, Ka, b_ptr, Mb, Kb, lo, hi, a_data, a_t, a_sinv, b_data, b_t,
                        b_sinv, FMT_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                        A_ROW: tl.constexpr, A_COL: tl.constexpr, B_ROW: tl.constexpr,
                        B_COL: tl.constexpr, HAS_B: tl.constexpr, OUT: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr):
    """Current scaling of a (and b) in one launch, with the zeroed counters
    of slot (lo, hi): [0] next amax tile to claim, [32] tiles done, [64] and
    [65] a's and b's max |x| bits, [96] programs gone (each on its own
    128-byte line, as the waiting programs poll [32]).

    Programs claim tiles (a's, then b's; the next claim in flight while a
    tile loads) until none is left, so the amax pass never waits for a
    program that is not running: any grid size is safe.  Each then adds
    its count to [32], waits for all tiles and casts its share, in reverse
    (the last-read tiles first, still in L2); the last program to finish
    zeroes the slot for the next kernel."""
    slot = _slot_ptr(lo, hi)
    nka, ta, nkb, total = _pair_tiles(Ma, Ka, Mb, Kb, HAS_B, BM, BK)
    amax_a = tl.zeros((), dtype=tl.int32)
    amax_b = tl.zeros((), dtype=tl.int32)
    done = 0
    t = tl.atomic_add(slot, 1, sem="relaxed")
    while t < total:
        after = tl.atomic_add(slot, 1, sem="relaxed")  # claimed while tile t loads
        if t < ta:
            amax_a = tl.maximum(amax_a, _tile_max_bits(a_ptr, Ma, Ka, t, nka, BM, BK))
        else:
            if HAS_B:
                amax_b = tl.maximum(amax_b, _tile_max_bits(b_ptr, Mb, Kb, t - ta, nkb, BM, BK))
        done += 1
        t = after
    tl.atomic_max(slot + 64, amax_a, sem="relaxed")
    if HAS_B:
        tl.atomic_max(slot + 65, amax_b, sem="relaxed")
    _arrive_and_wait(slot, done, total)
    sa = _scale_from_amax(tl.load(slot + 64, volatile=True).to(tl.float32, bitcast=True),
                          FMT_MAX, EPS, POW2)
    sb = sa
    if HAS_B:
        sb = _scale_from_amax(tl.load(slot + 65, volatile=True).to(tl.float32, bitcast=True),
                              FMT_MAX, EPS, POW2)
    for r in range(tl.program_id(0), total, tl.num_programs(0)):
        u = total - 1 - r
        if u < ta:
            _cast_tile(a_ptr, Ma, Ka, u, nka, sa, a_data, a_t, a_sinv, FMT_MAX, A_ROW, A_COL, OUT,
                       BM, BK)
        else:
            if HAS_B:
                _cast_tile(b_ptr, Mb, Kb, u - ta, nkb, sb, b_data, b_t, b_sinv, FMT_MAX, B_ROW,
                           B_COL, OUT, BM, BK)
    _leave(slot)


_fp8_current_launch = Launcher(_fp8_current_kernel)
_CURRENT_PROGRAMS_PER_SM = 4  # of 8 warps (H200: the fastest of 2, 4, 8, 16; tiles 64 x 128)


def quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise, amax=None) -> dict:
    """``triton_quant.quantize_fp8_current`` in one launch where it may
    (without given partial maxima ``amax``)."""
    if amax is None and x2d.numel() > 0:
        x2d = _matrix(x2d)
        out = _one_launch(x2d, None, fmt, pow2, eps, (rowwise, columnwise))
        if out is not None:
            return out[0]
    return tq.quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise, amax)


def quantize_fp8_current_pair(a2d, b2d, fmt, pow2, eps, a_usage, b_usage) -> tuple:
    """``triton_quant.quantize_fp8_current_pair`` in one launch where it may."""
    if a2d.numel() > 0 and b2d.numel() > 0:
        a2d, b2d = _matrix(a2d), _matrix(b2d)
        outs = _one_launch(a2d, b2d, fmt, pow2, eps, a_usage, b_usage)
        if outs is not None:
            return outs
    return tq.quantize_fp8_current_pair(a2d, b2d, fmt, pow2, eps, a_usage, b_usage)


def _one_launch(a2d, b2d, fmt, pow2, eps, a_usage, b_usage=(False, False)):
    """``(buffers of a2d, of b2d or None)`` by :func:`_fp8_current_kernel`
    (contiguous, non-empty matrices), or None where no counter slot may be
    used (``grid_state.slot``)."""
    slot = grid_state.slot(a2d.device)
    if slot is None:
        return None
    grid, key, args, out_a, out_b = one_launch_call(a2d, b2d, fmt, pow2, eps, a_usage, b_usage,
                                                    slot)
    _fp8_current_launch(grid, key, *args)
    return out_a, out_b


def one_launch_call(a2d, b2d, fmt, pow2, eps, a_usage, b_usage, slot) -> tuple:
    """``(grid, key, args, out_a, out_b)`` of one :func:`_fp8_current_kernel`
    launch with counter slot ``slot`` (``(lo, hi)``), its outputs allocated;
    the native eager path (kernels/native.py) fixes its plans from these.  At
    most 4 programs of 8 warps per SM: the amax pass claims its tiles, so
    more would only wait."""
    dt, dev = ref.FP8_DTYPE[fmt], a2d.device
    (ma, ka), has_b = a2d.shape, b2d is not None
    out_a = _fp8_outputs(a2d, dt, ma, ka, *a_usage)
    tiles = cdiv(ma, _TW_BM) * cdiv(ka, _TW_BK)
    if has_b:
        mb, kb = b2d.shape
        tiles += cdiv(mb, _TW_BM) * cdiv(kb, _TW_BK)
        out_b = _fp8_outputs(a2d, dt, mb, kb, *b_usage)
        b_args, b_copies, b_key = (b2d, mb, kb), _fp8_copy_args(out_b, b2d), _x_key(b2d, mb, kb)
    else:  # b's pointers are never read or written (HAS_B is a constexpr): a's input
        out_b, b_args, b_key = None, (_unused(a2d), 1, 1), None
        b_copies = (_unused(a2d),) * 3
    flags = (fmt, float(eps), bool(pow2), bool(a_usage[0]), bool(a_usage[1]), bool(b_usage[0]),
             bool(b_usage[1]), has_b)
    lo, hi = slot
    programs = min(tiles, triton_launch.sm_count(dev) * _CURRENT_PROGRAMS_PER_SM)
    key = (_x_key(a2d, ma, ka), b_key, flags, int_key(lo), int_key(hi))
    args = (a2d, ma, ka, *b_args, lo, hi, *_fp8_copy_args(out_a, a2d), *b_copies,
            ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], _TW_BM, _TW_BK)
    return (programs,), key, args, out_a, out_b
