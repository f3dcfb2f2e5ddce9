"""``te_compile::linear_bias``: an unquantized GEMM and its bias, opaque to inductor.

An unquantized te.Linear GEMM adds its bias in ``F.linear``
(:func:`~.gemm.gemm_reference`): on CUDA, cuBLAS's epilogue sums the
product and the bias in fp32 and rounds once.  Traced as torch ops into a
lowered graph (``dynamo/lowering.py``), that call becomes an ``addmm``,
which inductor may split into ``mm`` and an add fused downstream (its
post-grad ``unfuse_bias_add_to_pointwise``; torch's
``keep_addmm_fused_for_half_dtypes`` decides it for bf16), rounding twice,
and which it otherwise runs on the bias expanded to the output's shape,
another cuBLAS path than eager's.  A lowered trace therefore calls this op
instead (:func:`traced`): inductor runs it as a fallback kernel, the very
``F.linear`` call eager makes, and lowers the rest of the layer around it.

The impl here is Python: inductor's fallback call then pays the
dispatcher's Python kernel call per layer forward.  On CUDA the native
extension registers a C++ kernel for it (``native_gemm_bias.cpp``, the same
``at::linear`` call), which the dispatcher takes once the extension is
loaded; tracing the op starts that build (kernels/native.py).

Only lowered traces call it, below autograd (inductor's decompositions run
after AOTAutograd has split forward and backward), so it has no autograd
formula.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("te_compile", "FRAGMENT")
_LIB.define("linear_bias(Tensor a, Tensor b, Tensor bias) -> Tensor")


def _real(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(a, b, bias)


def _fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if a.dtype != b.dtype or bias.dtype != a.dtype:
        raise RuntimeError(f"te_compile::linear_bias: dtypes differ ({a.dtype}, {b.dtype}, "
                           f"{bias.dtype})")
    if a.shape[-1] != b.shape[-1] or b.dim() != 2 or bias.shape != (b.shape[0],):
        raise RuntimeError(f"te_compile::linear_bias: shapes do not match: {tuple(a.shape)}, "
                           f"{tuple(b.shape)}, {tuple(bias.shape)}")
    return a.new_empty((*a.shape[:-1], b.shape[0]))


_LIB.impl("linear_bias", _real, "CompositeExplicitAutograd")
torch.library.register_fake("te_compile::linear_bias", _fake, lib=_LIB)

OP = torch.ops.te_compile.linear_bias.default


def traced(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear(a, b, bias)`` as a lowered trace records it: one node of
    this op.  On CUDA, starts the build of the op's C++ kernel."""
    if a.device.type == "cuda":
        from . import native
        native.extension()
    return OP(a, b, bias)
