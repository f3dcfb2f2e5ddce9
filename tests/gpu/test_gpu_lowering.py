"""Inductor lowering of the modules' ops on CUDA (dynamo/lowering.py): the
ops' Triton kernels (wrap_triton) and cuBLAS calls in inductor's code,
bit-identical to eager, in default and reduce-overhead mode: te.Linear,
te.LayerNormLinear and te.LayerNormMLP.  Skips without CUDA; qa/L0_gpu
runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_lowering import LN_CASES, _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name, mode, ops_left", [
    *[(n, None, 0) for n in ("bf16", "fp8_current", "fp8_block", "mxfp8")],
    # CUDA graphs keep the ops (dynamo/lowering.py)
    *[(n, "reduce-overhead", 1) for n in ("fp8_current", "mxfp8")],
])
def test_lowered_on_cuda(name, mode, ops_left):
    torch._dynamo.reset()
    counters.clear()
    assert _train(name, bias=False, steps=3, device="cuda", mode=mode) == {
        "fwd": ops_left, "bwd": ops_left}
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("name, ops_left", [
    *[(n, {"fwd": 0, "bwd": 0}) for n in ("fp8_current", "fp8_block", "mxfp8")],
    ("bf16", {"fwd": 1, "bwd": 0}),  # the bias inside F.linear keeps the forward op
])
def test_bias_on_cuda(name, ops_left):
    """A bias lowers with the GEMM: added in _scaled_mm's epilogue or by the
    bias kernel, its gradient summed by the column-sum kernel, bit for bit."""
    torch._dynamo.reset()
    assert _train(name, bias=True, steps=3, device="cuda") == ops_left


@pytest.mark.parametrize("module, options", LN_CASES)
def test_layernorm_modules_with_bias_lowered_on_cuda(module, options):
    torch._dynamo.reset()
    assert _train("fp8_current", bias=True, steps=3, device="cuda", module=module,
                  **options) == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("name", ["fp8_delayed", "nvfp4"])
def test_stateful_and_random_recipes_stay_ops_on_cuda(name):
    torch._dynamo.reset()
    assert _train(name, bias=False, steps=3, device="cuda") == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("module, options", LN_CASES)
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", "mxfp8"])
def test_layernorm_modules_lowered_on_cuda(module, options, name):
    """The norm and activation are Triton kernels in both: bit for bit."""
    torch._dynamo.reset()
    assert _train(name, bias=False, steps=3, device="cuda", module=module, **options) == {
        "fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
def test_layernorm_modules_keep_ops_for_cuda_graphs(module):
    torch._dynamo.reset()
    counters.clear()
    assert _train("fp8_current", bias=False, steps=3, device="cuda", mode="reduce-overhead",
                  module=module, normalization="RMSNorm") == {"fwd": 1, "bwd": 1}
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
