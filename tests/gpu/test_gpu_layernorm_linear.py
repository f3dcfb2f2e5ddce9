"""te.LayerNormLinear on CUDA: compiled (default and reduce-overhead, zero
cudagraph skips) equals eager bit for bit for every recipe and norm, and a
CUDA-graph training loop equals default mode; under DelayedScaling the norm
writing FP8 itself trains as the unfused path.  Skips without CUDA."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from test_layernorm_linear import (DELAYED_FUSION_CASES, FLAGS, NORMS, _layer,
                                   assert_delayed_norm_fusion_exact, compare_compiled,
                                   delayed_norm_fusion_runs)
from test_linear import RECIPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce_overhead"])
@pytest.mark.parametrize("flags", range(len(FLAGS)))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_equals_eager_cuda(name, norm, flags, mode):
    layer = _layer(norm, device="cuda", **FLAGS[flags])
    x0 = torch.randn(2, 128, 128, dtype=torch.bfloat16, device="cuda")
    compare_compiled(layer, RECIPES[name], x0, backend="inductor", mode=mode, steps=3)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


def test_delayed_scaling_reduce_overhead_equals_eager():
    layer = _layer("RMSNorm", device="cuda", return_layernorm_output=True)
    x0 = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
    compare_compiled(layer, recipe.DelayedScaling(amax_history_len=4), x0, backend="inductor",
                     mode="reduce-overhead", steps=4)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("module, options", DELAYED_FUSION_CASES)
def test_delayed_scaling_norm_writes_fp8_itself_cuda(module, options, compiled):
    """The norm kernel writing FP8 under DelayedScaling (Triton) trains bit
    for bit as the norm kernel followed by te.Linear's quantize, eager and
    compiled with inductor, LayerNormMLP's fc1 included."""
    runs = delayed_norm_fusion_runs(module, options, device="cuda", compiled=compiled)
    assert_delayed_norm_fusion_exact(module, options, runs)
