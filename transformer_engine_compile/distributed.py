"""Tensor and sequence parallelism for ``te.Linear`` (Megatron layout).

The collectives here run *inside* te.Linear's custom ops (the real impls),
so Dynamo's and AOTAutograd's graphs hold one opaque op per layer and
direction, never a collective of their own; the fakes only model shapes
(see module/linear/ops.py).  Inductor lowers the op calls into their
kernels, and these functions then trace torch's functional collectives
(:func:`traced_collectives`).

Column parallel splits ``out_features``; row parallel splits ``in_features``
and sums the partial outputs over the group.  With sequence parallelism the
activations outside the layer pair are split along dim 0 (the sequence):

=============  =====================================  =====================================
mode           forward                                backward
=============  =====================================  =====================================
column         (SP: all-gather x along dim 0)         dx: all-reduce (SP: reduce-scatter)
row            y: all-reduce (SP: reduce-scatter);    (SP: all-gather dy along dim 0)
               bias added after the reduction
=============  =====================================  =====================================

Quantized gathers: under FP8 current scaling the shard is quantized first
with the amax all-reduced (max) over the group, and the FP8 bytes are
gathered (half the traffic of bf16).  Every rank then holds exactly the
bytes that quantizing the whole tensor gives.  This applies to the column
layer's input (forward) and the row layer's grad_output (backward), the
tensors Transformer Engine reduces amaxes for.  Block-scaled formats
(MXFP8, FP8 blockwise, NVFP4) gather in high precision and quantize the
whole tensor, which also equals quantizing it on one device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import kernels
from . import compat
from .kernels import tracing
from .quantization.base import flat_2d

PARALLEL_MODES = (None, "column", "row")
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# -- collectives (real tensors, inside the ops) --------------------------------------
def gather_first_dim(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    """All ranks' ``x`` concatenated along dim 0, in rank order (not
    differentiable: the ops' backward does the matching collective)."""
    x = x.detach().contiguous()
    fp8 = x.dtype in _FLOAT8  # gather the bytes: gloo and older NCCL have no float8
    if traced_collectives():
        out = _funcol().all_gather_tensor(x.view(torch.uint8) if fp8 else x, 0, group)
        return out.view(x.dtype) if fp8 else out
    out = x.new_empty((x.shape[0] * tp_size, *x.shape[1:]))
    if fp8:
        compat.all_gather_single(out.view(torch.uint8), x.view(torch.uint8), group)
    else:
        compat.all_gather_single(out, x, group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    """Sum of all ranks' ``x``, this rank's chunk of dim 0."""
    x = x.detach().contiguous()
    if traced_collectives():
        return _funcol().reduce_scatter_tensor(x, "sum", 0, group)
    out = x.new_empty((x.shape[0] // tp_size, *x.shape[1:]))
    compat.reduce_scatter_single(out, x, group)
    return out


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks: a fresh contiguous tensor (``x`` itself where it was
    one, summed in place)."""
    x = x.contiguous()
    if traced_collectives():
        return _funcol().all_reduce(x, "sum", group)
    dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Max over ranks: ``x`` in place, or a new tensor inside a lowered
    trace (callers use the result)."""
    if traced_collectives():
        return _funcol().all_reduce(x, "max", group)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def traced_collectives() -> bool:
    """Whether an op's impl is being traced into inductor's graph
    (``dynamo/lowering.py``): the collectives are then torch's functional
    collectives, which inductor schedules and launches from its generated
    code as it does for torch's own tensor parallelism, instead of c10d
    calls from the op's Python at run time.  Same NCCL collectives on the
    same buffers, so the results are the eager op's."""
    return tracing.active


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def gather_and_quantize(x: torch.Tensor, quantizer, group, tp_size: int, *,
                        quantized_gather: bool = True, quantize=None):
    """Gather ``x`` along dim 0 and quantize it: ``(x_total, xq_total)``.

    ``x_total`` is the gathered high-precision tensor, or None when only the
    quantized one was gathered (FP8 current scaling with ``quantized_gather``);
    ``xq_total`` is the GEMM operand (``x_total`` itself without a quantizer).
    ``quantize(total)`` quantizes a high-precision total instead of
    ``quantizer.quantize`` (DelayedScaling: with the layer's scale, recording
    the total's amax, the same on every rank)."""
    if quantizer is None:
        total = gather_first_dim(x, group, tp_size)
        return total, total
    if gathers_quantized(quantizer, quantized_gather):
        return None, _gather_fp8_current(x, quantizer, group, tp_size)
    total = gather_first_dim(x, group, tp_size)
    return total, (quantizer.quantize if quantize is None else quantize)(total)


def gathers_quantized(quantizer, quantized_gather: bool = True) -> bool:
    """Whether :func:`gather_and_quantize` gathers quantized bytes (no
    high-precision total); the fakes ask the same question."""
    return quantized_gather and quantizer.gathers_quantized


def _gather_fp8_current(x, quantizer, group, tp_size):
    """Quantize the shard with the group's amax, gather the FP8 rowwise bytes
    and transpose them locally for the columnwise copy (same scale)."""
    x2d = x.detach().reshape(flat_2d(x.shape))
    amax = kernels.get("amax", x2d)(x2d).reshape(1).float()
    amax = all_reduce_max(amax, group)
    local = quantizer.with_usage(rowwise=True, columnwise=False).quantize_with_amax(x, amax)
    data = gather_first_dim(local._data, group, tp_size)
    buffers = {"scale_inv": local._scale_inv}
    if quantizer.rowwise_usage:
        buffers["data"] = data
    if quantizer.columnwise_usage:
        buffers["transpose"] = data.reshape(flat_2d(data.shape)).t().contiguous()
    return quantizer._build(data.shape, x.dtype, buffers)


# -- shapes (fakes and checks) -------------------------------------------------------
def gathered_shape(shape, tp_size: int) -> tuple:
    return (shape[0] * tp_size, *shape[1:])


def scattered_shape(shape, tp_size: int) -> tuple:
    return (shape[0] // tp_size, *shape[1:])


# -- user helpers --------------------------------------------------------------------
def shard_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of ``x`` along dim 0 (the sequence), for SP inputs."""
    tp_size = dist.get_world_size(group)
    if x.shape[0] % tp_size != 0:
        raise ValueError(f"shard_sequence: dim 0 ({x.shape[0]}) is not divisible by the "
                         f"group size {tp_size}")
    return x.chunk(tp_size, dim=0)[dist.get_rank(group)]


def shard_parameter(full: torch.Tensor, parallel_mode: Optional[str], rank: int, tp_size: int,
                    *, is_bias: bool = False) -> torch.Tensor:
    """Rank ``rank``'s shard of a full (out, in) weight or (out,) bias.

    Column: rows of the weight and of the bias; row: columns of the weight,
    the bias whole (it is added once, after the reduction)."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
    if parallel_mode is None or (parallel_mode == "row" and is_bias):
        return full
    dim = 0 if parallel_mode == "column" else 1
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"shard_parameter: dim {dim} of shape {tuple(full.shape)} is not "
                         f"divisible by tp_size {tp_size}")
    return full.chunk(tp_size, dim=dim)[rank]
