"""``parameters_split`` on the GPU: the native eager path takes the joined
weight, inductor's lowered graphs and CUDA graphs take the concatenation, and
every path equals the unsplit layer bit for bit."""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from native_steps import native_path, plans
from test_parameters_split import make_step, run_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "bf16"]
SPLIT = {"query": 256, "key": 128, "value": 128}


def _recipe(name):
    return recipe.DelayedScaling() if name == "fp8_delayed" else recipe.by_name(name)


def _layers(bias):
    torch.manual_seed(0)
    ref = te.Linear(512, 512, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    layer = te.Linear(512, 512, bias=bias, params_dtype=torch.bfloat16, device="cuda",
                      parameters_split=SPLIT)
    layer.load_full_weight_(ref.weight.detach(), None if not bias else ref.bias.detach())
    return ref, layer


@pytest.mark.parametrize("name", RECIPES)
def test_split_layer_equals_unsplit_native_and_compiled(name):
    """Eager (the native path where it applies: one native plan per memo
    entry), default-mode inductor and reduce-overhead all equal the unsplit
    layer's eager steps bit for bit."""
    rec = None if name == "bf16" else _recipe(name)
    x0 = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    ref, layer = _layers(bias=False)
    with native_path(True):
        expected = run_steps(ref, make_step(ref, rec), x0, dy=dy)
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        got = run_steps(layer, make_step(layer, rec), x0, dy=dy)
        if rec is not None:
            assert any(p for p in plans(layer)), "the split layer left the native path"
    for mode in (None, "reduce-overhead"):
        layer.load_state_dict(state)
        torch._dynamo.reset()
        compiled = run_steps(layer, torch.compile(make_step(layer, rec), fullgraph=True,
                                                  mode=mode), x0, dy=dy)
        for what, runs in (("eager", got), (f"compiled {mode}", compiled)):
            for i, (e, g) in enumerate(zip(expected, runs)):
                for part, a, b in zip(("out", "dgrad", "wgrad"), e, g):
                    assert torch.equal(a, b), f"{name} {what}: step {i} {part} differs"
