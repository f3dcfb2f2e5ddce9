"""Inductor lowering of te.Linear's ops on CUDA (dynamo/lowering.py): the
ops' Triton kernels (wrap_triton) and cuBLAS calls in inductor's code,
bit-identical to eager, in default and reduce-overhead mode.  Skips
without CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_lowering import _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", "mxfp8"])
def test_lowered_on_cuda(name):
    torch._dynamo.reset()
    assert _train(name, bias=False, steps=3, device="cuda") == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_cuda_graphs_keep_the_ops(name):
    torch._dynamo.reset()
    counters.clear()
    assert _train(name, bias=False, steps=3, device="cuda", mode="reduce-overhead") == {
        "fwd": 1, "bwd": 1}
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8"])
def test_bias_on_cuda(name):
    torch._dynamo.reset()
    assert _train(name, bias=True, steps=3, device="cuda") == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("name", ["fp8_delayed", "nvfp4"])
def test_stateful_and_random_recipes_stay_ops_on_cuda(name):
    torch._dynamo.reset()
    assert _train(name, bias=False, steps=3, device="cuda") == {"fwd": 1, "bwd": 1}
