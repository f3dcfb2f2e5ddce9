"""Kernels that only eager code launches build for Hopper on a machine
without a GPU.

The lowering tests (``test_lowering.py``) build the TTIR of every kernel
a lowered op launches; the Triton interpreter (``test_triton_interpreted.py``)
runs the kernels' arithmetic but accepts Python that Triton's compiler
refuses (a module global that is not a ``tl.constexpr``, for one).  The
kernels eager code alone launches are built here for sm_90
(:func:`cuda_trace.ttir_launches`); nothing runs.
"""

import pytest
import torch

pytest.importorskip("triton")

from cuda_trace import ttir_launches  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_many_builds_for_hopper(dtype, fmt):
    """``te.fsdp.precompute_scales``' one launch for every FP8-current shard."""
    from transformer_engine_compile.kernels import triton_cast_many as tm

    xs = [torch.randn(64, 128).to(dtype), torch.randn(7, 300).to(dtype)]
    with ttir_launches() as built:
        outs = tm.quantize_fp8_many(xs, torch.ones(2), fmt, fmt == "e5m2", 0.0)
    assert built == ["_cast_many_kernel"]
    assert [tuple(d.shape) for d, _ in outs] == [(64, 128), (7, 300)]
