"""Gradient accumulation on the native eager path: the FP8 weight cache
(``is_first_microbatch``) and ``fuse_wgrad_accumulation`` (``main_grad``),
also inside activation checkpointing, bit for bit the Python path's.
Skips without CUDA; helpers from test_gpu_native.py."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")

from native_steps import microbatch_steps
from test_gpu_native import (BLOCK, MX, NVFP4, REC, _CHECKPOINTS, _NoNative, _Null,
                             _delayed_state, _equal, _memo_native, _python_only, _skip_block,
                             _two_layers)


def _caching_steps(rec, bias, ckpt=None):
    """:func:`microbatch_steps` (``ckpt``: each call inside that checkpoint)
    of a 256 -> 512 te.Linear natively and of a Python-path copy, asserted
    equal bit for bit (every microbatch's output, input gradient and FP8
    buffers, each step's gradients); (recipe, layer, copy, last output).
    ``rec`` "delayed": DelayedScaling with a history of 4."""
    _skip_block(rec)
    if rec == "delayed":
        rec = R.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    layer = te.Linear(256, 512, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    ref = _python_only(layer)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    got, y = microbatch_steps(layer, x, dy, rec, True, ckpt=ckpt)
    want, _ = microbatch_steps(ref, x, dy, rec, False, ckpt=ckpt)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    return rec, layer, ref, y


@pytest.mark.parametrize("bias,rec", [(False, REC), (True, REC), (False, "delayed"),
                                      (True, "delayed"), (False, BLOCK), (True, BLOCK)], ids=str)
def test_native_weight_caching_equals_python(ext, calls, bias, rec):
    """Gradient accumulation with the FP8 weight cache (is_first_microbatch):
    True writes the cache natively (the copies after the GEMM), False reads
    it and quantizes x alone (under DelayedScaling: x's cast, W's amax and
    the step, as the Python path launches them; blockwise: the cache holds
    both 128x128-scaled copies); outputs, caches, gradients, the weights
    after AdamW steps and the DelayedScaling state equal the Python path's
    bit for bit."""
    rec, layer, ref, y = _caching_steps(rec, bias)
    state, ref_state = _delayed_state(layer), _delayed_state(ref)
    assert state.keys() == ref_state.keys()
    assert any("amax_history" in name for name in state) == isinstance(rec, R.DelayedScaling)
    for name, t in state.items():
        assert torch.equal(t, ref_state[name]), name
    # the first True and False calls build the memo; the other four run natively
    assert calls["native"] == 4 and y.grad_fn.name() == "TeLinearFp8Backward"
    assert len(_memo_native(layer)) == 2 and all(_memo_native(layer))


@pytest.mark.parametrize("rec", [REC, "delayed", BLOCK],
                         ids=["fp8_current", "delayed", "fp8_block"])
@pytest.mark.parametrize("how", ["te", "torch", "torch_reentrant"])
def test_native_weight_caching_inside_checkpointing(ext, calls, how, rec):
    """The FP8 weight cache inside activation checkpointing natively: the
    recomputation repeats its forward's use of the cache (True quantizes
    the unchanged weight again and writes the same bytes, under
    DelayedScaling with the recorded scale; False reads it).  Every
    microbatch's output, input gradient, cache and state, and each step's
    gradients, equal the Python path's bit for bit."""
    _, layer, _, _ = _caching_steps(rec, True, _CHECKPOINTS[how])
    # step 1 builds the True and False entries in Python (a recomputation
    # takes its forward's path); from the third microbatch on every call is
    # native.  The reentrant checkpoint's forward runs without grad and its
    # recomputation with (two entries per flag, both counted); the
    # non-reentrant one stops its recomputation inside the layer's call
    # (torch's early stop), which then returns nothing to count
    assert calls["native"] == (8 if how == "torch_reentrant" else 4)
    assert all(_memo_native(layer))


def test_native_weight_caching_mxfp8_declines(ext, calls):
    """MXFP8 with the weight cache keeps the Python path (no native plan)."""
    layer = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ref = _python_only(layer)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    got, _ = microbatch_steps(layer, x, dy, MX, True)
    want, _ = microbatch_steps(ref, x, dy, MX, False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert calls["native"] == 0 and _memo_native(layer) == [False, False]


DELAYED = R.DelayedScaling()


def _main_grad_steps(layer, x, dy, rec, native_on, x_only_step=True):
    """Gradient accumulation into ``weight.main_grad``: two steps of
    ``layer(x).backward(dy)``, then (``x_only_step``) one that asks for x's
    gradient alone (``torch.autograd.grad``: main_grad is still added to, as
    the Python path's update adds it); each step's output, x's gradient and
    main_grad, and weight.grad (None throughout)."""
    out = []
    with (_Null() if native_on else _NoNative()):
        for step in range(3):
            xx = x.detach().requires_grad_(True)
            with te.autocast(recipe=rec):
                y = layer(xx)
            loss = (y * dy).float().sum()
            if step == 2 and x_only_step:
                (gx,) = torch.autograd.grad(loss, [xx])
            else:
                loss.backward()
                gx = xx.grad
            out += [y.detach(), gx, layer.weight.main_grad.clone(), layer.weight.grad]
    return out, y


@pytest.mark.parametrize("rec,bias,dtype", [
    (REC, False, torch.float32), (REC, True, torch.bfloat16), (DELAYED, False, torch.float32),
    (BLOCK, True, torch.float32), (NVFP4, True, torch.float32)],
    ids=["fp8_current", "fp8_current-bias-bf16-main-grad", "delayed", "fp8_block-bias",
         "nvfp4-bias"])
def test_native_fused_wgrad_accumulation_equals_python(ext, calls, rec, bias, dtype):
    """``fuse_wgrad_accumulation``: the native node adds W's gradient (the
    wgrad GEMM's output in main_grad's dtype) into ``weight.main_grad`` and
    gives W none, as the Python path does: outputs, x's gradients and
    main_grad after every step equal the Python path's bit for bit (and so
    the DelayedScaling state), also for a backward asking for x's gradient
    alone."""
    _skip_block(rec)
    torch.manual_seed(3)
    layer = te.Linear(256, 512, bias=bias, params_dtype=torch.bfloat16, device="cuda",
                      fuse_wgrad_accumulation=True)
    ref = _python_only(layer)
    for m in (layer, ref):
        m.weight.main_grad = torch.zeros(512, 256, device="cuda", dtype=dtype)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.manual_seed(3)  # NVFP4's stochastic rounding of dy
    got, y = _main_grad_steps(layer, x, dy, rec, True)
    torch.cuda.manual_seed(3)
    want, y_ref = _main_grad_steps(ref, x, dy, rec, False)
    assert y.grad_fn.name() == "TeLinearFp8Backward" != y_ref.grad_fn.name()
    assert calls["native"] == 2  # the first call builds the memo
    for i, (g, w) in enumerate(zip(got, want)):
        assert _equal(g, w), i
    assert layer.weight.grad is None and got[-2].abs().sum() > 0
    if rec is DELAYED:
        for name, t in _delayed_state(layer).items():
            assert torch.equal(t, _delayed_state(ref)[name]), name


def test_native_fused_wgrad_accumulation_follows_main_grad(ext, calls):
    """A new ``main_grad`` (a training loop's buffer swap) is the one added
    into from the next call on; a quantized dy (a next layer's fp8_grad)
    goes through the Python path's backward, which adds into main_grad too;
    a main_grad the native GEMM cannot write (MXFP8's emulation) keeps the
    Python path."""
    torch.manual_seed(4)
    fc1 = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda",
                    fuse_wgrad_accumulation=True)
    fc2 = te.Linear(512, 256, params_dtype=torch.bfloat16, device="cuda")
    ref1, ref2 = _python_only(fc1), _python_only(fc2)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for (a, b), off in (((fc1, fc2), False), ((ref1, ref2), True)):
        a.weight.main_grad = torch.zeros(512, 256, device="cuda")
        old = a.weight.main_grad
        with (_NoNative() if off else _Null()):
            for step in range(4):
                if step == 2:
                    a.weight.main_grad = torch.zeros(512, 256, device="cuda")
                with te.autocast(recipe=REC):
                    y = b(a(x), fp8_grad=step == 3)
                y.float().pow(2).sum().backward()
        results.append((old, a.weight.main_grad, b.weight.grad))
    for g, w in zip(*results):
        assert torch.equal(g, w)
    # every step adds the same gradient (fp8_grad's dy has the bits fc1 would
    # make): two into the first main_grad, two into its replacement
    assert results[0][1].abs().sum() > 0 and torch.equal(results[0][0], results[0][1])
    # fc1 at steps 1 and 3 (the new main_grad's entry is built at step 2), fc2 at 1-2
    assert calls["native"] == 4
    mx = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda",
                   fuse_wgrad_accumulation=True)
    mx.weight.main_grad = torch.zeros(256, 256, device="cuda")
    with te.autocast(recipe=MX):
        for _ in range(3):
            mx(x).sum().backward()
    assert _memo_native(mx) == [False]


@pytest.mark.parametrize("how", ["te", "torch", "torch_reentrant"])
def test_native_fused_wgrad_accumulation_inside_checkpointing(ext, calls, how):
    """Inside activation checkpointing a native layer's ``main_grad`` is added
    to once per backward (by the node its forward or its recomputation
    made, whichever runs the backward), as on the Python path: x's gradient
    and both main_grads after three steps equal the Python path's."""
    torch.manual_seed(8)
    model = _two_layers(False)
    for layer in (model[0], model[2]):
        layer.fuse_wgrad_accumulation = True
    ref = copy.deepcopy(model)
    ckpt = _CHECKPOINTS[how]
    x0 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for m, off in ((model, False), (ref, True)):
        for layer in (m[0], m[2]):
            layer.weight.main_grad = torch.zeros(layer.weight.shape, device="cuda")
        with (_NoNative() if off else _Null()):
            for _ in range(3):
                x = x0.clone().requires_grad_(True)
                with te.autocast(recipe=REC):
                    y = ckpt(m, x)
                y.float().square().sum().backward()
        results.append((y.detach(), x.grad, m[0].weight.main_grad, m[2].weight.main_grad,
                        m[0].weight.grad))
    assert results[0][4] is None and results[1][4] is None
    for got, want in zip(results[0][:4], results[1][:4]):
        assert torch.equal(got, want)
    assert calls["native"] > 0
