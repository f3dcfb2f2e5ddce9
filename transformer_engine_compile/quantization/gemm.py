"""The one GEMM shape every linear-layer product uses: ``out = A @ B^T``.

Both operands are reduced along their last dimension ("TN", K-major, the
layout Hopper's FP8 tensor cores take).  With ``x (M, K)``, ``w (N, K)`` and
``dy (M, N)``:

* fprop  ``y  = x  @ w^T``: A = x rowwise ``(M, K)``,   B = w rowwise ``(N, K)``
* dgrad  ``dx = dy @ w``:   A = dy rowwise ``(M, N)``,  B = w columnwise ``(K, N)``
* wgrad  ``dw = dy^T @ x``: A = dy columnwise ``(N, M)``, B = x columnwise ``(K, M)``

A quantized operand is a storage plus the usage (copy) to read; a plain
tensor is used as is.  The reference path dequantizes quantized operands to
fp32 and multiplies in fp32 (an exact emulation of a GEMM that accumulates
in fp32); unquantized operands multiply in their own dtype, as ``F.linear``
does, unless ``out_dtype`` is wider (fp32 main_grad): then in fp32 too.  Fast GPU GEMMs register under the name ``"gemm"`` (``cuda_gemm``).
"""

from __future__ import annotations

import torch

from ..kernels import get
from .base import QuantizedTensorStorage


def operand(t, usage: str) -> torch.Tensor:
    """2-D operand reduced along its last dim (see module docstring)."""
    if isinstance(t, QuantizedTensorStorage):
        return t.gemm_operand(usage)
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if usage == "rowwise" else t2d.t()


def gemm_reference(a, a_usage: str, b, b_usage: str, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``A @ B^T (+ bias)`` in ``out_dtype``; fp32 math when any operand is
    quantized.  ``fast_accum`` is a hint for fast paths; the reference ignores it."""
    quantized = isinstance(a, QuantizedTensorStorage) or isinstance(b, QuantizedTensorStorage)
    a2, b2 = operand(a, a_usage), operand(b, b_usage)
    if not quantized and out_dtype.itemsize > a2.dtype.itemsize:
        quantized = True  # e.g. a bf16 wgrad into an fp32 main_grad: no bf16 rounding
    if not quantized:
        out = torch.nn.functional.linear(a2, b2, bias)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    out = a2.float() @ b2.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def gemm(a, a_usage: str, b, b_usage: str, out_dtype: torch.dtype,
         bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """Dispatching entry point: a fast ``"gemm"`` kernel for the device, else
    the reference.  ``fast_accum``: fprop may use reduced-precision accumulation."""
    probe = a if isinstance(a, torch.Tensor) else next(iter(a.buffers().values()))
    return get("gemm", probe, gemm_reference)(a, a_usage, b, b_usage, out_dtype, bias,
                                              fast_accum)
