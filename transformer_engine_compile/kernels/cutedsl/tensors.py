"""torch tensors and streams as the CuTe DSL takes them."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass.cute.runtime import from_dlpack

_ELEMENT = {torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.float8_e5m2: cutlass.Float8E5M2}


def to_cute(t: torch.Tensor, leading_dim: int, align: int = 16):
    """``t`` (any strides, ``leading_dim`` contiguous) with a dynamic layout:
    a kernel compiled for one such tensor takes any other of the same rank,
    dtype and contiguous dim.  FP8 travels as bytes (DLPack has no FP8)."""
    element = _ELEMENT.get(t.dtype)
    c = from_dlpack(t.view(torch.uint8) if element is not None else t, assumed_align=align)
    if element is not None:
        c.element_type = element
    return c.mark_layout_dynamic(leading_dim=leading_dim)


def current_stream():
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
