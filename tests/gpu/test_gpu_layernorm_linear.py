"""te.LayerNormLinear on CUDA: compiled (default and reduce-overhead, zero
cudagraph skips) equals eager bit for bit for every recipe and norm, and a
CUDA-graph training loop equals default mode.  Skips without CUDA."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from test_layernorm_linear import FLAGS, NORMS, _layer, compare_compiled
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
