"""Inductor lowers te.Linear's ops into their kernels (dynamo/lowering.py).

On CUDA the lowered impl records the fast Triton kernels; here, on CPU, it
records the reference kernels (the lowering is switched on for CPU by the
fixture), which inductor compiles with its C++ backend.  Each test checks
which ops stayed in the generated code and that compiled training equals
eager bit for bit.
"""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.dynamo import lowering
from transformer_engine_compile.module import linear_ops

pytestmark = pytest.mark.skipif(not linear_ops.LINEAR_OPS.available,
                                reason="torch without the opaque-object API")


@pytest.fixture
def lowered_on_cpu():
    previous = lowering.set_lowered_devices({"cpu"})
    torch._dynamo.reset()
    yield
    lowering.set_lowered_devices(previous)
    torch._dynamo.reset()


RECIPES = {
    "bf16": None,
    "fp8_current": te.recipe.Float8CurrentScaling,
    "fp8_delayed": te.recipe.DelayedScaling,
    "fp8_block": te.recipe.Float8BlockScaling,
    "mxfp8": te.recipe.MXFP8BlockScaling,
    "nvfp4": te.recipe.NVFP4BlockScaling,
}


def _forward(recipe):
    def fwd(layer, x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return layer(x)
    return fwd


def _step(layer, x, fwd):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = fwd(layer, x)
    y.float().square().sum().backward()
    return [y, x.grad, *[p.grad for p in layer.parameters()],
            *[b.clone() for b in layer.buffers()]]


def _train(name, bias, steps=2, device="cpu", mode=None):
    """Op calls left in the generated code of the first compiled step, after
    checking ``steps`` compiled steps against eager, bit for bit."""
    from torch._inductor.utils import run_and_get_code
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    torch.manual_seed(0)
    n = 128 if name == "fp8_block" else 64
    eager = te.Linear(n, n, bias=bias, params_dtype=torch.bfloat16, device=device)
    compiled = copy.deepcopy(eager)
    fwd = _forward(recipe)
    cfwd = torch.compile(fwd, backend="inductor", fullgraph=True, mode=mode)
    code = None
    for i in range(steps):
        x = torch.randn(32, n, dtype=torch.bfloat16, device=device)
        torch.manual_seed(10 + i)
        want = _step(eager, x, fwd)
        torch.manual_seed(10 + i)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if code is None:
            got, code = run_and_get_code(_step, compiled, x, cfwd)
        else:
            got = _step(compiled, x, cfwd)
        assert len(got) == len(want)
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"{name} bias={bias} step {i}: compiled != eager"
    text = "\n".join(code)
    return {op: text.count(f"torch.ops.te_compile.linear_{op}.default(")
            for op in ("fwd", "bwd")}


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", "mxfp8"])
def test_lowered_without_bias(lowered_on_cpu, name):
    assert _train(name, bias=False) == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8"])
def test_bias_keeps_the_ops(lowered_on_cpu, name):
    """Inductor would fuse the bias add with the casts and GEMMs around it
    (other rounding) and reorder the bias gradient's reduction."""
    assert _train(name, bias=True) == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("name", ["fp8_delayed", "nvfp4"])
def test_stateful_and_random_recipes_stay_ops(lowered_on_cpu, name):
    assert _train(name, bias=False, steps=3) == {"fwd": 1, "bwd": 1}


def test_switching_lowering_off_recompiles(lowered_on_cpu):
    """The lowering setting is part of the graph (the ops' cache token), so
    a function compiled before the switch is not served stale code."""
    assert _train("fp8_current", bias=False, steps=1) == {"fwd": 0, "bwd": 0}
    lowering.set_lowered_devices(set())
    assert _train("fp8_current", bias=False, steps=1) == {"fwd": 1, "bwd": 1}


def test_not_lowered_on_other_devices_by_default():
    assert "cpu" not in lowering.lowered_devices()
    token = lowering.cache_token()
    assert token[0] == tuple(sorted(lowering.lowered_devices()))


def test_not_lowered_for_cuda_graphs(lowered_on_cpu):
    """mode="reduce-overhead" compiles with this config set: the ops stay."""
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert _train("fp8_current", bias=False, steps=1) == {"fwd": 1, "bwd": 1}
