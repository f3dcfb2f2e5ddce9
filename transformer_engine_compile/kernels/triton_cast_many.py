"""FP8 current-scaling casts of many tensors in one launch, their amaxes given.

After the optimizer step ``te.fsdp.precompute_scales`` quantizes every shard
that FSDP2 gathers in FP8, each with its whole weight's amax (all-reduced
before, in one collective).  One launch per weight costs its host time
(arguments, allocations, the launch: tens of microseconds each, on a step
whose host is its critical path); :func:`quantize_fp8_many` casts them all
in one.  Its programs find their tensor in a table of addresses, sizes and
first programs (one int64 tensor, copied to the device with the launch),
and cast with the same device functions as the one-tensor kernel, so the
bytes and ``scale_inv`` equal :func:`triton_quant.quantize_fp8_current`'s
with the same amax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, next_pow2, ptr_key
from .triton_quant import _MAX_PARTS, _TL_FP8, _cast_fp8, _recip, _scale_from_parts

_BLOCK = 4096  # elements a program casts
# every output starts on a 16-byte boundary, as a tensor of its own would: the
# FP8 GEMMs (cuBLASLt) refuse a scale or an operand that does not
# (CUBLAS_STATUS_NOT_SUPPORTED), so the scale_inv are 4 floats apart and
# each tensor's bytes start at a multiple of 16
_ALIGN = 16
_SINV_STRIDE = _ALIGN // 4
_TL_SRC = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _cast_many_kernel(table_ptr, amax_ptr, sinv_ptr, N, FMT_MAX: tl.constexpr,
                      EPS: tl.constexpr, POW2: tl.constexpr, SRC: tl.constexpr,
                      OUT: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr,
                      NP: tl.constexpr, SINV_STRIDE: tl.constexpr):
    """Program p casts block p - first[i] of tensor i, the last i with
    first[i] <= p.  ``table_ptr``: int64 [4, N] (source addresses,
    destination addresses, element counts, first programs); ``amax_ptr``:
    the N amaxes as int32 bits; ``sinv_ptr``: the N ``scale_inv`` (written
    by each tensor's first program)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, NT)
    firsts = tl.load(table_ptr + 3 * N + lanes, mask=lanes < N, other=1 << 62)
    i = tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1
    src = tl.load(table_ptr + i).to(tl.pointer_type(SRC))
    dst = tl.load(table_ptr + N + i).to(tl.pointer_type(OUT))
    n = tl.load(table_ptr + 2 * N + i)
    b = pid - tl.load(table_ptr + 3 * N + i)
    s = _scale_from_parts(amax_ptr + i, 1, FMT_MAX, EPS, POW2, NP)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, _cast_fp8(x, s, FMT_MAX, OUT), mask=mask)
    if b == 0:
        tl.store(sinv_ptr + i * SINV_STRIDE, _recip(s))


_cast_many_launch = Launcher(_cast_many_kernel)


def quantize_fp8_many(tensors: list, amaxes: torch.Tensor, fmt: str, pow2: bool,
                      eps: float) -> list:
    """``[(data, scale_inv)]``: each contiguous tensor of ``tensors`` (one
    dtype, one device) cast to FP8 with the scale of its fp32 amax in
    ``amaxes`` (shape ``(len(tensors),)``), as ``quantize_fp8_current(x,
    ..., amax=amaxes[i:i + 1])`` would; the data keep each tensor's shape
    (views of one buffer, each 16-byte aligned), ``scale_inv`` has shape
    (1,) (16-byte aligned too)."""
    if not tensors:
        return []
    dtype, device = tensors[0].dtype, tensors[0].device
    if (dtype not in _TL_SRC or any(t.dtype != dtype or t.device != device
                                    or not t.is_contiguous() for t in tensors)):
        raise ValueError("quantize_fp8_many: contiguous tensors of one float dtype and device")
    numels = [t.numel() for t in tensors]
    if 0 in numels:  # an empty tensor has no program to write its scale_inv
        return ref.quantize_fp8_many(tensors, amaxes, fmt, pow2, eps)
    blocks = [cdiv(n, _BLOCK) for n in numels]
    spans = [cdiv(n, _ALIGN) * _ALIGN for n in numels]  # FP8: one byte an element
    data = torch.empty(sum(spans), dtype=ref.FP8_DTYPE[fmt], device=device)
    sinv = torch.empty((len(tensors), _SINV_STRIDE), dtype=torch.float32, device=device)
    outs, firsts, starts, first, start = [], [], [], 0, 0
    for t, n, nb, span in zip(tensors, numels, blocks, spans):
        outs.append(data[start:start + n].view(t.shape))
        firsts.append(first)
        starts.append(start)
        first, start = first + nb, start + span
    base = data.data_ptr()
    table = torch.tensor([t.data_ptr() for t in tensors]
                         + [base + s * data.element_size() for s in starts]
                         + numels + firsts, dtype=torch.int64, pin_memory=data.is_cuda)
    table = table.to(device, non_blocking=True)
    amax_bits = amaxes.float().contiguous().view(torch.int32)
    n = len(tensors)
    key = (dtype, fmt, float(eps), bool(pow2), int_key(n), ptr_key(amax_bits))
    _cast_many_launch((first,), key, table, amax_bits, sinv, n, ref.FP8_MAX[fmt], float(eps),
                      bool(pow2), _TL_SRC[dtype], _TL_FP8[fmt], _BLOCK, next_pow2(n),
                      _MAX_PARTS, _SINV_STRIDE)
    return [(out, sinv[i, :1]) for i, out in enumerate(outs)]
