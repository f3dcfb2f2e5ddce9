"""benchmarks.grouped_host on CPU: the closures it times call the layer's
real ops with the layer's own arguments, and every candidate gets a row
(the figures themselves are the GPU's)."""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.benchmarks import grouped_host as gh
from transformer_engine_compile.benchmarks.moe import recipe


@pytest.mark.parametrize("name", ["bf16", "fp8_current_e4m3", "fp8_block"])
def test_timed_op_calls_are_the_layers_forward_and_backward(name):
    fwd, bwd = gh._op_calls(2, name, torch.device("cpu"))
    out, (dx, dw) = fwd()[0], bwd()[:2]
    # the layer and tensors the closures were built on, made again
    torch.manual_seed(0)
    layer = te.GroupedLinear(2, gh.SIZE, gh.SIZE, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(2 * gh.ROWS, gh.SIZE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rec = None if name == "bf16" else recipe(name)
    with te.autocast(enabled=rec is not None, recipe=rec):
        y = layer(x, [gh.ROWS, gh.ROWS])
    y.backward(dy)
    assert torch.equal(out, y)
    assert torch.equal(dx, x.grad) and torch.equal(dw, layer.weight.grad)


def test_every_candidate_gets_a_row():
    rows = gh.measure(experts=(2, 3), recipes=("bf16", "fp8_delayed_e4m3"), device="cpu", n=1,
                      rounds=1, log=lambda line: None)
    per = ["torch._grouped_mm", "te bf16 fwd op", "te bf16 bwd op", "te fp8_delayed_e4m3 fwd op",
           "te fp8_delayed_e4m3 bwd op"]
    assert [(r["experts"], r["candidate"]) for r in rows] == [(e, c) for e in (2, 3) for c in per]
    assert all(r["us"] > 0 for r in rows)
