"""Layer state under CUDA graphs (torch.compile mode="reduce-overhead"):
FP8 weight caching, DelayedScaling and fused main_grad accumulation equal
eager microbatch by microbatch, state included, with zero cudagraph skips.
Skips without CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_state import FIRSTS, QUANTIZED, run_compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reduce_overhead(rec, firsts, fuse):
    run_compare(rec, firsts, device="cuda", fuse=fuse, backend="inductor",
                mode="reduce-overhead")
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_weight_caching_reduce_overhead(name, fuse):
    _reduce_overhead(QUANTIZED[name], FIRSTS, fuse)


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_delayed_scaling_22_steps_reduce_overhead(fuse):
    _reduce_overhead(QUANTIZED["delayed"], (None,) * 22, fuse)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_main_grad_reduce_overhead(name):
    _reduce_overhead(QUANTIZED[name], (None,) * 4, True)


def test_eager_delayed_scaling_step_copies_nothing():
    """Eager DelayedScaling: the step (fused into the last cast, or a launch
    of its own when weights are cached) writes the layer's histories and
    scales itself, and a cached weight's amax goes into its slot from the
    amax kernel, so an eager forward + backward makes no device copy (it
    made four, five with a cached weight).  Left: the first microbatch
    copies the quantized weight into the layer's cache (three copies, once
    per step; not counted here)."""
    from torch.profiler import ProfilerActivity, profile

    import transformer_engine_compile as te
    from transformer_engine_compile import recipe

    layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rec = recipe.DelayedScaling(amax_history_len=8)
    with te.autocast(recipe=rec):
        layer(x, is_first_microbatch=True).sum().backward()  # fills the cache
    for first in (None, False, None):
        with te.autocast(recipe=rec):
            y = layer(x, is_first_microbatch=first)
        y.sum().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with te.autocast(recipe=rec):
                y = layer(x, is_first_microbatch=first)
            y.sum().backward()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = [n for n in names if "Memcpy" in n]
        assert names and not copies, (first, names)
