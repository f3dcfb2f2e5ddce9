"""The Triton byte transpose (kernels/triton_quant.transpose_bytes) that
builds the transposed copy of an FP8 weight FSDP2 gathered rowwise: bit
for bit the reference's ``x.t().contiguous()``, with and without ``out``,
for ragged shapes too.  Skips without CUDA."""

import pytest
import torch

from transformer_engine_compile import kernels
from transformer_engine_compile.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (100, 300), (129, 65), (4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_transpose_bytes_equals_reference(shape, dtype):
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(dtype)
    fast = kernels.get("transpose_bytes", x)
    assert fast is not ref.transpose_bytes  # the Triton kernel runs
    got = fast(x)
    expect = ref.transpose_bytes(x)
    assert got.shape == (shape[1], shape[0]) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))
    out = torch.empty_like(expect)
    assert fast(x, out) is out and torch.equal(out.view(torch.uint8), expect.view(torch.uint8))
