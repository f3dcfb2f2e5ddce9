"""cuBLAS GEMMs on CUDA: ``out = A @ B^T`` (operand table in quantization/gemm.py).

Which path a product takes (``gemm_path`` names it; docs/linear.md lists them):

* ``"bf16"``: unquantized operands, ``F.linear`` (torch's own matmul).
* ``"fp8_tensorwise"``: FP8 per-tensor x FP8 per-tensor through
  ``torch._scaled_mm`` (cuBLASLt, SM 8.9+), both operands K-major ("TN");
  any row count of A, an inner dim that is not a multiple of 16 (the wgrad
  of a ragged token count) padded with zeros inside the GEMM.
* ``"fp8_blockwise"``: FP8 1x128 x (1x128 | 128x128) through
  ``F.scaled_mm`` block-scale recipes (cuBLAS, SM 9.0), scales laid out as
  cuBLAS asks: 1x128 scales outer-dim-major, 128x128 scales transposed.
* ``"emulated_bf16"``: MXFP8 (Hopper has no MX tensor cores): each operand
  is dequantized to bf16, which holds every MXFP8 value exactly, then
  multiplied by the bf16 tensor cores with fp32 accumulation.
* ``"emulated_nvfp4"``: NVFP4 (no Hopper FP4 tensor cores): each operand's
  E2M1 values times their E4M3 block scales are exact in bf16 (at most 6
  significant bits), so the bf16 tensor cores multiply them into fp32
  (``torch.mm``'s ``out_dtype``), and one kernel divides the product by
  both per-tensor scales (which bf16 could not hold exactly), adds the
  bias and rounds once (``reference.nvfp4_gemm_epilogue``).  Small
  products (``nvfp4_fused``) do all of it in one Triton kernel
  (``reference.nvfp4_gemm``, kernels/triton_nvfp4_gemm.py).  Without
  ``torch.mm(..., out_dtype=)`` (torch before 2.8) the reference.
* ``"reference"``: everything else (mixed formats, shapes cuBLAS refuses,
  fp32 outputs of MXFP8): the fp32 reference GEMM.

The native paths accumulate in another order than the reference, so they
agree with it to fp32 accumulation rounding, not bit for bit.  ``fast_accum``
(Hopper's faster, less precise FP8 accumulation) is used for fprop only, as
Transformer Engine does; gradients accumulate at full precision.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .base import QuantizedTensorStorage
from .blockwise import Float8BlockwiseQTensorStorage
from .float8 import Float8TensorStorage
from .mxfp8 import MXFP8TensorStorage
from .nvfp4 import NVFP4TensorStorage
from ..kernels import get, on_load, register_fast
from .gemm import gemm_reference

_SCALED_MM_OUT = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _has_block_scaled_mm() -> bool:
    return (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
            and hasattr(torch, "_scaled_mm_v2"))


@functools.lru_cache(maxsize=None)
def _block_recipes() -> tuple:
    """``F.ScalingType``'s 1x128 and 128x128 values, as ``_scaled_mm_v2`` takes them."""
    return F.ScalingType.BlockWise1x128.value, F.ScalingType.BlockWise128x128.value


def _dims_ok(*dims: int) -> bool:
    return all(d % 16 == 0 and d > 0 for d in dims)


def _rows_to_16(data: torch.Tensor, scale: torch.Tensor):
    """A's rows padded to a multiple of 16 (zero data, unit scales), as
    cuBLAS's block-scaled FP8 GEMM needs (it refuses e.g. 7 or 4095 rows);
    ``(data, scale, rows)``.  A ragged token count costs this copy."""
    m = data.shape[0]
    pad = -m % 16
    if pad == 0:
        return data, scale, m
    padded = data.new_zeros((m + pad, data.shape[1]))
    padded[:m].copy_(data)
    return padded, torch.cat((scale, scale.new_ones((pad, scale.shape[1])))), m


def _inner_to_16(data: torch.Tensor) -> torch.Tensor:
    """An FP8 operand's inner (reduced) dim padded with zeros to a multiple
    of 16, as ``_scaled_mm`` requires: a wgrad over a ragged token count.
    Zeros in both operands add nothing to the product (one byte pad each)."""
    pad = -data.shape[1] % 16
    if pad == 0:
        return data
    return F.pad(data.view(torch.uint8), (0, pad)).view(data.dtype)


def gemm_path(a, b, out_dtype: torch.dtype) -> str:
    """Name of the path ``gemm_cuda`` takes for these operands (see module doc)."""
    qa, qb = isinstance(a, QuantizedTensorStorage), isinstance(b, QuantizedTensorStorage)
    if not qa and not qb:
        return "bf16"
    if not (qa and qb and _same_format(a, b)) or out_dtype not in _SCALED_MM_OUT:
        return "reference"
    cap = _capability(next(iter(a.buffers().values())).device.index or 0)
    if isinstance(a, Float8TensorStorage):
        both_e5m2 = a._fp8_format == "e5m2" and b._fp8_format == "e5m2"
        return "fp8_tensorwise" if cap >= (8, 9) and not both_e5m2 else "reference"
    if isinstance(a, Float8BlockwiseQTensorStorage):
        ok = (cap == (9, 0) and _has_block_scaled_mm() and a._block_scaling_dim == 1
              and a._fp8_format == "e4m3" and b._fp8_format == "e4m3")
        return "fp8_blockwise" if ok else "reference"
    if isinstance(a, MXFP8TensorStorage) and out_dtype != torch.float32:
        return "emulated_bf16"
    if isinstance(a, NVFP4TensorStorage):
        return "emulated_nvfp4" if _has_mm_out_dtype() else "reference"
    return "reference"


def _same_format(a, b) -> bool:
    for cls in (Float8TensorStorage, Float8BlockwiseQTensorStorage, MXFP8TensorStorage,
                NVFP4TensorStorage):
        if isinstance(a, cls) and isinstance(b, cls):
            return True
    return False


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """The same (rows, blocks) values with stride (1, rows), as cuBLAS's 1x128
    wants: the stored 1D scales' view as it is (no copy), a copy only for
    scales padded by ``_rows_to_16``."""
    if scale.stride(0) == 1 and scale.stride(1) == scale.shape[0]:
        return scale
    return scale.t().contiguous().t()


def _add_bias(out: torch.Tensor, bias) -> torch.Tensor:
    """The bias added by a kernel (Triton when it imports), not a torch op:
    lowered into inductor, a torch add would be fused into the output's
    consumers without rounding to the output's dtype first."""
    return out if bias is None else get("bias_add", out)(out, bias)


def _fp8_tensorwise(a, a_usage, b, b_usage, out_dtype, bias, fast_accum):
    ad, asc = a.fp8_operand(a_usage)
    bd, bsc = b.fp8_operand(b_usage)
    if ad.shape[0] == 0 or ad.shape[1] == 0 or not _dims_ok(bd.shape[0]):
        return None  # any count of A's rows; any inner dim, padded to 16
    ad, bd = _inner_to_16(ad), _inner_to_16(bd)
    fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    out = torch._scaled_mm(ad, bd.t(), scale_a=asc, scale_b=bsc,
                           bias=bias if fused_bias else None, out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    return out if fused_bias else _add_bias(out, bias)


def _fp8_blockwise(a, a_usage, b, b_usage, out_dtype, bias):
    ad, asc = a.fp8_operand(a_usage)
    bd, bsc = b.fp8_operand(b_usage)
    if ad.shape[0] == 0 or not _dims_ok(ad.shape[1], bd.shape[0]):
        return None
    ad, asc, m = _rows_to_16(ad, asc)
    one_d, two_d = _block_recipes()
    if b._block_scaling_dim == 2:
        b_scale, b_recipe = bsc.t(), two_d  # stored padded, as cuBLAS reads them
    else:
        b_scale, b_recipe = _outer_major(bsc), one_d
    # F.scaled_mm's op, called directly: its Python wrapper costs ~15 us a call
    out = torch._scaled_mm_v2(ad, bd.t(), [_outer_major(asc)], [one_d], [], [b_scale],
                              [b_recipe], [], None, out_dtype, [], False)
    return _add_bias(out if out.shape[0] == m else out[:m], bias)


def _mx_copy(t, usage: str) -> tuple:
    """``(data (rows, K), scales, rowwise)`` of one MXFP8 copy in its stored
    (M, K) orientation (the columnwise copy may hold padding rows)."""
    t.gemm_operand_check(usage)
    k = t._te_shape[-1]
    rowwise = usage == "rowwise"
    data = (t._rowwise_data if rowwise else t._columnwise_data).reshape(-1, k)
    return data, (t._rowwise_scale_inv if rowwise else t._column_scales()), rowwise


def _emulated_bf16(a, a_usage, b, b_usage, out_dtype, bias):
    """Both MXFP8 operands dequantized to bf16 (exact) in one kernel, then a
    bf16 GEMM: rowwise copies are (M, K) operands, columnwise ones (K, M)
    transposed views cuBLAS reads as they are."""
    (ad, asc, arow), (bd, bsc, brow) = _mx_copy(a, a_usage), _mx_copy(b, b_usage)
    a16, b16 = get("dequantize_mxfp8_pair", ad)(ad, asc, arow, bd, bsc, brow, torch.bfloat16)
    out = torch.nn.functional.linear(a16 if arow else a16.t(), b16 if brow else b16.t())
    return _add_bias(out if out.dtype == out_dtype else out.to(out_dtype), bias)


@functools.lru_cache(maxsize=None)
def _has_mm_out_dtype() -> bool:
    """Whether torch has ``aten::mm.dtype`` (bf16 operands, fp32 product)."""
    return hasattr(torch.ops.aten.mm, "dtype")


# products of at most this many multiply-adds (M * N * K), none of M, N, K
# above NVFP4_FUSED_DIM, run in one kernel (kernels/triton_nvfp4_gemm.py):
# there it costs about the GPU time of the three kernels (H200: 7.2 against
# 8.2 us at 256^3, 11.5 against 8.8 at 128 x 1024 x 512) and ~70 us less host
# time.  Larger products cost it more GPU time (it decodes an operand tile
# once per output tile: 11.8 against 9.4 us at 512^3, 3x at 1024^3), and a
# long K loop over few tiles more still (256 x 256 x 2048: ~4x; single
# GEMMs timed on an H200)
NVFP4_FUSED_MAX = 1 << 26
NVFP4_FUSED_DIM = 1024


def nvfp4_fused(m: int, n: int, k: int) -> bool:
    """Whether an emulated NVFP4 product of (M, K) by (N, K) runs in one
    kernel.  Symmetric in M, N and K: a te.Linear call's three products
    (fprop, dgrad, wgrad) multiply the same three sizes, so they all take
    the same path; the native eager path (module/linear/native.py) asks
    the same question."""
    return m * n * k <= NVFP4_FUSED_MAX and max(m, n, k) <= NVFP4_FUSED_DIM


def _emulated_nvfp4(a, a_usage, b, b_usage, out_dtype, bias):
    a.gemm_operand_check(a_usage)
    b.gemm_operand_check(b_usage)
    (ad, asc, aamax), (bd, bsc, bamax) = a.copy_parts(a_usage), b.copy_parts(b_usage)
    if nvfp4_fused(ad.shape[0], bd.shape[0], ad.shape[1] * 2):
        return get("nvfp4_gemm", ad)((ad, asc, aamax), (bd, bsc, bamax), bias, out_dtype)
    a16, b16 = get("dequantize_nvfp4_blocks_pair", ad)(ad, asc, bd, bsc)  # one launch
    acc = torch.mm(a16, b16.t(), out_dtype=torch.float32)
    return get("nvfp4_gemm_epilogue", acc)(acc, aamax, bamax, bias, out_dtype)


def gemm_cuda(a, a_usage: str, b, b_usage: str, out_dtype: torch.dtype,
              bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``A @ B^T (+ bias)`` in ``out_dtype`` on the fastest path for the operands."""
    path = gemm_path(a, b, out_dtype)
    out = None
    if path == "fp8_tensorwise":
        out = _fp8_tensorwise(a, a_usage, b, b_usage, out_dtype, bias, fast_accum)
    elif path == "fp8_blockwise":
        out = _fp8_blockwise(a, a_usage, b, b_usage, out_dtype, bias)
    elif path == "emulated_bf16":
        out = _emulated_bf16(a, a_usage, b, b_usage, out_dtype, bias)
    elif path == "emulated_nvfp4":
        out = _emulated_nvfp4(a, a_usage, b, b_usage, out_dtype, bias)
    if out is None:  # "bf16", "reference", or a shape cuBLAS refuses
        out = gemm_reference(a, a_usage, b, b_usage, out_dtype, bias)
    return out


def _register() -> None:
    register_fast("gemm", "cuda", gemm_cuda)  # cuBLAS through torch: no Triton needed


on_load("cuda", _register)
