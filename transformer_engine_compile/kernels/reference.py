"""Reference numerics of every format in plain torch (CPU and GPU).

This module *defines* what each format computes; any faster kernel must
return the same buffers.  All functions take an (M, K) view, compute in
fp32, never synchronise with the host and never branch on data in Python.

Non-finite policy (docs/formats.md): NaN/Inf never turn finite.  Per-tensor
and FP8-blockwise scales fall back to 1 when their amax is not finite (the
NaN/Inf elements become NaN, finite ones saturate); MXFP8 and NVFP4 give
such a block a NaN scale, so the whole block reads back NaN (OCP MX rule).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# the activations and bias kernels, re-exported: kernels.get looks every op up here
from .reference_act import (ACTIVATIONS, activation_backward, activation_forward,  # noqa: F401
                            bias_add, column_sum)

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP32_MAX = torch.finfo(torch.float32).max
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MX_BLOCK = 32
FP8_BLOCK = 128
NVFP4_BLOCK = 16
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # documentation; decoded arithmetically
# random sign vector of the NVFP4 random Hadamard transform (fixed, like the
# transform itself, so quantization is deterministic and reproducible)
RHT_SIGNS = (1, -1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, 1, 1, -1, -1)
RHT_NEGATIVE = sum(1 << j for j, s in enumerate(RHT_SIGNS) if s < 0)  # bit j: sign j is -1


# -- layout ----------------------------------------------------------------------
def transpose_bytes(x2d: torch.Tensor, out=None) -> torch.Tensor:
    """The (K, M) transpose of a contiguous (M, K) matrix of one-byte values
    (FP8 data), into ``out`` when given: the transposed copy of FP8 data
    gathered rowwise (FSDP2's all-gather)."""
    if out is None:
        return x2d.t().contiguous()
    return out.copy_(x2d.t())


# -- scales ----------------------------------------------------------------------
STEP_COUNTER = 32  # index of a StepAfter's program counter in the amax vector


class StepAfter(NamedTuple):
    """The delayed-scaling step (:func:`delayed_scaling_step`) that a
    quantization recording the last amax of an op call runs when it is
    done: over the ``(L, n)`` ``history`` with the amaxes ``amaxes[:n]`` of
    its :class:`AmaxSlot`, into ``new_history`` and ``new_scale``.  A fast
    cast kernel runs it in the program that finishes last (counted in the
    zeroed ``amaxes[STEP_COUNTER]``, a cache line of its own), which saves
    the step's own launch."""

    history: torch.Tensor
    new_history: torch.Tensor
    new_scale: torch.Tensor
    fmt: str
    margin: int
    algo: str

    def run(self, amaxes: torch.Tensor) -> None:
        hist, scale = delayed_scaling_step(self.history, amaxes[:self.history.shape[1]],
                                           self.fmt, self.margin, self.algo)
        self.new_history.copy_(hist)
        self.new_scale.copy_(scale)


def run_step(step: StepAfter, amaxes: torch.Tensor) -> None:
    """Run ``step`` on its own (not after a quantization) with ``amaxes``."""
    step.run(amaxes)


class AmaxSlot(NamedTuple):
    """Where a delayed-scaling quantization records its amax: element
    ``index`` of the fp32 vector ``amaxes`` (zeroed by the caller), raised
    in place; then ``step``, if given.  Fast kernels take the vector and the
    index, never the one-element view ``amaxes[index]``: traced into
    inductor (the lowered ops), a kernel that writes a view makes the
    functionalized graph copy the element out and scatter it back around
    the launch (two kernels), while a write to the whole vector is done in
    place."""

    amaxes: torch.Tensor
    index: int = 0
    step: StepAfter | None = None

    def element(self) -> torch.Tensor:
        return self.amaxes[self.index]


def amax_slot(amax_out):
    """``amax_out`` as an :class:`AmaxSlot` (a one-element tensor is slot 0 of itself)."""
    if amax_out is None or isinstance(amax_out, AmaxSlot):
        return amax_out
    return AmaxSlot(amax_out.view(-1), 0)


def amax(x: torch.Tensor, out=None) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor; NaN propagates).
    ``out``: an :class:`AmaxSlot` raised to it in place instead (delayed
    scaling records an amax without quantizing), whose element is returned."""
    a = (torch.zeros((), dtype=torch.float32, device=x.device) if x.numel() == 0
         else x.detach().abs().amax().float())
    if out is None:
        return a
    element = out.element()
    element.copy_(torch.maximum(element, a))
    return element


_amax = amax  # for functions whose ``amax`` argument shadows it


def compute_scale(amax_: torch.Tensor, fmt_max: float, margin: int = 0,
                  pow2: bool = False) -> torch.Tensor:
    """scale = fmt_max / amax * 2^-margin; 1 where amax is 0 or not finite,
    fp32 max where the ratio overflows; optionally rounded down to 2^n."""
    amax_ = amax_.float()
    # reciprocal then multiply: exactly what ``fmt_max / tensor`` computes in
    # torch (two roundings); fast kernels reproduce it bit for bit
    scale = (torch.reciprocal(amax_) * fmt_max) * (2.0 ** -margin)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where((amax_ > 0) & torch.isfinite(amax_), scale, torch.ones_like(scale))
    if pow2:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.full_like(scale, 0.5), exp)
    return scale


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating cast of x * scale; ±Inf inputs become NaN, NaN stays NaN."""
    fmax = FP8_MAX[fmt]
    y = (x.float() * scale).clamp(-fmax, fmax)
    y = torch.where(torch.isinf(x), torch.full_like(y, float("nan")), y)
    return y.to(FP8_DTYPE[fmt])


# -- FP8 per-tensor ----------------------------------------------------------------
def quantize_fp8_tensorwise(x2d, scale, fmt, rowwise, columnwise, amax_out=None) -> dict:
    """data (M, K) and/or transpose (K, M) with one fp32 scale; scale_inv = 1/scale.
    ``amax_out`` (an :class:`AmaxSlot` or one fp32 element, in place): raised
    to the amax of x2d (delayed scaling records it while quantizing); then
    its ``step`` runs, after the cast, which may write over ``scale``."""
    scale = scale.reshape(1).float()
    slot = amax_slot(amax_out)
    if slot is not None:
        amax(x2d, slot)
    out = {}
    if rowwise:
        out["data"] = cast_fp8(x2d, scale, fmt)
    if columnwise:
        out["transpose"] = cast_fp8(x2d.t(), scale, fmt).contiguous()
    out["scale_inv"] = torch.reciprocal(scale)
    if slot is not None and slot.step is not None:
        slot.step.run(slot.amaxes)
    return out


def current_scale(amax_: torch.Tensor, fmt: str, pow2: bool, eps: float) -> torch.Tensor:
    """Current-scaling scale of an amax (floored at eps).  Shared with the
    tensor-parallel path, which reduces the amax across ranks first."""
    if eps > 0:
        amax_ = torch.clamp_min(amax_, eps)
    return compute_scale(amax_, FP8_MAX[fmt], pow2=pow2)


def _rows_group(x2d, group_of_row, rows_per_group: int) -> torch.Tensor:
    """The group of each row: ``group_of_row``, or ``r // rows_per_group``."""
    if group_of_row is not None:
        return group_of_row
    return torch.arange(x2d.shape[0], device=x2d.device) // rows_per_group


def current_scales_grouped(amax_: torch.Tensor, fmt: str, pow2: bool, eps: float) -> tuple:
    """``(scale, scale_inv)`` of each group's amax (``(groups,)`` fp32):
    :func:`current_scale` and its reciprocal, one launch on CUDA."""
    scale = current_scale(amax_.float(), fmt, pow2, eps)
    return scale, torch.reciprocal(scale)


def amax_grouped(x2d, groups: int, group_of_row=None, rows_per_group: int = 0) -> torch.Tensor:
    """``(groups,)`` fp32: the amax of each group of rows (0 for none) of a
    mixture of experts' tokens or stacked weights.  The group of row ``r``
    is ``group_of_row[r]``, or ``r // rows_per_group`` (consecutive equal
    groups)."""
    group_of_row = _rows_group(x2d, group_of_row, rows_per_group)
    row_amax = x2d.abs().amax(dim=1).float() if x2d.shape[1] else \
        x2d.new_zeros(x2d.shape[0], dtype=torch.float32)
    return torch.zeros(groups, dtype=torch.float32, device=x2d.device).scatter_reduce(
        0, group_of_row, row_amax, "amax")


def cast_fp8_grouped(x2d, scale, fmt: str, group_of_row=None, rows_per_group: int = 0,
                     rowwise: bool = True, columns_from=None,
                     transpose_groups: bool = False) -> tuple:
    """Each group of rows (as :func:`amax_grouped`) cast to FP8 with its
    scale (``scale``: ``(groups,)`` fp32): ``(rowwise (M, K) or None,
    transposed copy or None)``.  The transposed copy, for the GEMM operands
    that reduce over rows:

    * ``columns_from`` (tokens, an int ``(P,)`` tensor): ``(K, P)`` whose
      column ``p`` is row ``columns_from[p]``, zeros where it is negative
      (groups padded apart, ``module/grouped/padding.py``);
    * ``transpose_groups`` (stacked weights): ``(groups, K, rows_per_group)``,
      each group's block transposed."""
    group_of_row = _rows_group(x2d, group_of_row, rows_per_group)
    data = cast_fp8(x2d, scale.float()[group_of_row].unsqueeze(1), fmt)
    transposed = None
    if columns_from is not None:
        valid = columns_from >= 0
        transposed = torch.zeros(x2d.shape[1], columns_from.shape[0], dtype=data.dtype,
                                 device=x2d.device)
        picked = data.view(torch.uint8)[columns_from.clamp_min(0).long()]
        transposed.view(torch.uint8).copy_((picked * valid.unsqueeze(1)).t())
    elif transpose_groups:
        transposed = data.view(-1, rows_per_group, x2d.shape[1]).transpose(1, 2).contiguous()
    return (data if rowwise else None), transposed


def quantize_fp8_current(x2d, fmt, pow2, eps, rowwise, columnwise, amax=None) -> dict:
    """Current scaling: the scale comes from this tensor's amax (floored at eps).
    ``amax``: given instead (a 1-D fp32 tensor of partial maxima: the scale
    comes from their max), e.g. reduced over a tensor-parallel group or
    produced by the normalisation that made x2d."""
    a = _amax(x2d) if amax is None else amax.float().max()
    return quantize_fp8_tensorwise(x2d, current_scale(a, fmt, pow2, eps), fmt,
                                   rowwise, columnwise)


def quantize_fp8_many(tensors: list, amaxes: torch.Tensor, fmt, pow2, eps) -> list:
    """``[(data, scale_inv)]``: each tensor cast rowwise with the current
    scale of its amax ``amaxes[i]`` (e.g. weights whose amaxes were reduced
    over the ranks together)."""
    out = []
    for i, x in enumerate(tensors):
        buffers = quantize_fp8_current(x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1),
                                       fmt, pow2, eps, True, False, amax=amaxes[i:i + 1])
        out.append((buffers["data"].view(x.shape), buffers["scale_inv"]))
    return out


def quantize_fp8_delayed(a2d, b2d, scales, fmt, a_usage, b_usage, step) -> tuple:
    """Delayed scaling's casts of one op call: ``a2d`` with ``scales[0]``
    (and ``b2d``, or None, with ``scales[1]``), their amaxes this step's
    history columns 0 (and 1), then the :class:`StepAfter` ``step``, which
    may write over ``scales``.  ``(buffers of a, of b or None)``; with
    ``b_usage`` (False, False) b's amax alone is recorded (a weight whose
    FP8 copy is cached), and b's buffers are None."""
    return delayed_casts(quantize_fp8_tensorwise, a2d, b2d, scales, fmt, a_usage, b_usage, step)


def delayed_casts(cast, a2d, b2d, scales, fmt, a_usage, b_usage, step) -> tuple:
    """:func:`quantize_fp8_delayed` by ``cast`` (a ``quantize_fp8_tensorwise``)
    per tensor, the amaxes in a zeroed vector, the step run by the last cast."""
    amaxes = torch.zeros(STEP_COUNTER + 1, dtype=torch.float32, device=a2d.device)
    out_a = cast(a2d, scales[0], fmt, *a_usage, AmaxSlot(amaxes, 0, step if b2d is None else None))
    out_b = None if b2d is None else cast(b2d, scales[1], fmt, *b_usage, AmaxSlot(amaxes, 1, step))
    return out_a, (out_b if any(b_usage) else None)


def quantize_fp8_current_pair(a2d, b2d, fmt, pow2, eps, a_usage, b_usage) -> tuple:
    """Two current-scaling quantizations with one format (a layer's input and
    weight): ``(buffers of a, buffers of b)``; ``*_usage`` is ``(rowwise,
    columnwise)``.  Fast kernels run both in one amax and one cast launch."""
    return (quantize_fp8_current(a2d, fmt, pow2, eps, *a_usage),
            quantize_fp8_current(b2d, fmt, pow2, eps, *b_usage))


def quantize_fp8_current_pair_from_parts(a2d, b2d, parts, n_a, fmt, pow2, eps, a_usage,
                                         b_usage) -> tuple:
    """:func:`quantize_fp8_current_pair` with the amaxes given: ``parts`` holds
    1-D fp32 partial maxima, a's first ``n_a``, then b's (a normalisation that
    also read the weight: ``norm_forward(..., side=)``).  Fast kernels run the
    cast pass alone, one launch for both."""
    return (quantize_fp8_current(a2d, fmt, pow2, eps, *a_usage, parts[:n_a]),
            quantize_fp8_current(b2d, fmt, pow2, eps, *b_usage, parts[n_a:]))


def dequantize_fp8_tensorwise(data, scale_inv) -> torch.Tensor:
    return data.float() * scale_inv.float()


def delayed_scaling_step(amax_history, amaxes, fmt: str, margin: int, algo: str) -> tuple:
    """One delayed-scaling update, functional: ``(new history, new scale)``.

    ``amax_history`` is ``(L, n)`` (one column per tensor) or ``(L,)``,
    ``amaxes`` the ``(n,)`` amaxes of this step, recorded in row 0.  The
    scale comes from the history (``"max"`` over all rows or
    ``"most_recent"`` = this step); then the history rolls down one row and
    row 0 is zeroed for the next step."""
    shape = amax_history.shape
    history = amax_history.reshape(shape[0], -1)
    hist = torch.cat([amaxes.reshape(1, -1).to(history.dtype), history[1:]])
    amax_ = hist.amax(dim=0) if algo == "max" else hist[0]
    new_scale = compute_scale(amax_, FP8_MAX[fmt], margin)
    rolled = torch.cat([torch.zeros_like(hist[:1]), hist[:-1]])
    return rolled.reshape(shape), new_scale.reshape(shape[1:])


# -- MXFP8 -----------------------------------------------------------------------------
def mx_biased_exponent(block_amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """E8M0 scale (biased exponent, uint8) of each block: the smallest power of
    two 2^e with amax / 2^e <= fmt max; 0 for an all-zero block, 255 (NaN)
    for a block with NaN/Inf."""
    mant, exp = torch.frexp(block_amax.float())
    max_mant, max_exp = math.frexp(FP8_MAX[fmt])
    e = exp - max_exp + (mant > max_mant).to(exp.dtype)
    e = torch.where(block_amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    biased = e + 127
    biased = torch.where(torch.isfinite(block_amax), biased, torch.full_like(biased, 255))
    return biased.to(torch.uint8)


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """Decode E8M0: 2^(b - 127), NaN for 255."""
    b = biased.to(torch.int32)
    val = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b - 127)
    return torch.where(b == 255, torch.full_like(val, float("nan")), val)


def _mx_encode(blocks: torch.Tensor, block_amax: torch.Tensor, fmt: str, dim: int):
    biased = mx_biased_exponent(block_amax, fmt)
    b = biased.to(torch.int32).clamp(max=254)  # NaN blocks: any scale, read back NaN
    inv = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), 127 - b)
    return cast_fp8(blocks, inv.unsqueeze(dim), fmt), biased


def quantize_mxfp8(x2d, fmt, rowwise, columnwise) -> dict:
    """Blocks of 32 along K (rowwise) or along M (columnwise), E8M0 scales."""
    m, k = x2d.shape
    xf = x2d.float()
    out = {}
    if rowwise:
        blocks = xf.reshape(m, k // MX_BLOCK, MX_BLOCK)
        data, biased = _mx_encode(blocks, blocks.abs().amax(-1), fmt, -1)
        out["rowwise_data"], out["rowwise_scale_inv"] = data.reshape(m, k), biased
    if columnwise:
        blocks = xf.reshape(m // MX_BLOCK, MX_BLOCK, k)
        data, biased = _mx_encode(blocks, blocks.abs().amax(1), fmt, 1)
        out["columnwise_data"], out["columnwise_scale_inv"] = data.reshape(m, k), biased
    return out


def dequantize_mxfp8(data2d, biased, rowwise: bool, out_dtype=torch.float32) -> torch.Tensor:
    """One copy in its (M, K) orientation times its block scales, in ``out_dtype``."""
    scale = e8m0_to_float(biased)
    scale = scale.repeat_interleave(MX_BLOCK, dim=1 if rowwise else 0)
    return (data2d.float() * scale).to(out_dtype)


def quantize_mxfp8_pair(x2d, w2d, fmt, x_usage, w_usage) -> tuple:
    """A layer's x and W quantized to MXFP8 with one format: ``(buffers of
    x, buffers of W)``, each usage ``(rowwise, columnwise)``.  On the GPU
    one launch (kernels/triton_block.py)."""
    return quantize_mxfp8(x2d, fmt, *x_usage), quantize_mxfp8(w2d, fmt, *w_usage)


def dequantize_mxfp8_pair(a_data, a_scale, a_rowwise: bool, b_data, b_scale, b_rowwise: bool,
                          out_dtype) -> tuple:
    """Both operands of an emulated MXFP8 GEMM dequantized (``dequantize_mxfp8``
    of each); on the GPU one launch."""
    return (dequantize_mxfp8(a_data, a_scale, a_rowwise, out_dtype),
            dequantize_mxfp8(b_data, b_scale, b_rowwise, out_dtype))


# -- FP8 blockwise -------------------------------------------------------------------
def _expand_blocks(scale: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    return scale.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)


# 128x128 scales are stored (blocks along M, blocks along K) with the
# blocks along K padded with zeros to a multiple of 4, the layout cuBLAS's
# block-scaled GEMM reads (as Transformer Engine keeps them): no padded
# copy per GEMM.  The columnwise copy's scales, (blocks along K, blocks
# along M), pad the blocks along M the same way.
BLOCK_2D_SCALE_PAD = 4


def padded_blocks(blocks: int) -> int:
    """The stored length of a 128x128 scale row of ``blocks`` blocks."""
    return -(-blocks // BLOCK_2D_SCALE_PAD) * BLOCK_2D_SCALE_PAD


def pad_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """(rows, blocks) 128x128 scales as stored: a new contiguous tensor with
    the last dim padded with zeros (see ``padded_blocks``)."""
    rows, blocks = scale.shape
    out = scale.new_zeros((rows, padded_blocks(blocks)))
    out[:, :blocks] = scale
    return out


def _block_1d(x2d, fmt, pow2, eps):
    """1x128 tiles along the last dim: the data and its scale_inv stored
    blocks outer, (K/128, M), the layout the block-scaled GEMM reads."""
    m, k = x2d.shape
    blocks = x2d.float().reshape(m, k // FP8_BLOCK, FP8_BLOCK)
    bamax = torch.clamp_min(blocks.abs().amax(-1), eps) if eps > 0 else blocks.abs().amax(-1)
    scale = compute_scale(bamax, FP8_MAX[fmt], pow2=pow2)
    data = cast_fp8(blocks, scale.unsqueeze(-1), fmt).reshape(m, k).contiguous()
    return data, torch.reciprocal(scale).t().clone(memory_format=torch.contiguous_format)


def quantize_fp8_blockwise(x2d, fmt, block_2d, pow2, eps, rowwise, columnwise) -> dict:
    """1x128 tiles (activations, gradients) or 128x128 blocks (weights); fp32
    scale_inv.  The columnwise copy is the transposed data (K, M), quantized
    along M (1D) or the transposed rowwise copy (2D, same blocks).  1D
    scales are blocks outer: rowwise (K/128, M), columnwise (M/128, K); 2D
    rowwise (M/128, K/128) and columnwise (K/128, M/128), their last dims
    padded (``pad_block_scales``)."""
    out = {}
    if block_2d:
        m, k = x2d.shape
        blocks = x2d.float().reshape(m // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        bamax = blocks.abs().amax(dim=(1, 3))
        if eps > 0:
            bamax = torch.clamp_min(bamax, eps)
        scale = compute_scale(bamax, FP8_MAX[fmt], pow2=pow2)
        data = cast_fp8(x2d, _expand_blocks(scale, FP8_BLOCK, FP8_BLOCK), fmt)
        scale_inv = torch.reciprocal(scale)
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = data, pad_block_scales(scale_inv)
        if columnwise:
            # clone: .contiguous() of a transpose with a size-1 dim returns a view,
            # and a kernel's buffers must never alias each other
            out["columnwise_data"] = data.t().clone(memory_format=torch.contiguous_format)
            out["columnwise_scale_inv"] = pad_block_scales(scale_inv.t())
        return out
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = _block_1d(x2d, fmt, pow2, eps)
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = _block_1d(x2d.t(), fmt, pow2, eps)
    return out


def quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, rowwise, columnwise) -> dict:
    """:func:`quantize_fp8_blockwise` (1x128 tiles) of the matrix whose row
    ``i`` is ``t``'s row ``sources[i]``, or zeros where ``sources[i]`` is
    -1: rows gathered into a padded layout and quantized, on the GPU in one
    launch that reads ``t`` through ``sources`` (kernels/triton_block.py)."""
    rows = t.index_select(0, sources.clamp_min(0).long())
    rows = torch.where((sources >= 0).unsqueeze(1), rows, rows.new_zeros(()))
    return quantize_fp8_blockwise(rows, fmt, False, pow2, eps, rowwise, columnwise)


def quantize_fp8_blockwise_pair(x2d, w2d, fmt, pow2, eps, x_flags, w_flags) -> tuple:
    """A layer's x and W quantized blockwise with one format, power-of-two
    setting and epsilon: ``(buffers of x, buffers of W)``, each
    ``*_flags`` being ``(block_2d, rowwise, columnwise)``.  On the GPU one
    launch (kernels/triton_block.py)."""
    return (quantize_fp8_blockwise(x2d, fmt, x_flags[0], pow2, eps, *x_flags[1:]),
            quantize_fp8_blockwise(w2d, fmt, w_flags[0], pow2, eps, *w_flags[1:]))


def dequantize_fp8_blockwise(data2d, scale_inv, block_2d: bool) -> torch.Tensor:
    """Dequantize one copy in its stored orientation; ``scale_inv``: one
    scale per block of (rows, K), i.e. (M, K/128) for 1D (the transposed
    view of the stored buffer) or (M/128, K/128) for 2D (padded columns
    past K/128, as stored, are ignored)."""
    bm = FP8_BLOCK if block_2d else 1
    if block_2d:
        scale_inv = scale_inv[:, :data2d.shape[1] // FP8_BLOCK]
    return data2d.float() * _expand_blocks(scale_inv, bm, FP8_BLOCK)


# -- NVFP4 ------------------------------------------------------------------------------
def _e2m1_magnitude(code: torch.Tensor) -> torch.Tensor:
    """|value| of 3-bit E2M1 magnitude codes, computed on the codes' device
    (no host-to-device copy, so it can run inside CUDA-graph capture)."""
    c = code.to(torch.int32)
    e, m = c >> 1, (c & 1).to(torch.float32)
    normal = torch.ldexp(1.0 + 0.5 * m, e - 1)
    return torch.where(e == 0, 0.5 * m, normal)


def _e2m1_grid(device) -> torch.Tensor:
    """The 8 E2M1 magnitudes, ascending (see _E2M1_VALUES)."""
    return _e2m1_magnitude(torch.arange(8, device=device))


def round_to_e2m1(v: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """4-bit E2M1 codes (sign in bit 3) of v, saturating at ±6.  Round to
    nearest, ties to even; or stochastic rounding between the two neighbours."""
    a = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=E2M1_MAX)
    if stochastic:
        grid = _e2m1_grid(v.device)
        lo = (torch.searchsorted(grid, a.contiguous(), right=True) - 1).clamp(0, 7)
        hi = (lo + 1).clamp(max=7)
        gap = grid[hi] - grid[lo]
        p = torch.where(gap > 0, (a - grid[lo]) / torch.where(gap > 0, gap, 1.0), 0.0)
        code = lo + (torch.rand_like(a) < p).to(lo.dtype)
    else:
        code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
                + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    code = code + 8 * (v < 0).to(code.dtype)
    return code.to(torch.uint8)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    mag = _e2m1_magnitude(c & 7)
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def rht_matrix(device=None) -> torch.Tensor:
    """16x16 orthonormal random Hadamard transform T = H16 · diag(signs) / 4."""
    # Sylvester Hadamard: H[i, j] = (-1)^popcount(i & j), built on the device
    # from arange (no host-to-device copy, so it can run in CUDA-graph capture)
    i = torch.arange(NVFP4_BLOCK, device=device)
    both = i[:, None] & i[None, :]
    parity = sum((both >> b) & 1 for b in range(NVFP4_BLOCK.bit_length() - 1)) & 1
    return (1 - 2 * parity).to(torch.float32) * _rht_signs(device)[None, :] / 4.0


def _rht_signs(device=None) -> torch.Tensor:
    """RHT_SIGNS as fp32, built on the device from arange (as rht_matrix)."""
    i = torch.arange(NVFP4_BLOCK, device=device)
    return (1 - 2 * ((RHT_NEGATIVE >> i) & 1)).to(torch.float32)


def _fwht16(y: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform (Sylvester order) of each run of
    16 along the last dim, as the in-place butterfly: stages of stride
    h = 1, 2, 4, 8 map each pair (a, b) = (y[i], y[i + h]) to (a + b, a - b).
    A fixed order of fp32 additions, so a kernel can reproduce it bit for bit
    (a 16x16 matmul sums in an unspecified order)."""
    shape = y.shape
    for h in (1, 2, 4, 8):
        a, b = y.reshape(*shape[:-1], NVFP4_BLOCK // (2 * h), 2, h).unbind(-2)
        y = torch.stack((a + b, a - b), dim=-2)
    return y.reshape(shape)


def apply_rht(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Transform each run of 16 consecutive elements of the last dim by
    T = rht_matrix() (inverse: by T^-1 = T^T), through the butterfly
    (equal to ``chunks @ T.t()`` up to fp32 rounding).  With H symmetric,
    T x = H (signs * x) / 4 and T^T y = signs * (H y) / 4; /4 is exact."""
    r, c = rows.shape
    signs = _rht_signs(rows.device)
    chunks = rows.float().reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK)
    if inverse:
        out = _fwht16(chunks) * 0.25 * signs
    else:
        out = _fwht16(chunks * signs) * 0.25
    return out.reshape(r, c)


def nvfp4_global_scale(amax_: torch.Tensor) -> torch.Tensor:
    """Per-tensor encode scale 6*448/amax (same edge cases as compute_scale)."""
    return compute_scale(amax_, E2M1_MAX * E4M3_MAX)


def _nvfp4_rows(x2d, amax_, block_2d: bool, stochastic: bool):
    """Quantize along the last dim in blocks of 16 (or 16x16 tiles)."""
    m, k = x2d.shape
    g = nvfp4_global_scale(amax_)
    xf = x2d.float()
    if block_2d:
        tiles = xf.reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK)
        bamax = tiles.abs().amax(dim=(1, 3)).repeat_interleave(NVFP4_BLOCK, dim=0)
    else:
        bamax = xf.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK).abs().amax(-1)
    # times the fp32 reciprocal, not ``/ 6.0``: torch divides by a Python
    # scalar exactly on the CPU but multiplies by its reciprocal on CUDA, so
    # this is the one spelling that is the same on every device (and kernel)
    s = bamax * (1.0 / E2M1_MAX) * g
    s = torch.where(torch.isfinite(s), s.clamp(max=E4M3_MAX), torch.full_like(s, float("nan")))
    s_q = s.to(torch.float8_e4m3fn)
    s_f = s_q.float()
    enc = torch.where(s_f > 0, g / torch.where(s_f > 0, s_f, 1.0), torch.zeros_like(s_f))
    v = xf.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK) * enc.unsqueeze(-1)
    codes = round_to_e2m1(v.reshape(m, k).contiguous(), stochastic)
    return pack_fp4(codes).contiguous(), s_q.contiguous()


def quantize_nvfp4(x2d, block_2d, rht, stochastic, rowwise, columnwise) -> dict:
    """E2M1 packed data, E4M3 block decode scales, fp32 amax per copy.  The
    columnwise copy is the transposed tensor (K, M), optionally transformed by
    the RHT along M (its amax is taken after the transform)."""
    out = {}
    if rowwise:
        a = amax(x2d)
        out["rowwise_data"], out["rowwise_scale_inv"] = _nvfp4_rows(x2d, a, block_2d, stochastic)
        out["rowwise_amax"] = a.reshape(1)
    if columnwise:
        xt = x2d.t()
        if rht:
            xt = apply_rht(xt)
        a = amax(xt)
        out["columnwise_data"], out["columnwise_scale_inv"] = _nvfp4_rows(xt, a, block_2d, stochastic)
        out["columnwise_amax"] = a.reshape(1)
    return out


def quantize_nvfp4_pair(x2d, w2d, x_config, w_config) -> tuple:
    """A layer's x and W quantized to NVFP4, each config ``(block_2d, rht,
    stochastic, rowwise, columnwise)``: ``(buffers of x, buffers of W)``,
    x's stochastic draws first.  On the GPU one launch (kernels/triton_nvfp4.py)."""
    return quantize_nvfp4(x2d, *x_config), quantize_nvfp4(w2d, *w_config)


def _nvfp4_values_times(packed, per_block) -> torch.Tensor:
    """One copy's E2M1 values (fp32), each block of 16 times its ``per_block`` factor."""
    vals = e2m1_to_float(unpack_fp4(packed))
    r, c = vals.shape
    blocks = vals.reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK) * per_block.unsqueeze(-1)
    return blocks.reshape(r, c)


def dequantize_nvfp4(packed, scale_q, amax_) -> torch.Tensor:
    """Dequantize one copy in its stored orientation (no inverse RHT)."""
    return _nvfp4_values_times(packed, scale_q.float() / nvfp4_global_scale(amax_.reshape(())))


def dequantize_nvfp4_blocks(packed, scale_q, out_dtype=torch.bfloat16) -> torch.Tensor:
    """One copy's E2M1 values times their E4M3 block scales, without the
    per-tensor scale.  The products have at most 6 significant bits (2 of
    E2M1, 4 of E4M3) within bf16's exponent range, so they are exact in
    bf16: the bf16 tensor cores can multiply them exactly (the fast NVFP4
    GEMM, quantization/cuda_gemm.py), and :func:`nvfp4_gemm_epilogue` applies the
    per-tensor scales to the fp32 product."""
    return _nvfp4_values_times(packed, scale_q.float()).to(out_dtype)


def dequantize_nvfp4_blocks_pair(a_packed, a_scale, b_packed, b_scale,
                                 out_dtype=torch.bfloat16) -> tuple:
    """Both operands of an emulated NVFP4 GEMM (``dequantize_nvfp4_blocks``
    of each); on the GPU one launch."""
    return (dequantize_nvfp4_blocks(a_packed, a_scale, out_dtype),
            dequantize_nvfp4_blocks(b_packed, b_scale, out_dtype))


def nvfp4_gemm_epilogue(acc, amax_a, amax_b, bias, out_dtype) -> torch.Tensor:
    """``acc`` (fp32, the product of two :func:`dequantize_nvfp4_blocks`
    operands) divided by both operands' per-tensor scales, plus ``bias``
    (in fp32), rounded once to ``out_dtype``."""
    out = acc / nvfp4_global_scale(amax_a.reshape(())) / nvfp4_global_scale(amax_b.reshape(()))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def nvfp4_gemm(a, b, bias, out_dtype) -> torch.Tensor:
    """The emulated NVFP4 GEMM ``A @ B^T``: ``a``, ``b`` are ``(packed,
    scales, amax)`` of two K-major copies (rows, K / 2), (rows, K / 16);
    both operands' blocks dequantized (:func:`dequantize_nvfp4_blocks`,
    exact), multiplied into fp32, then :func:`nvfp4_gemm_epilogue`."""
    a32 = dequantize_nvfp4_blocks(a[0], a[1], torch.float32)
    b32 = dequantize_nvfp4_blocks(b[0], b[1], torch.float32)
    return nvfp4_gemm_epilogue(a32 @ b32.t(), a[2], b[2], bias, out_dtype)


# -- normalisation (LayerNormLinear, LayerNormMLP) ---------------------------------
def norm_forward(x2d, weight, bias, eps: float, rms: bool, with_amax: bool = False,
                 side=None) -> tuple:
    """``(y, mean, rstd)`` of LayerNorm (``rms`` False) or RMSNorm over the
    rows of an (M, K) view: computed in fp32 (x, weight and bias upcast) and
    rounded once to x's dtype.  ``mean`` (None for RMSNorm) and ``rstd`` are
    (M,) fp32.  ``weight`` is the effective gamma (zero-centred already added).

    ``with_amax``: a fourth element, a 1-D fp32 tensor of partial maxima of
    ``|y|`` whose max is ``amax(y)`` (one element here; a fast kernel returns
    one per program), for ``quantize_fp8_current(..., amax=...)``.
    ``side`` (needs ``with_amax``): another tensor, the layer's weight; the
    partial maxima of ``|side|`` follow y's and a fifth element gives the
    count of y's, for :func:`quantize_fp8_current_pair_from_parts`."""
    if side is not None and not with_amax:
        raise ValueError("norm_forward: side needs with_amax")
    xf, wf = x2d.float(), weight.float()
    if rms:
        rstd = torch.rsqrt(xf.square().mean(-1) + eps)
        out = (xf * rstd[:, None] * wf).to(x2d.dtype), None, rstd
    else:
        y, mean, rstd = torch.native_layer_norm(xf, [x2d.shape[-1]], wf,
                                                None if bias is None else bias.float(), eps)
        out = y.to(x2d.dtype), mean.reshape(-1), rstd.reshape(-1)
    if side is not None:
        return (*out, torch.stack([amax(out[0]), amax(side)]), 1)
    return (*out, amax(out[0]).reshape(1)) if with_amax else out


def norm_forward_fp8(x2d, weight, bias, eps: float, rms: bool, scale, fmt: str,
                     columnwise: bool, amax_out, with_y: bool) -> tuple:
    """``(y or None, mean, rstd, buffers)``: :func:`norm_forward`, then y (as
    rounded to x's dtype) quantized to FP8 with the given fp32 ``scale`` (one
    element; delayed scaling knows it before y exists), its amax raised into
    ``amax_out`` (:func:`quantize_fp8_tensorwise`'s buffers, rowwise always).
    A fast kernel writes the FP8 copy in the norm's pass over x, and y only
    when ``with_y``: the same bytes, fewer of them moved."""
    y, mean, rstd = norm_forward(x2d, weight, bias, eps, rms)
    buffers = quantize_fp8_tensorwise(y.detach(), scale, fmt, True, columnwise, amax_out)
    return (y if with_y else None), mean, rstd, buffers


def norm_backward(dy2d, x2d, mean, rstd, weight, rms: bool, need_dx: bool,
                  need_dweight: bool, need_dbias: bool, grad_dtype=None) -> tuple:
    """``(dx, dweight, dbias)`` of :func:`norm_forward` (None where not
    needed), fp32; ``grad_dtype``: dweight and dbias rounded to it.  A fast
    kernel may return dx in x's dtype (callers cast dx to x's dtype)."""
    dx, dweight, dbias = _norm_backward(dy2d, x2d, mean, rstd, weight, rms, need_dx,
                                        need_dweight, need_dbias)
    if grad_dtype is not None:
        dweight = None if dweight is None else dweight.to(grad_dtype)
        dbias = None if dbias is None else dbias.to(grad_dtype)
    return dx, dweight, dbias


def _norm_backward(dy2d, x2d, mean, rstd, weight, rms: bool, need_dx: bool,
                   need_dweight: bool, need_dbias: bool) -> tuple:
    dyf, xf, wf = dy2d.float(), x2d.float(), weight.float()
    dbias = dyf.sum(0) if need_dbias and not rms else None
    if rms:
        r = rstd[:, None]
        xhat = xf * r
        dweight = (dyf * xhat).sum(0) if need_dweight else None
        dx = None
        if need_dx:
            g = dyf * wf
            dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx, dweight, dbias
    dx, dweight, _ = torch.ops.aten.native_layer_norm_backward(
        dyf, xf, [x2d.shape[-1]], mean[:, None], rstd[:, None], wf, None,
        [need_dx, need_dweight, False])
    return dx, dweight, dbias

