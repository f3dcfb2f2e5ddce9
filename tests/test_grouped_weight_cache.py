"""te.GroupedLinear's weight caching across gradient-accumulation
microbatches (Transformer Engine's ``is_first_microbatch``) on CPU: the
first microbatch quantizes the experts' weights and keeps their FP8 copies,
the later ones reuse them without reading the weights; eager and compiled
alike, the ops opcheck-clean, and clear errors where it cannot apply."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.module.grouped.weight_cache import weight_cache

from test_grouped_blockwise_kernel import _layer as _wide_layer
from test_grouped_linear import E, IN, OUT, _layer, opcheck_grouped_ops

SIZES = (5, 0, 11, 16)


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), IN, generator=g).to(torch.bfloat16)
    x = x * torch.arange(1, x.shape[0] + 1).unsqueeze(1)  # scales that differ by expert
    return x, torch.randn(sum(SIZES), OUT, generator=g).to(torch.bfloat16)


def _step(fn, layer, x, dy, rec, first):
    """One microbatch: (y, dx, dW, db), the weight's gradient accumulated."""
    x = x.detach().requires_grad_()
    with te.autocast(recipe=rec):
        y = fn(x, torch.tensor(SIZES), first)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def _same(a, b):
    for u, v in zip(a, b):
        torch.testing.assert_close(v, u, rtol=0, atol=0)


def _compiled(layer, backend):
    return torch.compile(layer, fullgraph=True, backend=backend) if backend else layer


@pytest.mark.parametrize("compiled", [None, "aot_eager", "inductor"],
                         ids=["eager", "aot_eager", "inductor"])
def test_current_scaling_reuses_the_first_microbatchs_fp8_weights(compiled):
    """Microbatches (True, False, False) equal uncached ones while the
    weights stay put; when the weights change under it, a False call keeps
    computing with the cached FP8 weights (the uncached output moves), and
    a True call quantizes the new ones."""
    torch._dynamo.reset()
    rec = te.recipe.Float8CurrentScaling()
    cached, plain = _layer(), _layer()
    fn_c, fn_p = _compiled(cached, compiled), _compiled(plain, compiled)
    x, dy = _data()
    for first in (True, False, False):
        _same(_step(fn_p, plain, x, dy, rec, None), _step(fn_c, cached, x, dy, rec, first))
    y_before = _step(fn_c, cached, x, dy, rec, False)
    with torch.no_grad():
        cached.weight.mul_(2)
        plain.weight.mul_(2)
    cached.zero_grad()
    y_reused = _step(fn_c, cached, x, dy, rec, False)
    y_plain = _step(fn_p, plain, x, dy, rec, None)
    assert not torch.equal(y_plain[0], y_before[0])
    torch.testing.assert_close(y_reused[0], y_before[0], rtol=0, atol=0)
    torch.testing.assert_close(y_reused[1], y_before[1], rtol=0, atol=0)  # dgrad: cached W too
    plain.zero_grad()
    cached.zero_grad()
    _same(_step(fn_p, plain, x, dy, rec, None), _step(fn_c, cached, x, dy, rec, True))


def test_delayed_scaling_caches_and_records_the_weights_amax():
    """Under DelayedScaling the cache holds W cast with the first
    microbatch's scale; compiled equals eager over the microbatches, and
    every microbatch records W's amax as an uncached layer does (its
    history equal to that layer's), also after the weights change."""
    torch._dynamo.reset()
    rec = te.recipe.DelayedScaling()
    eager, compiled, plain = _layer(), _layer(), _layer()
    fn = _compiled(compiled, "aot_eager")
    x, dy = _data()
    for i, first in enumerate((True, False, False, None, False)):
        if i == 3:
            with torch.no_grad():
                for m in (eager, compiled, plain):
                    m.weight.mul_(2)
        _same(_step(eager, eager, x, dy, rec, first), _step(fn, compiled, x, dy, rec, first))
        _step(plain, plain, x, dy, rec, None)
        for name in ("fp8_amax_history_fwd", "fp8_scale_fwd", "fp8_amax_history_bwd"):
            assert torch.equal(getattr(eager, name), getattr(plain, name)), (i, name)
            assert torch.equal(getattr(compiled, name), getattr(plain, name)), (i, name)
    # the last call (False) used W cast before the change: not the uncached output
    y_cached = _step(eager, eager, x, dy, rec, False)[0]
    assert not torch.equal(y_cached, _step(plain, plain, x, dy, rec, None)[0])


def test_compiles_one_graph_per_flag():
    torch._dynamo.reset()
    rec, layer = te.recipe.Float8CurrentScaling(), _layer()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(layer, fullgraph=True, backend=backend)
    x, dy = _data()
    for first in (True, False, False, True, False):
        with te.autocast(recipe=rec):
            step(x, torch.tensor(SIZES), first)
    assert len(graphs) == 2, len(graphs)


def test_the_cache_is_module_state_not_checkpoint_state():
    rec, layer = te.recipe.Float8CurrentScaling(), _layer()
    x, _ = _data()
    with te.autocast(recipe=rec):
        layer(x, list(SIZES), True)
    names = {n for n, _ in layer.named_buffers()}
    assert {"fp8_weight_data", "fp8_weight_transposed", "fp8_weight_scale_inv"} <= names
    assert layer.fp8_weight_data.dtype == torch.float8_e4m3fn
    assert layer.fp8_weight_transposed.shape == (E, IN, OUT)
    assert not any("fp8_weight" in k for k in layer.state_dict())
    twin = copy.deepcopy(layer)  # a copy keeps its own cache, and its own state key
    with torch.no_grad():
        layer.fp8_weight_scale_inv.fill_(7.0)
    assert not torch.equal(twin.fp8_weight_scale_inv, layer.fp8_weight_scale_inv)
    with te.autocast(recipe=rec):
        assert torch.equal(twin(x, list(SIZES), False), twin(x, list(SIZES)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_errors_and_the_flag_without_a_recipe(compiled):
    torch._dynamo.reset()
    layer = _layer()
    call = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    x, _ = _data()

    def raises(exc, match):
        return pytest.raises(torch._dynamo.exc.Unsupported if compiled else exc, match=match)

    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        # raised while Dynamo allocates the buffers: it wraps it as an internal error
        with pytest.raises(Exception if compiled else ValueError,
                           match="is_first_microbatch=False reuses the FP8 weights"):
            call(x, list(SIZES), False)
    with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
        with raises(NotImplementedError, "not MXFP8BlockScaling"):
            call(torch.zeros(32, IN, dtype=torch.bfloat16), list(SIZES), True)
    with pytest.raises(TypeError, match="must be a Python bool"):
        layer(x, list(SIZES), torch.tensor(True))
    # without a recipe the flag changes nothing, as in Transformer Engine
    for first in (True, False):
        assert torch.equal(call(x, list(SIZES), first), layer(x, list(SIZES)))
    assert not any("fp8_weight" in n for n, _ in layer.named_buffers())


@pytest.mark.parametrize("first", [True, False], ids=["caching", "reusing"])
def test_opcheck_forward_and_backward_ops(first):
    rec, layer = te.recipe.Float8CurrentScaling(), _layer()
    x, dy = _data()
    with te.autocast(recipe=rec):
        layer(x, list(SIZES), True)  # fills the cache
    cache = {f"weight_cache_{n}": getattr(layer, f"fp8_weight_{n}").clone()
             for n in ("data", "transposed", "scale_inv")}
    real, args = opcheck_grouped_ops(rec, layer, SIZES, x, dy, cache_weight=first, **cache)
    assert ("weight_cache_data" in real.outputs) == first
    if not first:  # the backward reads the cached transposed copy itself
        assert real.saved["weightmat"] is args.weight_cache_transposed


# -- FP8 blockwise on the CuTeDSL kernel (its reference standing in on CPU) -------------
WIDE_SIZES = (128, 0, 130, 256)


@pytest.mark.parametrize("compiled", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_blockwise_kernel_path_reuses_the_cached_weight(stand_in_kernel, compiled):
    """Under Float8BlockScaling the kernel path caches all experts' W as the
    kernel reads it (both copies of one (experts * out, in) matrix):
    microbatches (True, False, False) equal uncached ones, a False call
    after the weights changed computes with the cached copies (dgrad too),
    and a True call quantizes the new ones."""
    torch._dynamo.reset()
    rec = te.recipe.Float8BlockScaling()
    cached, plain = _wide_layer(), _wide_layer()
    fn_c, fn_p = _compiled(cached, compiled), _compiled(plain, compiled)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(WIDE_SIZES), 256, generator=g).bfloat16()
    dy = torch.randn(sum(WIDE_SIZES), 384, generator=g).bfloat16()

    def step(fn, layer, first):
        xg = x.detach().requires_grad_()
        with te.autocast(recipe=rec):
            y = fn(xg, torch.tensor(WIDE_SIZES), first)
        y.backward(dy)
        return y.detach(), xg.grad, layer.weight.grad.clone()

    for first in (True, False, False):
        _same(step(fn_p, plain, None), step(fn_c, cached, first))
    names = {n for n, _ in cached.named_buffers() if n.startswith("fp8_weight_")}
    assert names == {"fp8_weight_rowwise_data", "fp8_weight_rowwise_scale_inv",
                     "fp8_weight_columnwise_data", "fp8_weight_columnwise_scale_inv"}
    assert cached.fp8_weight_rowwise_data.shape == (4 * 384, 256)
    before = step(fn_c, cached, False)
    with torch.no_grad():
        cached.weight.mul_(2)
        plain.weight.mul_(2)
    reused = step(fn_c, cached, False)
    for a, b in zip(before[:2], reused[:2]):  # y and dx from the cached W
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not torch.equal(step(fn_p, plain, None)[0], before[0])
    cached.zero_grad()
    plain.zero_grad()
    _same(step(fn_p, plain, None), step(fn_c, cached, True))


def test_blockwise_without_the_kernel_refuses_the_flag():
    layer = _wide_layer()
    x = torch.randn(sum(WIDE_SIZES), 256).bfloat16()
    with te.autocast(recipe=te.recipe.Float8BlockScaling()):
        with pytest.raises(NotImplementedError, match="on the CuTeDSL grouped GEMM"):
            layer(x, list(WIDE_SIZES), True)


@pytest.mark.parametrize("first", [True, False], ids=["caching", "reusing"])
def test_blockwise_opcheck_with_the_cache(stand_in_kernel, first):
    rec, layer = te.recipe.Float8BlockScaling(), _wide_layer()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(WIDE_SIZES), 256, generator=g).bfloat16()
    dy = torch.randn(sum(WIDE_SIZES), 384, generator=g).bfloat16()
    with te.autocast(recipe=rec):
        layer(x, list(WIDE_SIZES), True)
        # the layer's cache, as its forward binds it
        fields = weight_cache(layer, "", layer.weight, False, "te.GroupedLinear")[1]()
    real, args = opcheck_grouped_ops(rec, layer, WIDE_SIZES, x, dy, cache_weight=first,
                                     **fields)
    assert ("weight_cache_blockwise" in real.outputs) == first
    # dgrad reads the cached W: the one this call wrote, or the layer's
    want = real.outputs["weight_cache_blockwise"] if first else args.weight_cache_blockwise
    assert real.saved["weightmat"] is want


# -- te.GroupedExperts: both grouped GEMMs cached -----------------------------------------
def _experts(hidden=64, ffn=32):
    torch.manual_seed(0)
    return te.GroupedExperts(E, hidden, ffn, params_dtype=torch.bfloat16)


def _routed(tokens, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, index = torch.rand(tokens, E, generator=g).topk(2, dim=-1)
    index[:, 0] = index[:, 0].clamp(max=E - 2)  # the last expert gets no tokens
    index[:, 1] = index[:, 1].clamp(max=E - 2)
    return x, index, weights.bfloat16(), torch.randn(tokens, hidden, generator=g).bfloat16()


def _experts_step(fn, experts, data, rec, first):
    x, index, weights, dy = data
    x = x.detach().requires_grad_()
    with te.autocast(recipe=rec):
        y = fn(x, index, weights, first) if first is not None else fn(x, index, weights)
    y.backward(dy)
    return (y.detach(), x.grad, experts.gate_up_proj.grad.clone(),
            experts.down_proj.grad.clone())


@pytest.mark.parametrize("compiled", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_experts_cache_both_grouped_gemms(compiled):
    """te.GroupedExperts caches gate/up's and down's FP8 weights under
    buffers of their own: microbatches (True, False, False) equal uncached
    ones, gradients accumulated, and after the weights change a False call
    still computes with the cached copies."""
    torch._dynamo.reset()
    rec = te.recipe.Float8CurrentScaling()
    cached, plain = _experts(), _experts()
    fn_c, fn_p = _compiled(cached, compiled), _compiled(plain, compiled)
    data = _routed(24, 64, 5)
    for first in (True, False, False):
        _same(_experts_step(fn_p, plain, data, rec, None),
              _experts_step(fn_c, cached, data, rec, first))
    names = {n for n, _ in cached.named_buffers() if "fp8_weight" in n}
    assert names == {f"{g}fp8_weight_{p}" for g in ("gate_up_", "down_")
                     for p in ("data", "transposed", "scale_inv")}
    assert cached.gate_up_fp8_weight_transposed.shape == (E, 64, 64)
    assert cached.down_fp8_weight_data.shape == (E, 64, 32)
    before = _experts_step(fn_c, cached, data, rec, False)
    with torch.no_grad():
        cached.down_proj.mul_(2)
        plain.down_proj.mul_(2)
    reused = _experts_step(fn_c, cached, data, rec, False)
    for a, b in zip(before[:2], reused[:2]):  # y and dx from the cached down weights
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not torch.equal(_experts_step(fn_p, plain, data, rec, None)[0], before[0])


def test_experts_delayed_scaling_compiled_equals_eager():
    """Under DelayedScaling both GEMMs' caches hold W cast with the first
    microbatch's scales: compiled equals eager over the microbatches, and
    gate/up's forward history (its x and its W, recorded at every
    microbatch) equals an uncached module's (what follows gate/up sees
    values computed with the cached weights, so it may differ)."""
    torch._dynamo.reset()
    rec = te.recipe.DelayedScaling()
    eager, compiled, plain = _experts(), _experts(), _experts()
    fn = _compiled(compiled, "aot_eager")
    data = _routed(24, 64, 8)
    for i, first in enumerate((True, False, False)):
        _same(_experts_step(eager, eager, data, rec, first),
              _experts_step(fn, compiled, data, rec, first))
        _experts_step(plain, plain, data, rec, None)
        assert torch.equal(compiled.gate_up_fp8_amax_history_fwd,
                           plain.gate_up_fp8_amax_history_fwd), i


def test_experts_blockwise_kernel_path_caches_both_gemms(stand_in_kernel):
    """Under Float8BlockScaling on the kernel path each GEMM keeps its
    (experts * out, in) blockwise matrix; cached microbatches equal
    uncached ones."""
    torch._dynamo.reset()
    rec = te.recipe.Float8BlockScaling()
    cached, plain = _experts(256, 128), _experts(256, 128)
    fn_c = _compiled(cached, "aot_eager")
    data = _routed(160, 256, 6)
    for first in (True, False):
        _same(_experts_step(plain, plain, data, rec, None),
              _experts_step(fn_c, cached, data, rec, first))
    assert cached.gate_up_fp8_weight_rowwise_data.shape == (E * 256, 256)
    assert cached.down_fp8_weight_columnwise_data.shape[0] == 128


def test_experts_errors():
    experts = _experts()
    x, index, weights, _ = _routed(24, 64, 7)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        with pytest.raises(ValueError, match="te.GroupedExperts: is_first_microbatch=False"):
            experts(x, index, weights, False)
    with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
        with pytest.raises(NotImplementedError, match="te.GroupedExperts caches"):
            experts(x, index, weights, True)
    for first in (True, False):  # no recipe: the flag changes nothing
        assert torch.equal(experts(x, index, weights, first), experts(x, index, weights))
