"""Ragged token counts on the GPU: the Triton quantization of a
zero-padded matrix equals the reference bit for bit, and te.Linear at
ragged counts trains eager = inductor = reduce-overhead (zero cudagraph
skips) with no host synchronisation.  Skips without CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import STATELESS
from test_linear import RECIPES, compare_compiled
from test_gpu_kernels import _same_bits, reference_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (200, 384), (4095, 1024)], ids=str)
@pytest.mark.parametrize("name", ["block_1d", "block_1d_nopow2_e5m2", "mxfp8_e4m3", "nvfp4",
                                  "nvfp4_rht"])
def test_fast_quantize_of_ragged_rows_equals_reference(name, shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    q = STATELESS[name](True, True)
    fast = q.quantize(x).buffers()
    with reference_kernels():
        slow = q.quantize(x).buffers()
    assert list(fast) == list(slow)
    for k in fast:
        assert fast[k].shape == slow[k].shape, k
        assert _same_bits(fast[k], slow[k]), f"{name} {k} differs"


@pytest.mark.parametrize("tokens", [7, 200, 1000])
@pytest.mark.parametrize("name", RECIPES)
def test_ragged_counts_reduce_overhead_and_inductor_equal_eager(name, tokens):
    for mode in (None, "reduce-overhead"):
        compare_compiled(RECIPES[name], (tokens, 256), True, backend="inductor",
                         device="cuda", mode=mode, steps=3)
        assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "nvfp4"])
def test_ragged_training_step_never_syncs_with_host(name):
    import transformer_engine_compile as te
    torch.manual_seed(0)
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(201, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=RECIPES[name]):
        layer(x).sum().backward()  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with te.autocast(recipe=RECIPES[name]):
            layer(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
