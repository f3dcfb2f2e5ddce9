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

from ... import kernels
from ...dynamo.tensor_proto import TensorProto
from ...kernels import blockwise_grouped as kernel
from ...quantization.base import QuantizedTensorStorage, flat_column_scales
from ...quantization.blockwise import Float8BlockQuantizer
from .padding import padded_rows, padded_sources

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
    if not _on_cuda(t) or not (_is_blockwise(q_x, 1) and _is_blockwise(q_w, 2)):
        return False
    if q_dy is not None and not _is_blockwise(q_dy, 1):
        return False
    if in_features % TILE or out_features % TILE:
        return False
    why = _unavailable_reason()
    if why is not None:
        # said by the op's run: Dynamo cannot trace a warning
        if not torch.compiler.is_compiling():
            _say_once(why)
        return False
    return True


@torch.compiler.assume_constant_result
def _unavailable_reason():
    """``kernel.unavailable_reason()``, fixed for the process: torch.compile
    calls it while tracing instead of tracing the DSL import inside."""
    return kernel.unavailable_reason()


def _on_cuda(t) -> bool:
    """A tensor's or a fake's (``TensorProto``'s) device is CUDA."""
    return t.device is not None and torch.device(t.device).type == "cuda"


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


def _quantize_gathered(q, t: torch.Tensor, sources: torch.Tensor):
    """``q`` (1x128 tiles) applied to the padded layout whose row ``i`` is
    ``t``'s row ``sources[i]`` (zeros where it is -1, so wgrad's 128-token
    blocks sum nothing across groups): on CUDA one launch that reads ``t``
    through ``sources``, with no gathered copy of ``t`` and no padding row
    read (``kernels.quantize_fp8_blockwise_rows``)."""
    out = kernels.get("quantize_fp8_blockwise_rows", t)(
        t.detach(), sources, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon,
        q.rowwise_usage, q.columnwise_usage)
    return q.from_buffers((sources.shape[0], t.shape[1]), t.dtype,
                          flat_column_scales(out, q.column_block()))


def _quantize_weight(q_w, w: torch.Tensor, rowwise: bool, columnwise: bool):
    """Every expert's W quantized in one call, as one ``(experts * out, in)``
    matrix (its 128x128 blocks never span two experts)."""
    e, n, k = w.shape
    return q_w.usage_variant(rowwise, columnwise).quantize(w.reshape(e * n, k))


def _rowwise_weight(wq, experts: int):
    """``(experts, out, in)`` FP8 and ``(experts, out/128, in/128+)`` scales."""
    data, scales = wq.fp8_operand("rowwise")
    n = data.shape[0] // experts
    return data.view(experts, n, data.shape[1]), scales.view(experts, n // TILE, scales.shape[1])


def _columnwise_weight(data: torch.Tensor, scales: torch.Tensor, experts: int):
    """W's columnwise copy, ``(in, experts * out)`` FP8 and its ``(in/128,
    experts * out/128 padded)`` scales, as each expert's transposed W: a
    column slice, ``(experts, in, out)`` with ``(experts, in/128, out/128)``."""
    k, n = data.shape[0], data.shape[1] // experts
    nb = n // TILE
    return (data.as_strided((experts, k, n), (n, data.stride(0), 1)),
            scales.as_strided((experts, k // TILE, nb), (nb, scales.stride(0), 1)))


def _columnwise_rows(data: torch.Tensor, scales: torch.Tensor):
    """A 1x128 columnwise copy ``(cols, rows)`` with its flat scales as the
    kernel's operand: scales ``(cols, rows/128)``."""
    return data, scales.view(-1, data.shape[0]).t()


def kept_shapes(tokens: int, experts: int, in_features: int, out_features: int) -> dict:
    """The shapes of the FP8 copies :func:`forward` keeps (the op's fake):
    x's ``(in, padded tokens)`` and flat scales, W's ``(in, experts * out)``
    and ``(in/128, experts * out/128 padded)`` scales."""
    from ...kernels.reference import padded_blocks
    p = padded_rows(tokens, experts, TILE)
    return {"x": (in_features, p), "x_scale": ((p // TILE) * in_features,),
            "w": (in_features, experts * out_features),
            "w_scale": (in_features // TILE, padded_blocks(experts * out_features // TILE))}


def forward(x, w, q_x, q_w, rows, offs, keep_x: bool, keep_w: bool, wq=None,
            both_copies: bool = False) -> tuple:
    """``(y, (x's copy, scales), (W's copy, scales), W quantized)``: y in
    x's dtype (the kernel reads x's rows in the padded layout and writes
    y's in token order), and the columnwise FP8 copies wgrad (x's) and
    dgrad (W's) read, made by the same quantizations as the forward's
    operands (``(None, None)`` where not kept).  ``wq``: W already
    quantized (a weight cache: :func:`weight_cache_quantizer`'s copies);
    ``both_copies``: quantize both of W's copies (to fill that cache)."""
    sources, dest, pad_offs = padded_sources(offs, rows, TILE)
    xq = _quantize_gathered(q_x.usage_variant(True, keep_x), x, sources)
    if wq is None:
        wq = _quantize_weight(q_w, w, True, keep_w or both_copies)
    a, sa = xq.fp8_operand("rowwise")
    b, sb = _rowwise_weight(wq, w.shape[0])
    y = kernel.grouped_gemm(a, b, sa, sb, _row_tiles(offs, pad_offs, sources.shape[0]), False,
                            x.dtype, sources, dest)
    kept_x = (xq._columnwise_data, xq._columnwise_scale_inv) if keep_x else (None, None)
    kept_w = (wq._columnwise_data, wq._columnwise_scale_inv) if keep_w else (None, None)
    return y, kept_x, kept_w, wq


def weight_cache_quantizer(q_w):
    """The quantizer of a weight cache's contents: both copies of all
    experts' W as one ``(experts * out, in)`` matrix (what
    :func:`forward` quantizes with ``both_copies``)."""
    return q_w.usage_variant(True, True)


def is_kept_copy(t) -> bool:
    """Whether a saved x or W is :func:`forward`'s FP8 copy (not the tensor),
    or a weight cache's quantized W (:func:`is_cached_weight`)."""
    return t is not None and (is_cached_weight(t)
                              or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


def is_cached_weight(t) -> bool:
    """Whether a saved W is a weight cache's quantized W (real or fake)."""
    return isinstance(t, QuantizedTensorStorage) or (
        isinstance(t, TensorProto) and t.is_quantized)


def grads(dy, x, w, q_dy, q_x, q_w, rows, offs, dgrad: bool, wgrad: bool,
          w_dtype: torch.dtype, x_scale=None, w_scale=None) -> tuple:
    """``(dx, dW)`` as ``blocked.grads`` returns them, from the kernel: dW
    rounded once, from the fp32 accumulator to ``w_dtype``.  ``x`` and ``w``
    are the forward's FP8 copies with their scales, or the tensors
    themselves (quantized here)."""
    experts = offs.shape[0]
    sources, dest, pad_offs = padded_sources(offs, rows, TILE)
    size = sources.shape[0]
    dyq = _quantize_gathered(q_dy.usage_variant(dgrad, wgrad), dy, sources)
    dx = dw = None
    if dgrad:
        a, sa = dyq.fp8_operand("rowwise")
        if is_cached_weight(w):  # a weight cache's: its columnwise copy
            w, w_scale = w._columnwise_data, w._columnwise_scale_inv
        elif not is_kept_copy(w):
            wq = _quantize_weight(q_w, w, False, True)
            w, w_scale = wq._columnwise_data, wq._columnwise_scale_inv
        b, sb = _columnwise_weight(w, w_scale, experts)
        dx = kernel.grouped_gemm(a, b, sa, sb, _row_tiles(offs, pad_offs, size), False,
                                 dy.dtype, sources, dest)
    if wgrad:
        a, sa = dyq.fp8_operand("columnwise")
        if not is_kept_copy(x):
            xq = _quantize_gathered(q_x.usage_variant(False, True), x, sources)
            x, x_scale = xq._columnwise_data, xq._columnwise_scale_inv
        b, sb = _columnwise_rows(x, x_scale)
        dw = kernel.grouped_gemm(a, b, sa, sb, _k_tiles(offs, pad_offs), True, w_dtype)
    return dx, dw
