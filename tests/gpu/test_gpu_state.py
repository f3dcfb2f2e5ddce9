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
