"""Delayed scaling's casts of an op call in one launch, in Triton.

Under DelayedScaling a forward casts x and W with the layer's scales (known
before the call), records both amaxes, then steps the history once both
are in; a backward does the same for dy alone.  The two-launch way
(``triton_quant._fp8_tensorwise_kernel`` per tensor) raises the amaxes in
a vector the caller zeroes first (``torch.zeros``: a fill kernel and ~12 us
of host time) and runs the step in the last cast's last program.
:func:`_fp8_delayed_kernel` casts both tensors in one 1-D launch and keeps
the amaxes in a counter slot of ``grid_state.py``'s pool, which is zero
when the kernel starts; the last program to finish steps the history and
zeroes the slot again.  Bit for bit the two-launch result (the same casts;
an amax is a max, whatever the order).

Where no slot may be used (a CUDA graph being captured, a lowered graph
that does not name the pool), or the step does not fit in one program
(``triton_quant._step_args``), the two launches run instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import grid_state
from . import reference as ref
from . import triton_quant as tq
from .triton_current import _slot_ptr
from .triton_launch import Launcher, cdiv, int_key, ptr_key
from .triton_quant import (_TL_FP8, _TW_BK, _TW_BM, _abs_bits, _fp8_copy_args, _fp8_outputs,
                           _load_tile, _step_tile, _store_fp8_copies, _tile_index, _unused,
                           _x_key)

_AMAX = 64  # the slot's int32 words: this call's amaxes from here (one per history column)
_GONE = 96  # programs done


@triton.jit
def _cast_and_raise(x_ptr, M, K, t, s, amax_ptr, data_ptr, t_ptr, sinv_ptr,
                    FMT_MAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                    OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Cast tile t (row-major over the tile grid) of the (M, K) matrix with
    scale s, raising the int32 max at amax_ptr to the tile's |x| bits;
    without either copy (ROW and COL False) only the max, nothing written."""
    n_k = tl.cdiv(K, BK)
    pid_m, pid_k = t // n_k, t % n_k
    rm, rk, mask = _tile_index(M, K, pid_m, pid_k, BM, BK)
    x = _load_tile(x_ptr, rm, rk, mask, K)
    tl.atomic_max(amax_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    if ROW or COL:
        _store_fp8_copies(x, s, rm, rk, mask, x_ptr, M, K, pid_m, pid_k, data_ptr, t_ptr,
                          sinv_ptr, FMT_MAX, ROW, COL, OUT, BM, BK)


@triton.jit
def _fp8_delayed_kernel(a_ptr, Ma, Ka, b_ptr, Mb, Kb, lo, hi, scale_ptr,
                        a_data, a_t, a_sinv, b_data, b_t, b_sinv,
                        hist_ptr, new_hist_ptr, new_scale_ptr, L, N,
                        FMT_MAX: tl.constexpr, A_ROW: tl.constexpr, A_COL: tl.constexpr,
                        B_ROW: tl.constexpr, B_COL: tl.constexpr, HAS_B: tl.constexpr,
                        OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                        STEP_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr,
                        MOST_RECENT: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr):
    """Programs [0, tiles of a) cast a with scale_ptr[0], the rest b with
    scale_ptr[1], raising the amaxes in words [64] and [65] of the zeroed
    slot (lo, hi).  The last program to count itself in [96] then runs the
    delayed-scaling step over the (L, N) history with the N amaxes from
    [64] (``triton_quant._step_tile``; the history's other columns: zero)
    and zeroes the slot.  Every program reads its scale before it counts,
    so new_scale_ptr may be scale_ptr."""
    slot = _slot_ptr(lo, hi)
    pid = tl.program_id(0)
    ta = tl.cdiv(Ma, BM) * tl.cdiv(Ka, BK)
    if pid < ta:
        _cast_and_raise(a_ptr, Ma, Ka, pid, tl.load(scale_ptr), slot + 64, a_data, a_t, a_sinv,
                        FMT_MAX, A_ROW, A_COL, OUT, BM, BK)
    else:
        if HAS_B:
            _cast_and_raise(b_ptr, Mb, Kb, pid - ta, tl.load(scale_ptr + 1), slot + 65, b_data,
                            b_t, b_sinv, FMT_MAX, B_ROW, B_COL, OUT, BM, BK)
    tl.debug_barrier()  # the scale read and the amax raised before the count
    if tl.atomic_add(slot + 96, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        amaxes = (slot + 64).to(tl.pointer_type(tl.float32), bitcast=True)
        _step_tile(hist_ptr, amaxes, new_hist_ptr, new_scale_ptr, L, N, STEP_MAX,
                   MARGIN_FACTOR, MOST_RECENT, BL, BN)
        tl.debug_barrier()  # the amaxes read before they are zeroed
        cols = tl.arange(0, BN)
        tl.store(slot + 64 + cols, tl.zeros((BN,), dtype=tl.int32), mask=cols < N)
        tl.store(slot + 96, 0)


_fp8_delayed_launch = Launcher(_fp8_delayed_kernel)


def delayed_call(a2d, b2d, scales, fmt, a_usage, b_usage, step, slot):
    """``(grid, key, args, out_a, out_b)`` of one :func:`_fp8_delayed_kernel`
    launch with counter slot ``slot`` (``(lo, hi)``), its outputs allocated
    (the native eager path fixes its plans from these; ``out_b`` None
    without b, or with ``b_usage`` (False, False): b's amax only); None
    where the step does not fit in the kernel's last program."""
    (ma, ka), has_b = a2d.shape, b2d is not None
    tiles = cdiv(ma, _TW_BM) * cdiv(ka, _TW_BK)
    if has_b:
        mb, kb = b2d.shape
        tiles += cdiv(mb, _TW_BM) * cdiv(kb, _TW_BK)
    step_args, step_consts = tq._step_args(step, a2d, tiles)
    n_cols = step.history.shape[1]
    if not step_consts[0] or not (2 if has_b else 1) <= n_cols <= _GONE - _AMAX:
        return None  # the step in a launch of its own; b's amax beyond the history
    dt = ref.FP8_DTYPE[fmt]
    out_a = _fp8_outputs(a2d, dt, ma, ka, *a_usage)
    if has_b:
        out_b = _fp8_outputs(a2d, dt, mb, kb, *b_usage) if any(b_usage) else None
        b_copies = (_unused(b2d),) * 3 if out_b is None else _fp8_copy_args(out_b, b2d)
        b_args, b_key = (b2d, mb, kb), _x_key(b2d, mb, kb)
    else:  # b's pointers are never read or written (HAS_B is a constexpr): a's input
        out_b, b_args, b_key = None, (_unused(a2d), 1, 1), None
        b_copies = (_unused(a2d),) * 3
    flags = (fmt, bool(a_usage[0]), bool(a_usage[1]), bool(b_usage[0]), bool(b_usage[1]), has_b)
    lo, hi = slot
    key = (_x_key(a2d, ma, ka), b_key, flags, ptr_key(scales), int_key(lo), int_key(hi),
           step_consts, int_key(step_args[3]), int_key(step_args[4]))
    args = (a2d, ma, ka, *b_args, lo, hi, scales, *_fp8_copy_args(out_a, a2d), *b_copies,
            *step_args, ref.FP8_MAX[fmt], *flags[1:], _TL_FP8[fmt], _TW_BM, _TW_BK,
            *step_consts[1:])
    return (tiles,), key, args, out_a, out_b


def quantize_fp8_delayed(a2d, b2d, scales, fmt, a_usage, b_usage, step) -> tuple:
    """``reference.quantize_fp8_delayed`` in one launch where it may, else
    the two-launch kernels of ``triton_quant.py``."""
    if (a2d.numel() > 0 and (b2d is None or b2d.numel() > 0) and scales.is_contiguous()
            and scales.dtype == torch.float32 and step.history.dim() == 2):
        slot = grid_state.slot(a2d.device)
        if slot is not None:
            a2d = tq._matrix(a2d)
            b2d = None if b2d is None else tq._matrix(b2d)
            call = delayed_call(a2d, b2d, scales, fmt, a_usage, b_usage, step, slot)
            if call is not None:
                grid, key, args, out_a, out_b = call
                _fp8_delayed_launch(grid, key, *args)
                return out_a, out_b
    return ref.delayed_casts(tq.quantize_fp8_tensorwise, a2d, b2d, scales, fmt, a_usage,
                             b_usage, step)
