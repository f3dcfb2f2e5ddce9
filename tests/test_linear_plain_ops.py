"""The linear ops' short path for calls without a recipe
(module/linear/plain.py): the Python impls' outputs bit for bit, and
None (the Python impl) for every configuration it does not cover."""

import dataclasses

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.dynamo.custom_op import _owning
from transformer_engine_compile.module.linear import plain as plain
from transformer_engine_compile.module.linear.ops import LINEAR_OPS as OPS

BF16 = torch.bfloat16
# on CUDA the Python impl's GEMMs dispatch to cuda_gemm.py, which the short path skips
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _calls(shape=(16, 64), bias=True, x_grad=True, w_grad=True, recipe=None, device="cpu"):
    torch.manual_seed(0)
    layer = te.Linear(64, 32, bias=bias, params_dtype=BF16, device=device)
    layer.weight.requires_grad_(w_grad)
    x = torch.randn(shape, dtype=BF16, requires_grad=x_grad, device=device)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        args = layer._make_args(x, None, False, False)
    with torch.no_grad():
        result = OPS.forward(args)
    dy = torch.randn((*shape[:-1], 32), dtype=BF16, device=device)
    bwd = OPS.make_bwd_args(dict(result.saved), OPS.setup_context(args), {"grad_output": dy})
    return args, bwd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(16, 64), (2, 8, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_plain_ops_return_the_python_impls_outputs(shape, bias, grads, device):
    args, bwd = _calls(shape, bias, *grads, device=device)
    with torch.no_grad():
        want = [_owning(t) for t in OPS._fwd_result(args)]
        got = plain.forward(args)
        want_b, got_b = OPS._bwd_result(bwd), plain.backward(bwd)
    assert got is not None and got_b is not None
    assert len(got) == len(want) == 1 and torch.equal(got[0], want[0])
    assert got[0].shape == (*shape[:-1], 32) and got[0]._base is None  # owns its storage
    assert [t.shape for t in got_b] == [t.shape for t in want_b]
    assert all(torch.equal(g, w) for g, w in zip(got_b, want_b))
    assert len(got_b) == grads[0] + grads[1] + bias


def test_plain_ops_leave_other_calls_to_the_python_impls():
    args, bwd = _calls()
    split = {"parallel_mode": "column", "tp_size": 2}
    assert plain.forward(dataclasses.replace(args, **split)) is None
    assert plain.backward(dataclasses.replace(bwd, **split)) is None
    assert plain.forward(dataclasses.replace(args, cache_weight=True)) is None
    main_grad = torch.zeros(32, 64)
    assert plain.backward(dataclasses.replace(bwd, main_grad=main_grad)) is None
    assert plain.forward(dataclasses.replace(args, parallel_mode="row", tp_size=1)) is not None
    q_args, q_bwd = _calls(recipe=te.recipe.Float8CurrentScaling())
    assert plain.forward(q_args) is None and plain.backward(q_bwd) is None


def test_bf16_layer_trains_through_the_ops_as_eagerly(monkeypatch):
    """The ops (compiled, not lowered on CPU) take the short path and
    compute eager's outputs and gradients."""
    calls = []
    for name in ("forward", "backward"):
        real = getattr(plain, name)
        monkeypatch.setattr(plain, name, lambda a, real=real, name=name: (
            calls.append(name), real(a))[1])
    torch.manual_seed(0)
    layer = te.Linear(64, 32, params_dtype=BF16)
    x = torch.randn(4, 8, 64, dtype=BF16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    want = [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]
    x.grad = layer.weight.grad = layer.bias.grad = None
    y2 = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    y2.float().square().sum().backward()
    got = [y2.detach(), x.grad, layer.weight.grad, layer.bias.grad]
    assert calls == ["forward", "backward"]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _eager_both_ways(layer, x, ac=None):
    """(output, x.grad, parameter grads) of an eager call through
    PlainLinear and through the eager path's generic node (the ops' Python
    impls), with the node type of the first."""
    runs = []
    for plain_on in (True, False):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        real = plain.runs
        plain.runs = real if plain_on else (lambda inp, bias: False)
        try:
            with torch.autocast("cpu", dtype=BF16, enabled=ac is not None):
                y = layer(x)
        finally:
            plain.runs = real
        node = type(y.grad_fn).__name__
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        runs.append((node, [y.detach(), x.grad] + [p.grad for p in layer.parameters()]))
    return runs


@pytest.mark.parametrize("case", ["2d", "3d", "frozen_weight", "input_without_grad",
                                  "autocast_fp32_params"])
def test_eager_bias_layer_runs_plain_linear_with_the_eager_paths_bits(case):
    torch.manual_seed(0)
    dtype = torch.float32 if case == "autocast_fp32_params" else BF16
    layer = te.Linear(64, 32, params_dtype=dtype)
    if case == "frozen_weight":
        layer.weight.requires_grad_(False)
    shape = (2, 8, 64) if case == "3d" else (16, 64)
    x = torch.randn(shape, dtype=dtype, requires_grad=case != "input_without_grad")
    (node, got), (other, want) = _eager_both_ways(
        layer, x, ac=BF16 if case == "autocast_fp32_params" else None)
    assert node == "PlainLinearBackward" and other != node
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w))
    assert got[0].dtype == BF16


def test_plain_linear_saves_what_the_gradients_need():
    """As the ops: x only for the weight's gradient, W only for the input's
    (a frozen weight keeps no activation alive)."""
    layer = te.Linear(64, 32, params_dtype=BF16)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "PlainLinearBackward"
    saved_x, saved_w = y.grad_fn.saved_tensors
    assert saved_x is None and saved_w is layer.weight


def test_plain_linear_output_takes_in_place_ops_and_refuses_double_backward():
    layer = te.Linear(64, 32, params_dtype=BF16)
    x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
    y = layer(x)
    assert type(y.grad_fn).__name__ == "PlainLinearBackward" and y._base is None
    y.add_(1)  # a residual added in place, as models do
    g = torch.ones_like(y, requires_grad=True)
    (dx,) = torch.autograd.grad(y, x, g, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


def test_subclass_gradient_sums_its_bias_gradient_through_torch(monkeypatch):
    """The bias gradient's fast kernel reads raw pointers: a plain gradient
    takes it, a tensor-subclass gradient (torch's TwoTensor; a DTensor in
    practice) sums through torch, per component.  On CPU the registered
    kernel is the reference, so a stand-in records who reached it."""
    from torch.testing._internal.two_tensor import TwoTensor
    from transformer_engine_compile import kernels
    reached, get = [], kernels.get

    def recording_get(name, x):
        fn = get(name, x)
        if name != "column_sum":
            return fn

        def fast(x2d, dtype):
            reached.append(type(x2d))
            return fn(x2d, dtype)
        return fast

    monkeypatch.setattr(kernels, "get", recording_get)
    torch.manual_seed(0)
    layer = te.Linear(16, 8, bias=True, params_dtype=torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    dy_a, dy_b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    layer(x).backward(dy_a)
    assert reached == [torch.Tensor]
    want_a = layer.bias.grad.clone()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    assert y.grad_fn.name() == "PlainLinearBackward"
    y.backward(TwoTensor(dy_a, dy_b))
    assert reached == [torch.Tensor]  # the subclass did not reach the kernel
    db = layer.bias.grad
    assert isinstance(db, TwoTensor)
    assert torch.equal(db.a, want_a) and torch.equal(db.b, dy_b.float().sum(0).bfloat16())
