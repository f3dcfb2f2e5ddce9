"""te.LayerNormMLP on CUDA: compiled (default and reduce-overhead, zero
cudagraph skips) equals eager bit for bit, state buffers included, for
every recipe, a gated and a plain activation.  Skips without CUDA."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_layernorm_mlp import ALL_RECIPES, CONFIGS, compare_compiled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce_overhead"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_compiled_equals_eager_cuda(name, config, mode):
    compare_compiled(ALL_RECIPES[name], *config, backend="inductor", device="cuda", mode=mode,
                     shape=(2, 128, 128))
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("kw", [dict(return_layernorm_output=True, return_bias=True),
                                dict(zero_centered_gamma=True, bias=False)], ids=["returns", "flags"])
def test_flags_reduce_overhead_cuda(kw):
    compare_compiled(ALL_RECIPES["fp8_current"], "RMSNorm", "swiglu", backend="inductor",
                     device="cuda", mode="reduce-overhead", shape=(256, 128), **kw)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
