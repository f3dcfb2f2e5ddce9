"""Registration of the CUDA fast paths (see kernels/__init__.py).

Quantization and normalisation kernels need Triton.  The GEMM, which
needs only torch's cuBLAS bindings, reads the quantized formats and so
registers from ``quantization.gemm`` (:func:`~..kernels.on_load`).  Either is skipped, with the reference used instead, when its
requirement is missing: ``available()`` reports what was registered.
"""

from __future__ import annotations

import importlib.util

_REGISTERED: list[str] = []


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def register() -> None:
    from . import register_fast
    if not triton_available():
        return
    from . import triton_quant as tq
    for name in ("amax", "quantize_fp8_tensorwise", "quantize_fp8_current_pair_from_parts",
                 "delayed_scaling_step", "run_step", "transpose_bytes"):
        register_fast(name, "cuda", getattr(tq, name))
        _REGISTERED.append(name)
    from . import triton_delayed as td  # one launch where it may, else triton_quant's two
    register_fast("quantize_fp8_delayed", "cuda", td.quantize_fp8_delayed)
    _REGISTERED.append("quantize_fp8_delayed")
    from . import triton_current as tc  # one launch where it may, else triton_quant's two
    for name in ("quantize_fp8_current", "quantize_fp8_current_pair"):
        register_fast(name, "cuda", getattr(tc, name))
        _REGISTERED.append(name)
    from . import triton_cast_many  # FSDP2's FP8 shards after the optimizer step
    register_fast("quantize_fp8_many", "cuda", triton_cast_many.quantize_fp8_many)
    _REGISTERED.append("quantize_fp8_many")
    from . import triton_grouped
    for name in ("amax_grouped", "current_scales_grouped", "cast_fp8_grouped"):
        register_fast(name, "cuda", getattr(triton_grouped, name))
        _REGISTERED.append(name)
    from . import triton_block as tbk
    for name in ("quantize_fp8_blockwise", "quantize_fp8_blockwise_pair",
                 "quantize_fp8_blockwise_rows", "quantize_mxfp8",
                 "quantize_mxfp8_pair", "dequantize_mxfp8", "dequantize_mxfp8_pair"):
        register_fast(name, "cuda", getattr(tbk, name))
        _REGISTERED.append(name)
    from . import triton_nvfp4 as tn4
    for name in ("quantize_nvfp4", "quantize_nvfp4_pair", "dequantize_nvfp4_blocks", "dequantize_nvfp4_blocks_pair",
                 "nvfp4_gemm_epilogue"):
        register_fast(name, "cuda", getattr(tn4, name))
        _REGISTERED.append(name)
    from . import triton_nvfp4_gemm as tg
    register_fast("nvfp4_gemm", "cuda", tg.nvfp4_gemm)
    _REGISTERED.append("nvfp4_gemm")
    from . import triton_norm as tn
    for name in ("norm_forward", "norm_forward_fp8", "norm_backward"):
        register_fast(name, "cuda", getattr(tn, name))
        _REGISTERED.append(name)
    from . import triton_bias as tb
    for name in ("bias_add", "column_sum"):
        register_fast(name, "cuda", getattr(tb, name))
        _REGISTERED.append(name)
    from . import triton_act as ta
    for name in ("activation_forward", "activation_backward"):
        register_fast(name, "cuda", getattr(ta, name))
        _REGISTERED.append(name)


def available() -> tuple:
    """Names of the kernel ops that have a CUDA fast path on this install
    (the GEMM, registered by quantization.gemm, first)."""
    from . import has_fast
    return ("gemm",) * has_fast("gemm", "cuda") + tuple(_REGISTERED)
