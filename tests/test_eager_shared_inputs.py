"""Eager layers that read one input quantize it once (dynamo/shared_inputs.py).

q, k and v (gate and up) each quantize the same activation: eagerly the
first call offers its copies and the next calls that read the same tensor,
unwritten, with an equal quantizer take them.  The results are the bytes each
call would have made, so sharing changes nothing but the work."""

import gc

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import kernels
from transformer_engine_compile.dynamo import shared_inputs

RECIPES = {
    "fp8_current": te.recipe.Float8CurrentScaling,
    "fp8_block": te.recipe.Float8BlockScaling,
    "mxfp8": te.recipe.MXFP8BlockScaling,
    "nvfp4": te.recipe.NVFP4BlockScaling,
    "fp8_delayed": te.recipe.DelayedScaling,
}
QUANTIZE = ("quantize", "cast")  # the kernel names that quantize a tensor


def _counting_kernels(monkeypatch, x_ptr: list) -> list:
    """Patch ``kernels.get``: the returned list counts the quantizing kernel
    calls that read the storage whose data pointer is ``x_ptr[0]``."""
    calls = []
    original = kernels.get

    def get(name, x, fallback=None):
        fn = original(name, x, fallback)
        if not any(word in name for word in QUANTIZE):
            return fn

        def counted(*args, **kw):
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == x_ptr[0]
                   for a in args):
                calls.append(name)
            return fn(*args, **kw)
        return counted

    monkeypatch.setattr(kernels, "get", get)
    return calls


def _run(recipe, share: bool, monkeypatch, write_between=False):
    """Three layers on one computed input, forward and backward: (outputs,
    input gradients, weight gradients, quantizing calls that read the input)."""
    with monkeypatch.context() as patch:  # undone before the next run counts
        return _run_patched(recipe, share, patch, write_between)


def _run_patched(recipe, share, monkeypatch, write_between):
    monkeypatch.setattr(shared_inputs, "EAGER", share)
    torch.manual_seed(0)
    layers = [te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16) for _ in range(3)]
    a = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(128, 128, dtype=torch.bfloat16)
    x_ptr = [None]
    calls = _counting_kernels(monkeypatch, x_ptr)
    with te.autocast(recipe=recipe):
        h = a * b
        x_ptr[0] = h.untyped_storage().data_ptr()
        ys = []
        for i, layer in enumerate(layers):
            ys.append(layer(h))
            if write_between and i == 0:
                with torch.no_grad():
                    h.mul_(1.0)  # same values, a new version: nothing may be reused
    sum(y.float().square().sum() for y in ys).backward()
    return ys, a.grad, [layer.weight.grad for layer in layers], calls


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8", "nvfp4"])
def test_eager_layers_reading_one_input_quantize_it_once(monkeypatch, name):
    recipe = RECIPES[name]()
    ys, dx, dws, calls = _run(recipe, True, monkeypatch)
    ys0, dx0, dws0, calls0 = _run(recipe, False, monkeypatch)
    assert len(calls0) == 3, calls0  # each layer quantizes the input
    assert len(calls) == 1, calls
    for got, want in zip([*ys, dx, *dws], [*ys0, dx0, *dws0]):
        assert torch.equal(got, want)


def test_eager_sharing_needs_the_same_unwritten_input(monkeypatch):
    """An input written after the first call is quantized again; a stateful
    quantizer (DelayedScaling: each layer its own scale) never shares."""
    recipe = RECIPES["fp8_current"]()
    *_, calls = _run(recipe, True, monkeypatch, write_between=True)
    assert len(calls) == 2, calls  # the first call's, then one after the write, shared once
    *_, calls = _run(RECIPES["fp8_delayed"](), True, monkeypatch)
    assert len(calls) == 3, calls


def test_eager_entry_goes_with_its_input(monkeypatch):
    """The shared copies live no longer than the tensor they were made from."""
    monkeypatch.setattr(shared_inputs, "EAGER", True)
    layer = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16)
    h = torch.randn(64, 128, dtype=torch.bfloat16)
    with te.autocast(recipe=RECIPES["fp8_current"]()), torch.no_grad():
        layer(h)
    assert shared_inputs._LAST.cell and shared_inputs._LAST.cell[0][0]() is h
    del h
    gc.collect()
    assert not shared_inputs._LAST.cell


def test_a_replaced_entry_frees_its_copies_at_once(monkeypatch):
    """The next quantizing call's entry replaces the last one, whose copies go
    at once, without Python's cyclic collection (off between a training
    loop's scheduled collections); an entry whose input goes is freed at once
    too."""
    import weakref
    monkeypatch.setattr(shared_inputs, "EAGER", True)
    layer = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16)
    h1, h2 = (torch.randn(64, 128, dtype=torch.bfloat16) for _ in range(2))
    gc.collect()
    gc.disable()
    try:
        with te.autocast(recipe=RECIPES["fp8_current"]()), torch.no_grad():
            layer(h1)
            copies = [weakref.ref(t) for t in shared_inputs._LAST.cell[0][4].values()]
            assert copies and all(r() is not None for r in copies)
            layer(h2)
        assert all(r() is None for r in copies), "the replaced entry's copies are still held"
        copies = [weakref.ref(t) for t in shared_inputs._LAST.cell[0][4].values()]
        del h2
        assert not shared_inputs._LAST.cell and all(r() is None for r in copies)
    finally:
        gc.enable()


def test_eager_entry_goes_with_an_input_freed_on_another_thread(monkeypatch):
    """A saved input is often freed by the autograd engine's thread: the
    forward thread's entry still goes with it."""
    import threading
    monkeypatch.setattr(shared_inputs, "EAGER", True)
    layer = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16)
    holder = [torch.randn(64, 128, dtype=torch.bfloat16)]
    with te.autocast(recipe=RECIPES["fp8_current"]()), torch.no_grad():
        layer(holder[0])
    assert shared_inputs._LAST.cell
    thread = threading.Thread(target=holder.clear)  # the last reference goes there
    thread.start()
    thread.join()
    gc.collect()
    assert not shared_inputs._LAST.cell


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_eager_sharing_under_activation_checkpointing(monkeypatch, use_reentrant):
    """A checkpointed block whose three layers read one input, with sharing
    on (its forward and its recompute each quantize that input once): the
    gradients equal those of the block run without checkpointing and
    without sharing, bit for bit."""
    from torch.utils.checkpoint import checkpoint
    recipe = RECIPES["fp8_current"]()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16)
                                 for _ in range(3))
    a = torch.randn(128, 128, dtype=torch.bfloat16)

    def block(x):
        h = x * 2
        return sum(layer(h).float() for layer in layers)

    def grads(share, checkpointed):
        monkeypatch.setattr(shared_inputs, "EAGER", share)
        layers.zero_grad(set_to_none=True)
        x = a.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = checkpoint(block, x, use_reentrant=use_reentrant) if checkpointed else block(x)
        y.square().sum().backward()
        return [x.grad, *(layer.weight.grad for layer in layers)]

    want = grads(False, False)
    for got in (grads(True, True), grads(True, False)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
