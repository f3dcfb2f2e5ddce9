"""te.LayerNorm and te.RMSNorm: torch's normalisations on fp32 data,
gradients, zero-centred gamma, compiled against eager, state_dict names,
and te.RMSNorm / te.LayerNorm + te.Linear against te.LayerNormLinear."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.kernels import reference as ref

NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}


def _torch_norm(name, x, weight, bias, eps):
    if name == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (0 if p is not module.weight else 1))


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("shape", [(16, 96), (2, 5, 257)], ids=str)
def test_fp32_equals_torch(name, shape):
    """fp32 data: equal to torch's own normalisation within fp32 rounding,
    forward and every gradient."""
    norm = NORMS[name](shape[-1], eps=1e-5)
    _randomize(norm)
    x = torch.randn(shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    params_ref = [p.detach().clone().requires_grad_() for p in norm.parameters()]
    y = norm(x)
    y_ref = _torch_norm(name, x_ref, params_ref[0], params_ref[1] if len(params_ref) > 1 else None,
                        1e-5)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(norm.parameters(), params_ref):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zcgamma"])
def test_equals_reference_norm_forward(name, dtype, zero_centered_gamma):
    """Bit for bit the numerics of kernels.reference.norm_forward (the one
    LayerNormLinear runs), bf16 included: fp32 math, one rounding."""
    norm = NORMS[name](64, params_dtype=dtype, zero_centered_gamma=zero_centered_gamma)
    _randomize(norm)
    x = torch.randn(3, 7, 64, dtype=dtype) * 3 + 1
    gamma = norm.weight.float() + 1 if zero_centered_gamma else norm.weight
    y_ref, _, _ = ref.norm_forward(x.reshape(-1, 64), gamma, norm.bias, 1e-5,
                                   name == "RMSNorm")
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.reshape(-1, 64), y_ref)


@pytest.mark.parametrize("name", NORMS)
def test_zero_centered_gamma(name):
    """Initialised to zeros; scales by 1 + weight, equal to a plain norm
    whose weight is 1 + weight."""
    zc = NORMS[name](32, zero_centered_gamma=True)
    assert torch.equal(zc.weight, torch.zeros(32))
    plain = NORMS[name](32)
    assert torch.equal(plain.weight, torch.ones(32))
    with torch.no_grad():
        zc.weight.copy_(torch.randn(32) * 0.1)
        plain.weight.copy_(zc.weight + 1)
        if zc.bias is not None:
            zc.bias.copy_(torch.randn(32))
            plain.bias.copy_(zc.bias)
    x = torch.randn(8, 32, requires_grad=True)
    torch.testing.assert_close(zc(x), plain(x), rtol=1e-6, atol=1e-6)
    zc(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(zc.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_equals_eager(name, backend, dtype):
    """fullgraph, one graph, no break; aot_eager bit for bit, inductor
    (its own fused kernel, another summation order) within rounding."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    norm = NORMS[name](96, params_dtype=dtype, zero_centered_gamma=True)
    _randomize(norm)
    x0 = torch.randn(4, 24, 96, dtype=dtype)

    results = []
    for fn in (norm, torch.compile(norm, fullgraph=True, backend=backend)):
        norm.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = fn(x)
        (y.float() * torch.linspace(-1, 1, 96)).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in norm.parameters()])
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    for what, a, b in zip(("out", "dx", "dw", "db"), *results):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        if backend == "aot_eager":
            assert torch.equal(a, b), what
        else:
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=what)


def test_state_dict_names_and_attributes():
    ln = te.LayerNorm(48, eps=1e-6, sequence_parallel=True, params_dtype=torch.bfloat16)
    assert list(ln.state_dict()) == ["weight", "bias"]
    assert ln.weight.dtype == torch.bfloat16 and ln.weight.shape == (48,)
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    rms = te.RMSNorm(hidden_size=48)
    assert list(rms.state_dict()) == ["weight"] and rms.bias is None
    assert rms.eps == 1e-5 and not rms.weight.sequence_parallel
    # a torch LayerNorm's state dict loads (same names)
    ln32 = te.LayerNorm(48)
    ln32.load_state_dict(torch.nn.LayerNorm(48).state_dict())
    x = torch.randn(5, 48)
    torch.testing.assert_close(ln32(x), F.layer_norm(x, (48,)), rtol=1e-6, atol=1e-6)


def test_multi_dim_normalized_shape():
    ln = te.LayerNorm((4, 8))
    _randomize(ln)
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (4, 8), ln.weight, ln.bias), rtol=1e-5,
                               atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="normalized_shape"):
        te.RMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        te.LayerNorm(8, eps=-1.0)
    with pytest.raises(TypeError, match="not both"):
        te.LayerNorm(8, hidden_size=8)
    with pytest.raises(ValueError, match="does not end"):
        te.RMSNorm(8)(torch.randn(2, 9))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("rec", [None, "fp8_current", "mxfp8"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zcgamma"])
def test_norm_then_linear_equals_layernorm_linear(normalization, rec, zero_centered_gamma):
    """te.RMSNorm / te.LayerNorm followed by te.Linear computes the forward
    of te.LayerNormLinear with the same parameters bit for bit (eager,
    CPU), and the same gradients within fp32 summation order."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    fused = te.LayerNormLinear(64, 32, normalization=normalization,
                               zero_centered_gamma=zero_centered_gamma, params_dtype=dt)
    norm = NORMS[normalization](64, params_dtype=dt, zero_centered_gamma=zero_centered_gamma)
    linear = te.Linear(64, 32, params_dtype=dt)
    with torch.no_grad():
        fused.layer_norm_weight.copy_(torch.randn(64) * 0.2 + (0 if zero_centered_gamma else 1))
        norm.weight.copy_(fused.layer_norm_weight)
        if normalization == "LayerNorm":
            fused.layer_norm_bias.copy_(torch.randn(64) * 0.2)
            norm.bias.copy_(fused.layer_norm_bias)
        linear.weight.copy_(fused.weight)
        linear.bias.copy_(fused.bias)
    r = None if rec is None else recipe.by_name(rec)
    x = torch.randn(2, 32, 64, dtype=dt) * 2 + 0.5
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(2, 32, 32, dtype=dt)
    with te.autocast(enabled=r is not None, recipe=r):
        ya = fused(xa)
        yb = linear(norm(xb))
    assert torch.equal(ya, yb)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(fused.weight.grad, linear.weight.grad)
    assert torch.equal(fused.bias.grad, linear.bias.grad)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused.layer_norm_weight.grad, norm.weight.grad, rtol=1e-2,
                               atol=1e-2)


def _layernorm_linear_pair(normalization, dt=torch.bfloat16):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(64, 48, normalization=normalization, params_dtype=dt)
    with torch.no_grad():
        layer.layer_norm_weight.copy_(torch.randn(64) * 0.2 + 1)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.copy_(torch.randn(64) * 0.2)
    return layer


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("rec", ["fp8_current", "fp8_current_pow2"])
def test_amax_from_norm_equals_separate_quantization(normalization, rec, monkeypatch):
    """FP8 current scaling quantizes the norm's output with the amax the
    norm produced: outputs and gradients equal the path that quantizes it
    separately (its own amax pass), bit for bit."""
    from transformer_engine_compile.module.layernorm import linear_ops as LO
    layer = _layernorm_linear_pair(normalization)
    if rec == "fp8_current_pow2":
        r = recipe.Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3)
    else:
        r = recipe.by_name(rec)
    x = torch.randn(3, 40, 64, dtype=torch.bfloat16) * 3
    dy = torch.randn(3, 40, 48, dtype=torch.bfloat16)
    calls = []
    real = LO._amax_fused_quantizer
    monkeypatch.setattr(LO, "_amax_fused_quantizer",
                        lambda args: calls.append(real(args)) or calls[-1])
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LO, "_amax_fused_quantizer", lambda args: None)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=r):
            y = layer(xi)
        y.backward(dy)
        results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    assert calls and calls[0] is not None  # the fused path ran
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("rec", [None, "fp8_current", "fp8_delayed"])
def test_layernorm_linear_compiled_equals_eager(normalization, rec):
    """The op with the amax-fused forward compiles (one graph, no break)
    and equals eager bit for bit over 2 steps (aot_eager)."""
    torch._dynamo.reset()
    counters.clear()
    layer = _layernorm_linear_pair(normalization)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    r = None if rec is None else (recipe.DelayedScaling() if rec == "fp8_delayed"
                                  else recipe.by_name(rec))

    def step(x):
        with te.autocast(enabled=r is not None, recipe=r):
            return layer(x)

    x0 = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        layer.load_state_dict(state)
        out = []
        for i in range(2):
            layer.zero_grad(set_to_none=True)
            x = (x0 * (1 + 0.1 * i)).requires_grad_()
            y = fn(x)
            (y.float() * torch.linspace(-1, 1, 48)).sum().backward()
            out.append([y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()])
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.01 * p.grad.to(p.dtype)
        runs.append(out)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    for e, c in zip(*runs):
        for a, b in zip(e, c):
            assert torch.equal(a, b)
