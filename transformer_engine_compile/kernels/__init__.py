"""One dispatch point per kernel operation.

``get(name, x)`` returns the implementation to run on ``x``: a fast kernel
registered for ``x``'s device type, or the reference torch implementation in
``kernels.reference`` (which runs everywhere and defines the numerics).  Fast
quantization kernels must return exactly the reference's buffers; a fast GEMM
may differ from the reference GEMM only by its accumulation order (tests
compare both).  The CUDA kernels (Triton quantization, cuBLAS GEMMs) register
themselves the first time a CUDA tensor asks, and only when Triton imports:
CPU installs never import them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import reference, tracing

OPS = (
    "amax",
    "quantize_fp8_tensorwise",
    "quantize_fp8_delayed",
    "quantize_fp8_current",
    "quantize_fp8_current_pair",
    "quantize_fp8_current_pair_from_parts",
    "quantize_fp8_many",
    "amax_grouped",
    "current_scales_grouped",
    "cast_fp8_grouped",
    "quantize_mxfp8",
    "quantize_mxfp8_pair",
    "quantize_fp8_blockwise",
    "quantize_fp8_blockwise_pair",
    "quantize_fp8_blockwise_rows",
    "quantize_nvfp4",
    "quantize_nvfp4_pair",
    "dequantize_mxfp8",
    "dequantize_mxfp8_pair",
    "dequantize_nvfp4_blocks",
    "dequantize_nvfp4_blocks_pair",
    "nvfp4_gemm_epilogue",
    "nvfp4_gemm",
    "delayed_scaling_step",
    "run_step",
    "gemm",
    "norm_forward",
    "norm_forward_fp8",
    "norm_backward",
    "activation_forward",
    "activation_backward",
    "transpose_bytes",
    "bias_add",
    "column_sum",
)

_FAST: dict[tuple[str, str], Callable] = {}
_fast_enabled = True
_loaded_devices: set[str] = set()


def register_fast(name: str, device_type: str, fn: Callable) -> None:
    """Register a fast implementation of op ``name`` for one device type."""
    if name not in OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {OPS}")
    _FAST[(name, device_type)] = fn


def set_fast_kernels(enabled: bool) -> None:
    """Globally enable/disable fast kernels (tests compare both paths)."""
    global _fast_enabled
    _fast_enabled = bool(enabled)


def fast_kernels_available(device_type: str) -> bool:
    """Whether fast kernels exist for ``device_type`` (e.g. CUDA with Triton)."""
    _load(device_type)
    return any(dev == device_type for _, dev in _FAST)


def has_fast(name: str, device_type: str) -> bool:
    """Whether op ``name`` has a fast kernel registered for ``device_type``."""
    _load(device_type)
    return (name, device_type) in _FAST


_LOADERS: dict[str, list] = {}


def on_load(device_type: str, register: Callable) -> None:
    """Call ``register`` when ``device_type``'s fast kernels load (now if
    they have): how a layer above this package (the GEMM over quantized
    formats, ``quantization.gemm``) adds its fast kernel."""
    if device_type in _loaded_devices:
        register()
    else:
        _LOADERS.setdefault(device_type, []).append(register)


def _load(device_type: str) -> None:
    if device_type in _loaded_devices:
        return
    _loaded_devices.add(device_type)
    if device_type == "cuda":
        from . import cuda  # registers what this machine supports
        cuda.register()
    for register in _LOADERS.pop(device_type, ()):
        register()


def get(name: str, x: torch.Tensor, fallback: Optional[Callable] = None) -> Callable:
    # Code that Dynamo traces (a quantizer called directly in a compiled
    # region) gets the reference, which inductor fuses itself; the custom
    # ops run their impls at run time, where the fast kernels apply, or are
    # lowered into inductor with the fast kernels traced (kernels/tracing.py).
    if _fast_enabled and (tracing.active or not torch.compiler.is_compiling()):
        device_type = x.device.type
        if device_type not in _loaded_devices:
            _load(device_type)
        fn = _FAST.get((name, device_type))
        if fn is not None:
            return fn
    return fallback if fallback is not None else getattr(reference, name)
