"""``te.GroupedLinear``'s GEMMs under ``Float8BlockScaling`` on Hopper with
the CuTeDSL FP8 blockwise grouped GEMM (``kernels/blockwise_grouped.py``).

The operands are those of ``blocked.py`` (the tokens in groups padded to
whole 128-row tiles, each quantized as a ``te.Linear`` of its expert
would), passed to the kernel in FP8 with their block scales instead of
dequantized:

* fprop ``y_g = x_g W_g^T``: x rowwise (1x128), all experts' W quantized in
  one call as a ``(experts * out, in)`` matrix (its 128x128 blocks never
  span two experts, so each expert's blocks are those it would get alone);
  a row tile of padding only is skipped;
* dgrad ``dx_g = dy_g W_g``: dy rowwise, W's columnwise copy (one
  ``(in, experts * out)`` buffer, each expert a column slice);
* wgrad ``dW_g = dy_g^T x_g``: dy's and x's columnwise copies (1x128 blocks
  along the tokens), each expert reducing over its own 128-token tiles.

The kernel sums each 128-long block of FP8 products in the tensor cores and
adds it, scaled, into an fp32 accumulator: the result equals the fp32 GEMM
of the dequantized operands up to the accumulation's rounding.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from ...kernels import blockwise_grouped as kernel
from ...quantization.blockwise import Float8BlockQuantizer
from .padding import gather_rows, padded_sources

TILE = kernel.TILE
DISABLE_VAR = "TE_COMPILE_CUTEDSL"


def applies(t: torch.Tensor, in_features: int, out_features: int, q_x, q_w,
            q_dy=None) -> bool:
    """Whether the kernel runs these GEMMs: CUDA, Float8BlockScaling with
    1x128 activations and gradients and 128x128 weights, feature sizes in
    whole 128-blocks, and the kernel available (else said once, and the
    dequantized path runs).  ``TE_COMPILE_CUTEDSL=0`` turns the kernel off."""
    if os.environ.get(DISABLE_VAR, "1") == "0":
        return False
    if not t.is_cuda or not (_is_blockwise(q_x, 1) and _is_blockwise(q_w, 2)):
        return False
    if q_dy is not None and not _is_blockwise(q_dy, 1):
        return False
    if in_features % TILE or out_features % TILE:
        return False
    why = kernel.unavailable_reason()
    if why is not None:
        _say_once(why)
        return False
    return True


def _is_blockwise(q, dim: int) -> bool:
    return isinstance(q, Float8BlockQuantizer) and q.block_scaling_dim == dim


@functools.lru_cache(maxsize=None)
def _say_once(why: str) -> None:
    warnings.warn(f"te.GroupedLinear under Float8BlockScaling: the FP8 blockwise grouped GEMM "
                  f"cannot run ({why}); the GEMMs take the dequantized operands in bf16 "
                  "(correct, slower)", stacklevel=3)


def _row_tiles(offs: torch.Tensor, pad_offs: torch.Tensor, size: int) -> torch.Tensor:
    """Each 128-row tile's expert in the padded layout, -1 where the tile
    holds padding only (int32, ``(size / 128,)``)."""
    starts = torch.arange(0, size, TILE, device=offs.device, dtype=offs.dtype)
    group = torch.searchsorted(pad_offs, starts, right=True).clamp_max(offs.shape[0] - 1)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    pad_starts = torch.cat([pad_offs.new_zeros(1), pad_offs[:-1]])
    real = starts < (pad_starts + counts)[group]
    return torch.where(real, group, -1).to(torch.int32)


def _k_tiles(offs: torch.Tensor, pad_offs: torch.Tensor) -> torch.Tensor:
    """Each expert's first and end 128-token tile in the padded layout
    (int32, ``(experts, 2)``): its tokens rounded up to whole tiles."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    first = torch.cat([pad_offs.new_zeros(1), pad_offs[:-1]]) // TILE
    return torch.stack([first, first + (counts + TILE - 1) // TILE], 1).to(torch.int32)


def _weight(q_w, w: torch.Tensor, usage: str):
    """Every expert's W quantized in one call: rowwise ``(experts, out, in)``
    with ``(experts, out/128, in/128+)`` scales, or columnwise (W^T per
    expert) ``(experts, in, out)`` with ``(experts, in/128, out/128)``."""
    e, n, k = w.shape
    q = q_w.usage_variant(usage == "rowwise", usage == "columnwise").quantize(w.reshape(e * n, k))
    data, scales = q.fp8_operand(usage)
    if usage == "rowwise":
        return data.view(e, n, k), scales.view(e, n // TILE, scales.shape[1])
    # (in, experts * out): expert g's transposed W is the column slice g
    nb = n // TILE
    return (data.as_strided((e, k, n), (n, data.stride(0), 1)),
            scales.as_strided((e, k // TILE, nb), (nb, scales.stride(0), 1)))


def fprop(x, w, q_x, q_w, rows, offs) -> torch.Tensor:
    """``y`` in x's dtype: the kernel reads x's rows in the padded layout and
    writes y's in token order."""
    sources, dest, pad_offs = padded_sources(offs, rows, TILE)
    # rowwise blocks alone: the padding rows may hold anything
    xs = gather_rows(x, sources, zero_padding=False)
    a, sa = q_x.usage_variant(True, False).quantize(xs).fp8_operand("rowwise")
    b, sb = _weight(q_w, w, "rowwise")
    return kernel.grouped_gemm(a, b, sa, sb, _row_tiles(offs, pad_offs, xs.shape[0]), False,
                               x.dtype, sources, dest)


def grads(dy, x, w, q_dy, q_x, q_w, rows, offs, dgrad: bool, wgrad: bool,
          w_dtype: torch.dtype) -> tuple:
    """``(dx, dW)`` as ``blocked.grads`` returns them, from the kernel: dW
    rounded once, from the fp32 accumulator to ``w_dtype``."""
    sources, dest, pad_offs = padded_sources(offs, rows, TILE)
    size = sources.shape[0]
    # zeros between the groups: wgrad's 128-token blocks sum over them
    dyq = q_dy.usage_variant(dgrad, wgrad).quantize(gather_rows(dy, sources, zero_padding=wgrad))
    dx = dw = None
    if dgrad:
        a, sa = dyq.fp8_operand("rowwise")
        b, sb = _weight(q_w, w, "columnwise")
        dx = kernel.grouped_gemm(a, b, sa, sb, _row_tiles(offs, pad_offs, size), False,
                                 dy.dtype, sources, dest)
    if wgrad:
        a, sa = dyq.fp8_operand("columnwise")
        xq = q_x.usage_variant(False, True).quantize(gather_rows(x, sources, zero_padding=True))
        b, sb = xq.fp8_operand("columnwise")
        dw = kernel.grouped_gemm(a, b, sa, sb, _k_tiles(offs, pad_offs), True, w_dtype)
    return dx, dw
