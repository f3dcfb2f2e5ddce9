"""Which ``te.Linear`` op calls inductor may replace by their kernels
(``dynamo/lowering.py``): those whose kernels round exactly as eager does."""

from __future__ import annotations

import dataclasses

import torch

from ... import kernels
from ...quantization.base import QuantizedTensorStorage
from ...quantization.mxfp8 import MXFP8Quantizer
from ...quantization.nvfp4 import NVFP4Quantizer
from .args import LinearBwdArgs, LinearFwdArgs


def _lowers_forward(args: LinearFwdArgs) -> bool:
    """Whether inductor may replace a forward call by its kernels
    (dynamo/lowering.py).  A bias only on a quantized GEMM whose device
    adds it in a kernel (``_scaled_mm``'s epilogue, else ``bias_add``): as a
    torch op inductor would fuse the add with its neighbours, rounding
    otherwise than eager; the unquantized GEMM adds it in ``F.linear``,
    which inductor may split into ``mm`` + add.  Under DelayedScaling only
    where the casts are Triton kernels: the forward reads the scale buffer
    it also updates, and AOT's partitioner may recompute torch ops (the
    reference casts) in the backward, which would then read the new scale;
    it never recomputes a ``wrap_triton`` kernel (not on its allowlist)."""
    bias_ok = args.bias is None or (args.input_quantizer is not None
                                    and _has_fast_kernel("bias_add", args))
    out_dtype = None if args.inp is None else args.inp.dtype
    forward_quantizers = (args.input_quantizer, args.weight_quantizer, args.output_quantizer)
    return (bias_ok and _delayed_lowers(args.amax_history_fwd, args)
            and _lowerable_formats(forward_quantizers, args)
            and not mxfp8_converted_output(args.input_quantizer, out_dtype))


def _delayed_lowers(history, args) -> bool:
    """No delayed scaling (``history`` None), or its casts are Triton kernels."""
    return history is None or _has_fast_kernel("quantize_fp8_tensorwise", args)


def _lowers_backward(args: LinearBwdArgs) -> bool:
    """A bias gradient only where a kernel sums it (``column_sum``: inductor
    would order a torch reduction its own way).  DelayedScaling as the
    forward: where the casts are Triton kernels (they take each amax slot as
    an fp32 element and cast the pointer themselves: inductor cannot lower
    a dtype view of one element of a buffer as a kernel argument, torch
    2.11)."""
    bias_ok = not args.bias_requires_grad or _has_fast_kernel("column_sum", args)
    q = args.grad_output_quantizer
    wgrad_dtype = None
    if args.weight_requires_grad:
        wgrad_dtype = args.weight_dtype if args.main_grad is None else args.main_grad.dtype
    dgrad_dtype = None if args.grad_output is None else args.grad_output.dtype
    backward_quantizers = (args.input_quantizer, args.weight_quantizer, q,
                           args.grad_input_quantizer)
    return (bias_ok and _delayed_lowers(args.amax_history_bwd, args)
            and _lowerable_formats(backward_quantizers, args)
            and not mxfp8_converted_output(q, wgrad_dtype)
            and not mxfp8_converted_output(q, dgrad_dtype))


def mxfp8_converted_output(quantizer, out_dtype) -> bool:
    """An MXFP8 GEMM whose output is not bf16.  Hopper emulates MXFP8 with
    bf16 GEMMs (quantization/cuda_gemm.py): an fp16 output is the bf16 product
    converted, which inductor fuses with the conversions after it and drops
    (GPU, torch.autocast fp16: x's gradient kept bf16 bits where eager
    rounds to fp16); an fp32 output takes the reference GEMM on operands
    dequantized by torch ops, which inductor lays out so that cuBLAS picks
    another algorithm than eager.  Such calls stay ops."""
    return (isinstance(quantizer, MXFP8Quantizer) and out_dtype is not None
            and out_dtype != torch.bfloat16)


def _has_fast_kernel(name: str, args) -> bool:
    """Whether kernel op ``name`` has a fast kernel on the device of the
    call's tensors, plain or quantized (a LayerNormMLP GEMM's view of the
    backward holds only quantized ones)."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, (torch.Tensor, QuantizedTensorStorage)):
            return kernels.has_fast(name, value.device.type)
    return False


def _lowerable_formats(quantizers, args) -> bool:
    """Whether the NVFP4 quantizers among those a call quantizes with (if
    any) let it lower: only where NVFP4's quantization is a Triton kernel
    (inductor would fuse the reference's torch ops and round otherwise),
    and never with stochastic rounding, whose draws come from torch's
    generator, which inductor's random numbers replace.  Transformer
    Engine's NVFP4 recipe rounds only gradients stochastically, so its
    forward lowers and its backward stays an op."""
    nvfp4 = [q for q in quantizers if isinstance(q, NVFP4Quantizer)]
    return not nvfp4 or (not any(q.stochastic_rounding for q in nvfp4)
                         and _has_fast_kernel("quantize_nvfp4", args))
