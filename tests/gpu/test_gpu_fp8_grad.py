"""Quantized dgrad output (``fp8_grad``) on CUDA: eager with the CUDA
kernels against ``fp8_grad=False``, and CUDA graphs (``mode="reduce-overhead"``)
against eager, bit for bit, with zero cudagraph skips.  Skips without CUDA;
qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_fp8_grad import FP8_GRAD_RECIPES, assert_steps_equal, run_steps
from test_linear import _reset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_cuda_eager_equals_without_fp8_grad(name):
    rec = FP8_GRAD_RECIPES[name]
    assert_steps_equal(run_steps(rec, False, device="cuda"), run_steps(rec, True, device="cuda"))


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_reduce_overhead_equals_eager(name):
    _reset()
    rec = FP8_GRAD_RECIPES[name]
    got = run_steps(rec, True, device="cuda", fc1_bias=True, steps=4,
                    compile_kw={"backend": "inductor", "mode": "reduce-overhead"})
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert_steps_equal(run_steps(rec, True, device="cuda", fc1_bias=True, steps=4), got)
