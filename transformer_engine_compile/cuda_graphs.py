"""Preparing a process for CUDA-graph capture.

A CUDA graph records kernel launches; it cannot record work that happens on
the host the first time something is used: Triton compiling and loading a
kernel, cuBLAS/cuBLASLt creating a handle, a library allocating a workspace.
``torch.compile(mode="reduce-overhead")`` runs each graph once eagerly
before recording it, which does that work in time.  Code that captures by
hand (``torch.cuda.graph``) must do it first: call
:func:`prepare_cuda_graphs` once, after the model is on the GPU and before
the first capture.  Our own kernels create no lazy global tensors (their
constants are built on the device inside each call), so after this warm-up
nothing is allocated or compiled behind the graph's back.
"""

from __future__ import annotations

import torch

from . import kernels, recipe
from .quantization.gemm import gemm
from .quantization.factory import quantizer_for

_WARM_RECIPES = (recipe.Float8CurrentScaling(), recipe.Float8BlockScaling(),
                 recipe.MXFP8BlockScaling(), recipe.NVFP4BlockScaling())


def prepare_cuda_graphs(device=None, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Warm every kernel and GEMM path of every recipe on ``device`` (default:
    the current CUDA device) on the current stream, then synchronize.

    Returns the names of the kernel ops that have a fast CUDA path here.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("prepare_cuda_graphs needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 256, device=device, dtype=dtype, generator=gen)
    w = torch.randn(256, 256, device=device, dtype=dtype, generator=gen)
    gemm(x, "rowwise", w, "rowwise", dtype)  # the plain cuBLAS handle
    for rec in _WARM_RECIPES:
        xq = quantizer_for(rec, "input", internal=True).quantize(x)
        wq = quantizer_for(rec, "weight", internal=True).quantize(w)
        gq = quantizer_for(rec, "grad_output", internal=True).quantize(x)
        gemm(xq, "rowwise", wq, "rowwise", dtype, fast_accum=True)  # fprop
        gemm(gq, "rowwise", wq, "columnwise", dtype)  # dgrad
        gemm(gq, "columnwise", xq, "columnwise", dtype)  # wgrad
    torch.cuda.synchronize(device)
    from .kernels import cuda
    return cuda.available() if kernels.fast_kernels_available("cuda") else ()
