"""The native plain plan (module/linear/native.py, ``_plain_plan``): an
eager bf16 / fp16 ``te.Linear`` with a bias and no recipe runs as one C++
call and a C++ autograd node, giving ``linear_plain_ops.PlainLinear``'s
bits in the ways users train.  Skips without CUDA."""

import contextlib
import copy

import pytest
import torch

import transformer_engine_compile as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native


class _NoNative:
    def __enter__(self):
        self.was, native.ENABLED = native.ENABLED, False

    def __exit__(self, *exc):
        native.ENABLED = self.was


def _grads(layer, x, dy, off=False, calls=3):
    """Output and gradients (x, weight, bias) of the last of ``calls`` eager
    steps (the memo entry is made at the first, the plan at the second)."""
    with _NoNative() if off else contextlib.nullcontext():
        for _ in range(calls):
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(x.requires_grad)
            y = layer(xx)
            y.backward(dy)
    return (y.detach(), xx.grad, layer.weight.grad, layer.bias.grad), y


def _equal(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,out,x_grad,bias_grad",
                         [((256, 512), 384, True, True), ((2, 128, 256), 512, False, True),
                          ((128, 256), 256, True, False), ((3, 50, 72), 40, True, True)],
                         ids=str)
def test_plain_native_equals_python_bit_for_bit(ext, calls, shape, out, x_grad, bias_grad,
                                                dtype):
    """Any sizes (no kernel of ours reads x or W): the output and the three
    gradients equal the Python node's, and the native node ran."""
    torch.manual_seed(3)
    layer = te.Linear(shape[-1], out, bias=True, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        layer.bias.normal_()
    layer.bias.requires_grad_(bias_grad)
    ref = copy.deepcopy(layer)
    x = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(x_grad)
    dy = torch.randn((*shape[:-1], out), device="cuda", dtype=dtype)
    got, y = _grads(layer, x, dy)
    want, y_ref = _grads(ref, x, dy, off=True)
    assert calls["native"] == 2 and y.grad_fn.name() == "TeLinearBackward"
    assert y_ref.grad_fn.name() == "PlainLinearBackward"
    assert (got[3] is not None) == bias_grad and (got[1] is not None) == x_grad
    assert all(_equal(g, w) for g, w in zip(got, want))


def test_plain_native_non_contiguous_input_and_gradient(ext, calls):
    """A transposed input and a transposed gradient: the GEMMs read them as
    the Python path does (no aligned copy of ours), the bias sum a copy."""
    torch.manual_seed(4)
    layer = te.Linear(128, 192, bias=True, params_dtype=torch.bfloat16, device="cuda")
    ref = copy.deepcopy(layer)
    x = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16).t().requires_grad_(True)
    dy = torch.randn(192, 96, device="cuda", dtype=torch.bfloat16).t()
    got, _ = _grads(layer, x, dy)
    want, _ = _grads(ref, x, dy, off=True)
    assert calls["native"] == 2 and all(_equal(g, w) for g, w in zip(got, want))


def test_plain_native_saves_x_then_w_through_hooks(ext, calls):
    """Saved-tensor hooks see x, then W: the Python node's order, so an
    activation checkpoint's recomputation may take either path."""
    layer = te.Linear(256, 128, bias=True, params_dtype=torch.bfloat16, device="cuda")
    ref = copy.deepcopy(layer)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x), layer(x)  # memo, plan
    names = []
    for m, off in ((layer, False), (ref, True)):
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.cpu()

        with _NoNative() if off else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.cuda()):
                y = m(x)
        assert packed == [(64, 256), (128, 256)], off
        names.append(y.grad_fn.name())
        y.sum().backward()
    assert names == ["TeLinearBackward", "PlainLinearBackward"]


def test_plain_native_retain_graph_double_backward_and_version_check(ext, calls):
    layer = te.Linear(256, 128, bias=True, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x), layer(x)
    y = layer(x)
    assert y.grad_fn.name() == "TeLinearBackward"
    y.sum().backward(retain_graph=True)
    g1, b1 = x.grad.clone(), layer.bias.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * g1) and torch.equal(layer.bias.grad, 2 * b1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    y = layer(x)
    dy = torch.ones_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    assert torch.equal(gx, g1)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()
    # an input changed in place after the forward is refused, as torch's nodes refuse it
    xi = x.detach().clone().requires_grad_(True)
    h = xi * 1
    y = layer(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("how", ["te", "torch", "torch_reentrant"])
def test_plain_native_inside_activation_checkpointing(ext, calls, how):
    """Checkpointed plain layers train as the Python path does; the
    recomputation repeats its forward's path."""
    ckpt = {"te": lambda f, x: te.checkpoint(f, x),
            "torch": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False),
            "torch_reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(
                f, x, use_reentrant=True)}[how]
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda"), torch.nn.GELU(),
        te.Linear(512, 256, params_dtype=torch.bfloat16, device="cuda"))
    ref = copy.deepcopy(model)
    x0 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for m, off in ((model, False), (ref, True)):
        with _NoNative() if off else contextlib.nullcontext():
            for _ in range(3):
                m.zero_grad(set_to_none=True)
                x = x0.clone().requires_grad_(True)
                y = ckpt(m, x)
                y.float().square().sum().backward()
        results.append((y.detach(), x.grad, *(p.grad for p in m.parameters())))
    assert calls["native"] > 0
    assert all(torch.equal(g, w) for g, w in zip(*results))


def test_plain_native_training_with_copies_autocast_and_eval(ext, calls):
    """AdamW steps of a deep copy with an evaluation call between steps,
    under torch.autocast over fp32 parameters: losses and parameters equal
    the Python path's bit for bit, and a state dict round trip keeps them."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        te.Linear(256, 512, device="cuda"), torch.nn.GELU(), te.Linear(512, 256, device="cuda"))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 32, 256, device="cuda")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(4):
        losses = []
        for m, opt, off in ((model, opts[0], False), (ref, opts[1], True)):
            with _NoNative() if off else contextlib.nullcontext():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    m(x)  # evaluation before the step
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(x).float().square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], step
    assert calls["native"] > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    loaded = copy.deepcopy(ref)
    loaded.load_state_dict(model.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(loaded(x), model(x))


def test_plain_native_tensor_subclass_gradient_takes_the_python_backward(ext, calls):
    """A gradient that is a tensor subclass (torch's TwoTensor here; a
    DTensor in tensor-parallel training) leaves the node's C++ GEMMs for its
    Python backward (``linear_native._PlainBackward``).  Its gradients equal
    the Python path's for the same subclass gradient.  Per component, the
    input and weight gradients equal the native ones of that component
    alone, and the bias gradient is torch's sum (the column-sum kernel reads
    raw pointers, which a subclass does not have)."""
    from torch.testing._internal.two_tensor import TwoTensor
    torch.manual_seed(6)
    layer = te.Linear(128, 192, bias=True, params_dtype=torch.bfloat16, device="cuda")
    ref, alone = copy.deepcopy(layer), copy.deepcopy(layer)
    x = torch.randn(2, 48, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy_a, dy_b = (torch.randn(2, 48, 192, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
    got, y = _grads(layer, x, TwoTensor(dy_a, dy_b))
    native_before = calls["native"]
    want, y_ref = _grads(ref, x, TwoTensor(dy_a, dy_b), off=True)
    assert native_before == 2 and y.grad_fn.name() == "TeLinearBackward"
    assert y_ref.grad_fn.name() == "PlainLinearBackward"
    for i in (1, 2, 3):  # x, weight, bias
        assert isinstance(got[i], TwoTensor), i
        assert torch.equal(got[i].a, want[i].a) and torch.equal(got[i].b, want[i].b), i
    for dy, part in ((dy_a, "a"), (dy_b, "b")):
        alone_grads = _grads(alone, x, dy)[0]
        for i in (1, 2):
            assert torch.equal(getattr(got[i], part), alone_grads[i]), (part, i)
        assert torch.equal(getattr(got[3], part), dy.reshape(-1, 192).sum(0).bfloat16()), part
