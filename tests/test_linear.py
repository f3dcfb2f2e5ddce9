"""te.Linear: compiled (custom ops) against eager (autograd.Function), bit for bit."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

RECIPES = {name: recipe.by_name(name) for name in recipe.RECIPE_NAMES}
SHAPES = {"2d": (128, 128), "3d": (2, 64, 128)}


def _reset():
    torch._dynamo.reset()
    counters.clear()


def _run_steps(layer, step_fn, x0, steps, seed=1):
    """Forward + backward + SGD step, ``steps`` times; returns every result."""
    results = []
    torch.manual_seed(seed)  # NVFP4 stochastic rounding draws from the global RNG
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.1 * i)).requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = step_fn(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters()]
        # clones: a CUDA-graph replay overwrites its outputs
        results.append([y.detach().clone()] + [g.clone() for g in grads])
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.01 * p.grad.to(p.dtype)
    return results


def _make_step(layer, rec, **kw):
    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x, **kw)
    return step


def compare_compiled(rec, shape, bias=True, backend="aot_eager", steps=3, dtype=torch.bfloat16,
                     device="cpu", mode=None):
    _reset()
    torch.manual_seed(0)
    layer = te.Linear(shape[-1], 128, bias=bias, params_dtype=dtype, device=device)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x0 = torch.randn(shape, dtype=dtype, device=device)
    step = _make_step(layer, rec)
    eager = _run_steps(layer, step, x0, steps)
    layer.load_state_dict(state)
    compiled = _run_steps(layer, torch.compile(step, fullgraph=True, backend=backend, mode=mode),
                          x0, steps)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        for name, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), e, c):
            assert a.dtype == b.dtype and a.shape == b.shape, (i, name)
            assert torch.equal(a, b), f"step {i}: {name} differs"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    return eager


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_equals_eager_aot_eager(name, bias, shape):
    results = compare_compiled(RECIPES[name], SHAPES[shape], bias)
    assert len(results[0]) == (4 if bias else 3)


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8", "fp8_block"])
def test_compiled_equals_eager_inductor(name):
    compare_compiled(RECIPES[name], SHAPES["3d"], True, backend="inductor", steps=2)


def test_compiled_equals_eager_inductor_nvfp4():
    compare_compiled(RECIPES["nvfp4"], SHAPES["2d"], True, backend="inductor", steps=2)


def test_float32_params_compiled_equals_eager():
    compare_compiled(RECIPES["fp8_current"], SHAPES["2d"], dtype=torch.float32, steps=2)


def test_no_recompile_across_steps_and_new_inputs():
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    step = torch.compile(_make_step(layer, RECIPES["mxfp8"]), fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            step(torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_changing_recipe_recompiles_once_per_recipe():
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)

    def step(x, rec):
        with te.autocast(recipe=rec):
            return layer(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    for rec in (RECIPES["fp8_current"], RECIPES["mxfp8"], RECIPES["fp8_current"]):
        out = compiled(x, rec)
        assert torch.equal(out, step(x, rec))
    assert counters["stats"]["unique_graphs"] == 2


# -- numerics of the eager path ------------------------------------------------------------
def test_bf16_matches_torch_linear_and_autograd():
    torch.manual_seed(0)
    layer = te.Linear(64, 32, params_dtype=torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.weight.detach().clone().requires_grad_()
    b_ref = layer.bias.detach().clone().requires_grad_()
    y = layer(x)
    y_ref = torch.nn.functional.linear(x_ref, w_ref, b_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad)
    torch.testing.assert_close(layer.bias.grad, b_ref.grad)


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
def test_quantized_forward_is_gemm_of_dequantized_operands(name):
    """y = deq(q_in(x)) @ deq(q_w(W))^T + b in fp32, exactly (the reference GEMM)."""
    torch.manual_seed(0)
    rec = RECIPES[name]
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=rec):
        y = layer(x)
    qx = te.quantizer_for(rec, "input").with_usage(rowwise=True, columnwise=False)
    qw = te.quantizer_for(rec, "weight").with_usage(rowwise=True, columnwise=False)
    expect = (qx(x).dequantize(dtype=torch.float32) @ qw(layer.weight.detach())
              .dequantize(dtype=torch.float32).t() + layer.bias.float()).to(torch.bfloat16)
    assert torch.equal(y, expect)


@pytest.mark.parametrize("name,tol", [("fp8_current", 0.08), ("mxfp8", 0.08),
                                      ("fp8_block", 0.08), ("nvfp4", 0.3)])
def test_quantized_grads_close_to_bf16(name, tol):
    torch.manual_seed(0)
    layer = te.Linear(128, 128, params_dtype=torch.float32)
    x0 = torch.randn(128, 128)
    results = {}
    for key, rec in (("ref", None), ("q", RECIPES[name])):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = layer(x)
        y.backward(torch.ones_like(y) * torch.linspace(-1, 1, 128))
        results[key] = (y, x.grad, layer.weight.grad, layer.bias.grad)
    for a, b in zip(results["ref"], results["q"]):
        assert ((a - b).norm() / a.norm()).item() < tol


def assert_compiled_step_equals_eager(layer, step, x0, backend="aot_eager"):
    """One forward + backward, eager then compiled: (out, dgrad, wgrad, bias grad) equal."""
    res = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = fn(x)
        y.float().sum().backward()
        res.append((y, x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*res):
        assert a is not None and torch.equal(a, b)
    return res


# -- FP8 primary weight, fp8_output ---------------------------------------------------------
@pytest.mark.parametrize("qname", ["fp8", "mxfp8"])
def test_fp8_primary_weight_compiled_equals_eager(qname):
    _reset()
    torch.manual_seed(0)
    layer = te.Linear(128, 64, params_dtype=torch.bfloat16)
    q = {"fp8": te.Float8CurrentScalingQuantizer("e4m3"), "mxfp8": te.MXFP8Quantizer()}[qname]
    layer.weight = torch.nn.Parameter(q(layer.weight.detach()))
    rec = RECIPES["fp8_current"] if qname == "fp8" else RECIPES["mxfp8"]
    res = assert_compiled_step_equals_eager(layer, _make_step(layer, rec),
                                            torch.randn(64, 128, dtype=torch.bfloat16))
    assert type(res[1][2]) is torch.Tensor and res[1][2].dtype == torch.bfloat16
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
def test_fp8_output_without_grad(name):
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    rec = RECIPES[name]

    def infer(x):
        with torch.no_grad(), te.autocast(recipe=rec):
            return layer(x, fp8_output=True)

    x = torch.randn(128, 128, dtype=torch.bfloat16)
    eager = infer(x)
    compiled = torch.compile(infer, fullgraph=True, backend="aot_eager")(x)
    assert isinstance(eager, te.QuantizedTensor) and type(compiled) is type(eager)
    assert eager.shape == (128, 128) and eager.dtype == torch.bfloat16
    assert torch.equal(eager.dequantize(), compiled.dequantize())
    with torch.no_grad(), te.autocast(recipe=rec):
        plain = layer(x)
    expect = te.quantizer_for(rec, "output")(plain)
    assert torch.equal(eager.dequantize(), expect.dequantize())


def test_fp8_output_with_grad_is_refused_up_front():
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    with te.autocast(recipe=RECIPES["fp8_current"]):
        with pytest.raises(NotImplementedError, match="fp8_output=True is supported without"):
            layer(x, fp8_output=True)
    with pytest.raises(ValueError, match="needs an active quantization recipe"):
        with torch.no_grad():
            layer(x, fp8_output=True)


def test_return_bias_returns_unadded_bias():
    layer = te.Linear(64, 32, params_dtype=torch.bfloat16, return_bias=True)
    with torch.no_grad():
        layer.bias.fill_(1.0)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    out, bias = layer(x)
    assert bias is layer.bias
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compiled", "fullgraph"])
def test_bad_inputs_raise_clear_errors(mode):
    """Eager and compiled (graph breaks allowed) raise the error itself;
    under fullgraph=True Dynamo wraps it in Unsupported, message intact."""
    _reset()
    layer = te.Linear(128, 64, params_dtype=torch.bfloat16)

    def call(x, rec=None):
        fn = _make_step(layer, rec)
        if mode != "eager":
            fn = torch.compile(fn, fullgraph=mode == "fullgraph", backend="aot_eager")
        return fn(x)

    def raises(exc, match):
        return pytest.raises(torch._dynamo.exc.Unsupported if mode == "fullgraph" else exc,
                             match=match)

    with raises(ValueError, "must end in 128"):
        call(torch.randn(4, 100, dtype=torch.bfloat16))
    with raises(TypeError, "float32, bfloat16 or float16"):
        call(torch.ones(4, 128, dtype=torch.int32))
    with raises(TypeError, "differs from the weight"):
        call(torch.randn(4, 128, dtype=torch.float32))
    # any token count fits (tests/test_token_counts.py); the feature dims keep the
    # GEMMs' rules: a 64 x 128 weight is no whole number of 128x128 blocks
    with raises(ValueError, r"the weight as a 64 x 128 matrix does not fit the recipe: FP8 "
                r"blockwise \(128x128\) needs the rows divisible by 128"):
        call(torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True), RECIPES["fp8_block"])


def test_delayed_scaling_runs_and_keeps_its_state_in_buffers():
    layer = te.Linear(128, 64)
    with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=16)):
        layer(torch.randn(4, 128))
    assert layer.fp8_amax_history_fwd.shape == (16, 2) and layer.fp8_scale_bwd.shape == (2,)
    assert "fp8_scale_fwd" not in layer.state_dict()  # non-persistent (docs/linear.md)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="in_features"):
        te.Linear(0, 4)
    with pytest.raises(ValueError, match="parallel_mode"):
        te.Linear(4, 4, parallel_mode="diagonal")
    with pytest.raises(ValueError, match="needs tp_group"):
        te.Linear(4, 4, parallel_mode="column", tp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel=True needs parallel_mode"):
        te.Linear(4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        te.Linear(4, 4, parallel_mode="row", tp_size=0)
    with pytest.raises(TypeError, match="params_dtype"):
        te.Linear(4, 4, params_dtype=torch.int8)


def test_bias_free_layer_without_recipe_runs_torch_linear(monkeypatch):
    """No recipe and no bias: te.Linear computes F.linear (no op call eager,
    no te_compile op in the compiled graphs), bit for bit torch.nn.Linear's
    result, compiled equal to eager.  A recipe keeps the ops; so does a bias
    compiled, and eagerly it runs the ops' kernels behind PlainLinear."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from transformer_engine_compile.module.linear.ops import LINEAR_OPS

    _reset()
    calls = []
    eager_ops = LINEAR_OPS.eager
    monkeypatch.setattr(LINEAR_OPS, "eager", lambda args: calls.append(1) or eager_ops(args))
    torch.manual_seed(0)
    layer = te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16)
    ref = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda mod, x: mod(x), fullgraph=True, backend=backend)

    def run(mod, fn):
        x = torch.randn(4, 8, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        y = fn(mod, x)
        y.float().square().sum().backward()
        out = [y.detach(), x.grad, mod.weight.grad]
        mod.weight.grad = None
        return out

    want = run(ref, lambda mod, x: mod(x))
    for got in (run(layer, lambda mod, x: mod(x)), run(layer, compiled)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == []
    graphs = [g.code for g in backend.fw_graphs + backend.bw_graphs]
    assert graphs and not any("te_compile" in code for code in graphs)

    with_bias = te.Linear(64, 32, params_dtype=torch.bfloat16)
    run(with_bias, lambda mod, x: mod(x))
    assert calls == []  # eagerly a bias runs PlainLinear (tests/test_linear_plain_ops.py)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        run(layer, lambda mod, x: mod(x))
    assert len(calls) == 1
