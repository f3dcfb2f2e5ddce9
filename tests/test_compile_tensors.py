"""Quantized tensors crossing torch.compile boundaries, and quantization
inside compiled code, equal eager bit for bit."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

from conftest import STATELESS


def _bits(t):
    return {k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in t.buffers().items()}


def _equal_buffers(a, b):
    ba, bb = _bits(a), _bits(b)
    return list(ba) == list(bb) and all(torch.equal(ba[k], bb[k]) for k in ba)


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    counters.clear()


def test_quantize_inside_compile_equals_eager(stateless_name):
    _check_quantize_in_compile(STATELESS[stateless_name](True, True), "aot_eager")


# Inductor on a representative subset (CPU compile time).  NVFP4 runs one
# usage per graph: inductor 2.13's CPU codegen fails an internal tiling
# assertion when both NVFP4 copies are quantized in one graph (docs/formats.md).
@pytest.mark.parametrize("name,usage", [("fp8_current_e4m3", (True, True)),
                                        ("mxfp8_e4m3", (True, True)),
                                        ("block_1d", (True, True)),
                                        ("nvfp4", (True, False)), ("nvfp4_rht", (False, True))])
def test_quantize_inside_inductor_equals_eager(name, usage):
    _check_quantize_in_compile(STATELESS[name](*usage), "inductor")


def _check_quantize_in_compile(q, backend):
    x = torch.randn(128, 256, dtype=torch.bfloat16)

    def f(x, q):
        t = q.quantize(x)
        return t.dequantize(dtype=torch.float32), t

    out, t = torch.compile(f, fullgraph=True, backend=backend)(x, q)
    ref_out, ref_t = f(x, q)
    assert torch.equal(out, ref_out)
    assert type(t) is type(ref_t) and _equal_buffers(t, ref_t)
    assert not counters["graph_break"]


def test_wrapper_tensor_as_compiled_input_and_output(stateless_name):
    q = STATELESS[stateless_name](True, True)
    w = q.quantize(torch.randn(128, 256))

    def f(w, y):
        return w.dequantize() * y, w

    y = torch.randn(128, 256)
    out, w_back = torch.compile(f, fullgraph=True, backend="aot_eager")(w, y)
    assert torch.equal(out, w.dequantize() * y)
    assert type(w_back) is type(w) and _equal_buffers(w_back, w)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_no_recompile_for_new_tensor_of_same_layout():
    q = te.Float8BlockQuantizer()

    def f(w):
        return w.dequantize().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            w = q.quantize(torch.randn(128, 256))
            assert torch.equal(cf(w), f(w))
