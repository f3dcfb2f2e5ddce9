"""Quantized dgrad output (``fp8_grad``) on CUDA: eager with the CUDA
kernels against ``fp8_grad=False``, and CUDA graphs (``mode="reduce-overhead"``)
against eager, bit for bit (DelayedScaling state included), with one graph
and zero cudagraph skips.  Skips without CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

from test_fp8_grad import ALL_FP8_GRAD, assert_steps_equal, run_steps
from test_linear import _reset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N_RESULTS = 5  # y, x.grad and the parameters' gradients (the state differs by design)


@pytest.mark.parametrize("name", ALL_FP8_GRAD)
def test_cuda_eager_equals_without_fp8_grad(name):
    rec = ALL_FP8_GRAD[name]
    want = run_steps(rec, False, device="cuda", steps=4)
    got = run_steps(rec, True, device="cuda", steps=4)
    assert_steps_equal([w[:N_RESULTS] for w in want], [g[:N_RESULTS] for g in got])


@pytest.mark.parametrize("name", ALL_FP8_GRAD)
def test_reduce_overhead_equals_eager(name):
    _reset()
    rec = ALL_FP8_GRAD[name]
    steps = 22 if name == "delayed" else 4
    got = run_steps(rec, True, device="cuda", fc1_bias=True, steps=steps,
                    compile_kw={"backend": "inductor", "mode": "reduce-overhead"})
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert_steps_equal(run_steps(rec, True, device="cuda", fc1_bias=True, steps=steps), got)
