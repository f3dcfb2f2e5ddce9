"""Dynamic token counts: one graph for every recipe, equal to eager bit for bit.

Token counts are multiples of every recipe's block (128) and at least two
blocks: a count of exactly one block makes a size-1 scale dim, which PyTorch
specializes (0/1 specialization) and compiles separately (docs/linear.md).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from test_linear import _make_step, _reset

# the first count differs from the feature sizes: under dynamic=True PyTorch's
# duck sizing gives equal sizes one symbol, and the static weight would then
# pin the token dim too (mark_dynamic does not have that problem)
TOKENS = (384, 256, 512, 768, 1024, 1280)


def _grads(layer, x, y):
    y.float().sum().backward()
    out = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out


def _run(fn, layer, x0, mark):
    torch.manual_seed(0)  # NVFP4 stochastic rounding
    x = x0.clone().requires_grad_()
    if mark is not None:
        torch._dynamo.mark_dynamic(x, mark)
    return _grads(layer, x, fn(x))


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
@pytest.mark.parametrize("name", recipe.RECIPE_NAMES)
def test_one_graph_across_token_counts(name, how):
    _reset()
    rec = recipe.by_name(name)
    torch.manual_seed(0)
    layer = te.Linear(256, 128, params_dtype=torch.bfloat16)
    step = _make_step(layer, rec)
    dynamic = True if how == "dynamic=True" else None
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    mark = 0 if how == "mark_dynamic" else None
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for m in TOKENS:
            x0 = torch.randn(m, 256, dtype=torch.bfloat16)
            want = _run(step, layer, x0, None)
            got = _run(compiled, layer, x0, mark)
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), f"{m} tokens: result {i} differs from eager"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8"])
def test_dynamic_sequence_dim_of_a_3d_input(name):
    """(batch, seq, hidden) with seq marked dynamic: one graph."""
    _reset()
    rec = recipe.by_name(name)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    compiled = torch.compile(_make_step(layer, rec), fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for seq in (64, 96, 128, 160, 192):
            x0 = torch.randn(2, seq, 128, dtype=torch.bfloat16)
            want = _run(_make_step(layer, rec), layer, x0, None)
            got = _run(compiled, layer, x0, 1)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), seq
    assert counters["stats"]["unique_graphs"] == 1


def test_changing_amax_epsilon_recompiles_under_dynamic():
    """A recipe float reaches the quantizer as a constant (not a SymFloat),
    so a changed value recompiles instead of being baked in silently."""
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)

    def step(x, rec):
        with te.autocast(recipe=rec):
            return layer(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    x = torch.full((256, 128), 1e-3, dtype=torch.bfloat16)
    for eps in (0.0, 0.0, 1.0):  # eps 1.0 floors the amax: a different scale
        rec = recipe.Float8CurrentScaling(amax_epsilon=eps)
        assert torch.equal(compiled(x, rec), step(x, rec))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name", recipe.RECIPE_NAMES)
def test_train_eval_and_requires_grad_toggling_compile_once_per_mode(name):
    """train/eval with and without no_grad, and a frozen weight: one graph per
    distinct mode, each reused when its mode comes back, results == eager."""
    _reset()
    rec = recipe.by_name(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.Linear(256, 256, params_dtype=torch.bfloat16),
                                te.Linear(256, 128, params_dtype=torch.bfloat16))

    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return model(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x0 = torch.randn(256, 256, dtype=torch.bfloat16)

    def run(fn, mode):
        torch.manual_seed(0)
        model.train(mode != "eval")
        model[0].weight.requires_grad_(mode != "frozen")
        x = x0.clone().requires_grad_(mode != "eval")
        if mode == "eval":
            with torch.no_grad():
                return [fn(x)]
        y = fn(x)
        y.float().sum().backward()
        out = [y.detach(), x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return out

    modes = ["train", "eval", "train", "frozen", "eval", "frozen", "train"]
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for mode in modes:
            want, got = run(step, mode), run(compiled, mode)
            assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got)), mode
    # at most one per mode (train, eval under no_grad, frozen weight): torch 2.13
    # compiles 3, torch 2.11 shares one of them (2); never a recompile per switch
    assert 1 <= counters["stats"]["unique_graphs"] <= 3
    assert sum(counters["graph_break"].values()) == 0
