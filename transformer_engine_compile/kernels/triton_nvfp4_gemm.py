"""The emulated NVFP4 GEMM in one Triton kernel: ``out = A @ B^T`` of two
packed NVFP4 copies, both K-major (every NVFP4 product of te.Linear is:
fprop x by W, dgrad dy by W's columnwise copy, wgrad dy's columnwise copy
by x's).

Each program dequantizes its operand tiles in registers, exactly as
``reference.dequantize_nvfp4_blocks`` does (an E2M1 value times its E4M3
block scale is exact in bf16), multiplies them on the bf16 tensor cores
into fp32, and applies ``reference.nvfp4_gemm_epilogue`` (both per-tensor
scales, the bias, one rounding) to its accumulator.  The three-kernel path
of quantization/cuda_gemm.py (dequantize both operands, ``torch.mm`` into fp32,
the epilogue) computes the same products in cuBLAS's order; this one sums
them in the order of its K loop, so the two agree to fp32 accumulation
rounding, not bit for bit (tests bound the difference).

Why: the three kernels cost three launches and two allocations of host
time per GEMM and a round trip of the fp32 product through memory; on
small (host-bound) calls one launch serves (single GEMMs timed on an
H200).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import native
from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, ptr_key
from .triton_nvfp4 import _GLOBAL_MAX, _TL_OUT, _blocks_values
from .triton_quant import _scale_from_amax, _store_rows


@triton.jit
def _nvfp4_gemm_kernel(a_ptr, as_ptr, amax_a_ptr, b_ptr, bs_ptr, amax_b_ptr, bias_ptr, out_ptr,
                       M, N, K, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                       DOT: tl.constexpr):
    """One (BM, BN) tile of the output; tiles ordered in groups of GROUP
    row tiles, so neighbouring programs share operand tiles in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP * tiles_n)
    first = group * GROUP
    size = tl.minimum(tiles_m - first, GROUP)
    pid_m = first + (pid % (GROUP * tiles_n)) % size
    pid_n = (pid % (GROUP * tiles_n)) // size
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = _blocks_values(a_ptr, as_ptr, rm, M, K, k0, BM, BK).to(DOT)
        b = _blocks_values(b_ptr, bs_ptr, rn, N, K, k0, BN, BK).to(DOT)
        acc = tl.dot(a, tl.trans(b), acc)
    ga = _scale_from_amax(tl.load(amax_a_ptr), _GLOBAL_MAX, 0.0, False)
    gb = _scale_from_amax(tl.load(amax_b_ptr), _GLOBAL_MAX, 0.0, False)
    y = tl.math.div_rn(tl.math.div_rn(acc, tl.zeros_like(acc) + ga), tl.zeros_like(acc) + gb)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    rm_s = pid_m * BM + tl.arange(0, BM)  # the store's indices apart from the loads
    rn_s = pid_n * BN + tl.arange(0, BN)  # (triton_quant._tile_index says why)
    _store_rows(out_ptr, y.to(OUT), rm_s, rn_s, (rm_s[:, None] < M) & (rn_s[None, :] < N), N)


# tiles: 64 x 32 outputs, K in steps of 128 (the fastest of 13 tilings at
# 256^3, 256 x 1024 x 256 and 512^3 on an H200, docs/benchmarks.md)
_BM, _BN, _BK, _GROUP = 64, 32, 128, 8
# the tensor cores' input; Triton's interpreter multiplies bf16 tiles as their
# raw bits, so there (CPU tests) the same exact values go in as fp32
_DOT = tl.float32 if os.environ.get("TRITON_INTERPRET", "0") == "1" else tl.bfloat16
_gemm_launch = Launcher(_nvfp4_gemm_kernel, num_warps=4)


def fused_case(a_packed, a_scale, b_packed, b_scale, out_dtype, bias) -> bool:
    """Whether the kernel takes these operands: packed (rows, K / 2) uint8
    with (rows, K / 16) E4M3 scales, the same K, an output dtype it writes."""
    k = a_packed.shape[1] * 2
    return (a_packed.numel() > 0 and b_packed.numel() > 0 and b_packed.shape[1] * 2 == k
            and out_dtype in _TL_OUT and a_packed.dtype == torch.uint8
            and b_packed.dtype == torch.uint8 and a_scale.dtype == torch.float8_e4m3fn
            and b_scale.dtype == torch.float8_e4m3fn
            and a_scale.shape == (a_packed.shape[0], k // 16)
            and b_scale.shape == (b_packed.shape[0], k // 16)
            and (bias is None or (bias.dtype in _TL_OUT and bias.shape == (b_packed.shape[0],))))


def gemm_call(a, b, bias, out) -> tuple:
    """The kernel's launch into ``out`` (M, N), not launched: ``(launcher,
    grid, key, args)``; ``a``, ``b``: ``(packed, scales, amax)`` of each
    operand, contiguous and of :func:`fused_case`."""
    (ad, asc, aamax), (bd, bsc, bamax) = a, b
    m, n, k = ad.shape[0], bd.shape[0], ad.shape[1] * 2
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    grid = (cdiv(m, _BM) * cdiv(n, _BN),)
    key = (ptr_key(ad), ptr_key(asc), ptr_key(aamax), ptr_key(bd), ptr_key(bsc), ptr_key(bamax),
           int_key(m), int_key(n), int_key(k), bias_arg.dtype, ptr_key(bias_arg), has_bias,
           out.dtype)
    return (_gemm_launch, grid, key,
            (ad, asc, aamax, bd, bsc, bamax, bias_arg, out, m, n, k, has_bias,
             _TL_OUT[out.dtype], _BM, _BN, _BK, _GROUP, _DOT))


def nvfp4_gemm(a, b, bias, out_dtype) -> torch.Tensor:
    """``reference.nvfp4_gemm`` in one launch (``a``, ``b``: ``(packed,
    scales, amax)`` of two K-major copies)."""
    if not fused_case(a[0], a[1], b[0], b[1], out_dtype, bias):
        return ref.nvfp4_gemm(a, b, bias, out_dtype)
    a = tuple(t if t.is_contiguous() else t.contiguous() for t in a)
    b = tuple(t if t.is_contiguous() else t.contiguous() for t in b)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out, = native.empty_many(a[0], ((a[0].shape[0], b[0].shape[0]), out_dtype))
    launcher, grid, key, args = gemm_call(a, b, bias, out)
    launcher(grid, key, *args)
    return out
