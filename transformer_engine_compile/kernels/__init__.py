"""One dispatch point per kernel operation.

``get(name, x)`` returns the implementation to run on ``x``: a fast kernel
registered for ``x``'s device type, or the reference torch implementation in
``kernels.reference`` (which runs everywhere and defines the numerics).  Fast
kernels must return exactly what the reference returns; tests compare them.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import reference

OPS = (
    "quantize_fp8_tensorwise",
    "quantize_mxfp8",
    "quantize_fp8_blockwise",
    "quantize_nvfp4",
    "gemm",
)

_FAST: dict[tuple[str, str], Callable] = {}
_fast_enabled = True


def register_fast(name: str, device_type: str, fn: Callable) -> None:
    """Register a fast implementation of op ``name`` for one device type."""
    if name not in OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {OPS}")
    _FAST[(name, device_type)] = fn


def set_fast_kernels(enabled: bool) -> None:
    """Globally enable/disable fast kernels (tests compare both paths)."""
    global _fast_enabled
    _fast_enabled = bool(enabled)


def get(name: str, x: torch.Tensor) -> Callable:
    if _fast_enabled:
        fn = _FAST.get((name, x.device.type))
        if fn is not None:
            return fn
    if name == "gemm":  # lives in gemm.py, which imports quantization (import cycle)
        from .gemm import gemm_reference
        return gemm_reference
    return getattr(reference, name)
