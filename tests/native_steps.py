"""Helpers of the native eager path's GPU tests (tests/gpu/test_gpu_native*.py):
train steps with the native path on or off, and bit-equality of their results."""

import contextlib
import copy
import functools

import torch

import transformer_engine_compile as te


@contextlib.contextmanager
def native_path(on: bool):
    """The native eager path on or off (``kernels.native.ENABLED``) inside."""
    from transformer_engine_compile.kernels import native
    was, native.ENABLED = native.ENABLED, on
    try:
        yield
    finally:
        native.ENABLED = was


def recipe_on(rec):
    """``te.autocast`` under ``rec``; None: no recipe (the layers compute in
    their parameters' dtype)."""
    return te.autocast(enabled=rec is not None, recipe=rec)


def plans(layer) -> list:
    """The native plans of the layer's argument memo entries (None not asked, False none)."""
    return [t.native for t in layer._args_memo[1].values()]


def chain(y) -> list:
    """The autograd node names from y back along first inputs (parameters' leaves skipped)."""
    names, fn = [], y.grad_fn
    while fn is not None:
        names.append(fn.name())
        fn = next((f for f, _ in fn.next_functions if f is not None
                   and f.name() != "torch::autograd::AccumulateGrad"), None)
    return names


def _outputs(layer, out):
    """(y, ln_out) of a fused module's result, whatever it returns."""
    if not isinstance(out, tuple):
        return out, None
    return out[0], (out[-1] if layer.return_layernorm_output else None)


def train_steps(layer, x, dy, rec, native_on, steps=3, d_ln=None, optimizer=False,
                autocast=None):
    """Outputs and gradients of ``steps`` eager steps (the last step's) and
    its output, with the native path on or off; ``d_ln``: the loss also
    reads a returned ``ln_out``; ``optimizer``: an AdamW step after each;
    ``autocast``: a torch.autocast dtype."""
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2) if optimizer else None
    with native_path(native_on):
        for _ in range(steps):
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(x.requires_grad)
            with recipe_on(rec), torch.autocast(
                    "cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                y, ln_out = _outputs(layer, layer(xx))
            loss = (y * dy).float().sum()
            if d_ln is not None:
                loss = loss + (ln_out * d_ln).float().sum()
            loss.backward()
            if opt is not None:
                opt.step()
    grads = [xx.grad] + [p.grad for p in layer.parameters()]
    return [y.detach(), None if ln_out is None else ln_out.detach(), *grads], y


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        assert g is None or torch.equal(g, w), i


def compare(layer, x, dy, rec, **kw):
    """Native steps of ``layer`` against Python-path steps of a copy: every
    output and gradient bit for bit; the two last outputs."""
    ref = copy.deepcopy(layer)
    got, y = train_steps(layer, x, dy, rec, True, **kw)
    want, y_ref = train_steps(ref, x, dy, rec, False, **kw)
    assert_same(got, want)
    return y, y_ref


def _fp8_buffers(module) -> list:
    """The FP8 weight cache and, under DelayedScaling, the histories and scales."""
    return [b.clone() for n, b in sorted(module.named_buffers()) if "fp8_" in n]


def microbatch_steps(module, x, dy, rec, native_on, steps=2, micro=3, ckpt=None):
    """``steps`` gradient-accumulation steps of ``micro`` microbatches with
    ``is_first_microbatch`` (True, then False) and an AdamW step after each,
    the native path on or off: every microbatch's output, input gradient and
    FP8 weight cache, and each step's gradients; and the last output.
    ``ckpt(function, x)``: each call inside that activation checkpoint."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    results = []
    with native_path(native_on):
        for _ in range(steps):
            for i in range(micro):
                xx = x.detach().requires_grad_(x.requires_grad)
                call = functools.partial(module, is_first_microbatch=i == 0)
                with recipe_on(rec):
                    y = call(xx) if ckpt is None else ckpt(call, xx)
                (y * dy).float().sum().backward()
                results += [y.detach(), xx.grad, *_fp8_buffers(module)]
            results += [p.grad.clone() for p in module.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
    return results, y
