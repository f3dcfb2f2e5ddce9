"""Activation checkpointing: ``te.checkpoint`` and
``torch.utils.checkpoint`` (non-reentrant and reentrant), with ``te.autocast`` outside
or inside the checkpointed function, eager and compiled, give the gradients
and layer state of the same model without checkpointing, bit for bit."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile import compat

from test_linear import _reset
from test_training_patterns import _assert_same

RECIPES = {name: recipe.by_name(name) for name in recipe.RECIPE_NAMES}
RECIPES["delayed"] = recipe.DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def _fresh():
    _reset()
    yield


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = te.Linear(128, 128, params_dtype=torch.bfloat16)
        self.fc2 = te.Linear(128, 128, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _wrap(model, rec, how, where):
    """``f(x)``: the block, checkpointed by ``how`` ("none", "te", "torch"),
    with te.autocast around the call ("outside", entered by the caller) or
    inside the checkpointed function."""
    def body(x):
        if where == "inside":
            with te.autocast(enabled=rec is not None, recipe=rec):
                return model(x)
        return model(x)

    def f(x):
        if how == "te":
            return te.checkpoint(body, x)
        if how == "torch":
            return torch_checkpoint(body, x, use_reentrant=False)
        if how == "reentrant":
            return torch_checkpoint(body, x, use_reentrant=True)
        return body(x)
    return f


def _train(rec, how, where, compiled, steps=3):
    """Gradients, outputs and layer state of ``steps`` SGD steps, and how
    often the layers' forward ran."""
    model = Block()
    calls = []
    f = _wrap(model, rec, how, where)
    if compiled:
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    else:
        model.fc1.register_forward_hook(lambda *a: calls.append(1))
    torch.manual_seed(1)  # NVFP4 stochastic rounding draws from the global RNG
    out = []
    for i in range(steps):
        x = (torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) * 3).to(
            torch.bfloat16).requires_grad_()
        if where == "outside":
            with te.autocast(enabled=rec is not None, recipe=rec):
                y = f(x)
        else:
            y = f(x)
        y.float().square().mean().backward()  # the backward runs outside te.autocast
        out.append([y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
        model.zero_grad(set_to_none=True)
    out.append([b.clone() for _, b in sorted(model.named_buffers())])
    return out, len(calls)


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("how", ["te", "torch", "reentrant"])
@pytest.mark.parametrize("name", RECIPES)
def test_eager_checkpointing_equals_no_checkpointing(name, how, where):
    rec = RECIPES[name]
    ref, ref_calls = _train(rec, "none", where, compiled=False)
    got, calls = _train(rec, how, where, compiled=False)
    assert calls == 2 * ref_calls  # the forward really was recomputed
    _assert_same(got, ref)


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("how", ["te", "torch", "reentrant"])
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8", "delayed"])
def test_compiled_checkpointing_equals_eager_without_checkpointing(name, how, where):
    """One graph, no break; the recomputation is AOTAutograd's.  A
    DelayedScaling forward op would read the scales its forward updated:
    te.checkpoint saves its outputs, a direct torch.utils.checkpoint (either
    kind: Dynamo traces both into the same region) is refused in the
    backward with an error naming te.checkpoint."""
    rec = RECIPES[name]
    ref, _ = _train(rec, "none", where, compiled=False)
    if name == "delayed" and how in ("torch", "reentrant"):
        with pytest.raises(RuntimeError, match="use te.checkpoint"):
            _train(rec, how, where, compiled=True)
        return
    got, _ = _train(rec, how, where, compiled=True)
    _assert_same(got, ref)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compiled_te_checkpoint_saves_only_the_delayed_scaling_ops():
    """Under DelayedScaling the forward ops' outputs are saved; without it
    they are recomputed with the rest of the region."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def backward_ops(rec):
        _reset()
        seen = []

        def bw(gm, _):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        def backend(gm, example_inputs):
            return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g.forward,
                                         bw_compiler=bw)

        model = Block()
        f = torch.compile(_wrap(model, rec, "te", "outside"), backend=backend, fullgraph=True)
        with te.autocast(recipe=rec):
            y = f(torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True))
        y.float().sum().backward()
        return seen

    delayed = backward_ops(RECIPES["delayed"])
    assert not any("linear_fwd" in t for t in delayed)
    current = backward_ops(RECIPES["fp8_current"])
    assert sum("linear_fwd" in t for t in current) == 2 and any("gelu.default" in t
                                                                for t in current)


def test_layer_applied_twice_in_one_region_and_tied_across_regions():
    """The recomputation replays the calls of its own region in order: the
    same layer twice in a region, and in two regions, under DelayedScaling."""
    rec = RECIPES["delayed"]

    def run(how):
        torch.manual_seed(0)
        layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
        outs = []
        for i in range(3):
            x = (torch.randn(128, 128, generator=torch.Generator().manual_seed(i)) * (i + 1)
                 ).to(torch.bfloat16)

            def region(h):
                return layer(torch.relu(layer(h)))
            with te.autocast(recipe=rec):
                h = region(x) if how == "none" else te.checkpoint(region, x)
                h = region(h * 2) if how == "none" else te.checkpoint(region, h * 2)
            h.float().square().mean().backward()
            outs.append([h.detach(), layer.weight.grad.clone(), layer.bias.grad.clone()])
            layer.zero_grad()
        outs.append([b.clone() for _, b in sorted(layer.named_buffers())])
        return outs

    _assert_same(run("te"), run("none"))


def test_recomputation_repeats_with_retain_graph():
    """A second backward through the same graph recomputes again, from the
    first recorded call (each backward itself moves the backward scales on,
    as without checkpointing)."""
    rec = RECIPES["delayed"]

    def run(checkpointed):
        model = Block()
        x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with te.autocast(recipe=rec):
            y = te.checkpoint(model, x) if checkpointed else model(x)
        out = []
        for retain in (True, False):
            y.float().square().sum().backward(retain_graph=retain)
            out.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        return out + [[b.clone() for _, b in sorted(model.named_buffers())]]

    _assert_same(run(True), run(False))


def test_recomputation_in_a_different_order_is_refused():
    model = Block()
    flip = []

    def body(x):
        if flip:
            return model.fc1(model.fc2(x))
        return model.fc2(model.fc1(x))
    with te.autocast(recipe=RECIPES["fp8_current"]):
        y = te.checkpoint(body, torch.randn(128, 128, dtype=torch.bfloat16))
    flip.append(1)
    with pytest.raises(RuntimeError, match="different order"):
        y.float().sum().backward()


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_torch_checkpoint_regions_are_found_on_this_torch(reentrant):
    """compat.checkpoint_region reads torch's private checkpoint hooks and
    compat.reentrant_checkpoint_region the reentrant checkpoint's frames:
    pin what each sees in each phase (and outside a region) on every
    supported torch, a distinct token per recomputation pass included."""
    find = compat.reentrant_checkpoint_region if reentrant else compat.checkpoint_region
    seen = []

    def body(x):
        seen.append(find())
        return x.sin()
    assert find() is None
    x = torch.randn(4, requires_grad=True)
    y = torch_checkpoint(body, x, use_reentrant=reentrant)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    (owner, phase, token), (owner2, phase2, token2), (owner3, phase3, token3) = seen
    assert (phase, phase2, phase3) == ("forward", "recompute", "recompute")
    assert owner is owner2 is owner3 and token is None
    assert token2 is not None and token3 is not None and token2 is not token3


def test_te_checkpoint_signature():
    """Transformer Engine's keywords: ``use_reentrant`` is accepted (always
    non-reentrant), keyword arguments reach the function, unsupported
    features are refused."""
    model = Block()
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    y = te.checkpoint(lambda a, scale: model(a) * scale, x, scale=2.0, use_reentrant=True)
    assert torch.equal(y, model(x) * 2.0)
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.checkpoint(model, x, distribute_saved_activations=True)
    with pytest.raises(NotImplementedError, match="get_rng_state_tracker"):
        te.checkpoint(model, x, get_rng_state_tracker=object())
