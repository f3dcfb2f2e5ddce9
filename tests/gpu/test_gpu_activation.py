"""Triton activation kernels (LayerNormMLP) against the reference: every
activation, bf16 and fp32, ragged shapes; forward and backward within one
rounding of the output dtype.  Skips without CUDA."""

import pytest
import torch

from transformer_engine_compile.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _within_one_rounding(a, b) -> bool:
    """|a - b| <= one rounding of b's dtype at |b|, plus an fp32 error of the
    formula relative to the tensor's largest value (exp- vs torch-tanh
    differ in the last fp32 bits, which cancellation near zero magnifies)."""
    err = (a.float() - b.float()).abs()
    bound = torch.finfo(b.dtype).eps * b.float().abs() + 1e-6 * b.float().abs().max()
    return bool((err <= bound).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(300, 2 * 1000), (4096, 2 * 256), (7, 2 * 5632)], ids=str)
@pytest.mark.parametrize("name", sorted(ref.ACTIVATIONS))
def test_activation_kernels_equal_the_reference(name, shape, dtype):
    from transformer_engine_compile.kernels import triton_act as ta

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(shape, device="cuda", generator=gen)).to(dtype)
    gated = ref.ACTIVATIONS[name][1]
    dy = torch.randn(shape[0], shape[1] // 2 if gated else shape[1], device="cuda",
                     generator=gen).to(dtype)
    y, y_ref = ta.activation_forward(x, name), ref.activation_forward(x, name)
    dx, dx_ref = ta.activation_backward(dy, x, name), ref.activation_backward(dy, x, name)
    assert y.shape == y_ref.shape and y.dtype == dtype and dx.shape == x.shape
    assert _within_one_rounding(y, y_ref) and _within_one_rounding(dx, dx_ref)
    if dtype == torch.bfloat16:  # almost every value rounds to the same bf16
        assert (y == y_ref).float().mean() > 0.99 and (dx == dx_ref).float().mean() > 0.99
