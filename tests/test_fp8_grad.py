"""Quantized dgrad output (``te.Linear(..., fp8_grad=True)``).

The layer quantizes the gradient of its input with the recipe's grad-input
quantizer; the ``te.Linear`` that produced that input reads it as its dy
without quantizing again.  Formats whose grad-input and grad-output
quantization agree (FP8 current, FP8 blockwise, MXFP8) give the consumer's
GEMMs the bytes it would have made itself, so every result but the
consumer's bias gradient (summed from the dequantized dy, as in Transformer
Engine) is bit-identical to ``fp8_grad=False``.  Under DelayedScaling the
gradient carries the producer's grad-input scale (its own history column),
which follows the amaxes the consumer's grad-output column would record:
bit-identical results again.
Compiled runs equal eager, bit for bit, state included, in one graph.
tests/gpu runs the same under reduce-overhead.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.module.linear import compute as L
from transformer_engine_compile.module.linear.args import LinearFwdArgs, _grad_output_quantizer
from transformer_engine_compile.module.linear.ops import LINEAR_OPS

from test_linear import RECIPES, _reset

FP8_GRAD_RECIPES = {n: RECIPES[n] for n in ("fp8_current", "fp8_block", "mxfp8")}
DELAYED = recipe.DelayedScaling(amax_history_len=4)
ALL_FP8_GRAD = {**FP8_GRAD_RECIPES, "delayed": DELAYED}
WRAPPER = {"fp8_current": te.Float8Tensor, "fp8_block": te.Float8BlockwiseQTensor,
           "mxfp8": te.MXFP8Tensor}


class TwoLayers(torch.nn.Module):
    """x -> fc1 -> fc2; fc2's fp8_grad quantizes the gradient fc1 receives."""

    def __init__(self, device="cpu", fc1_bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = te.Linear(128, 256, bias=fc1_bias, params_dtype=torch.bfloat16, device=device)
        self.fc2 = te.Linear(256, 128, params_dtype=torch.bfloat16, device=device)

    def forward(self, x, rec, fp8_grad):
        with te.autocast(enabled=True, recipe=rec):  # inside the compiled region
            return self.fc2(self.fc1(x), fp8_grad=fp8_grad)


def run_steps(rec, fp8_grad, *, device="cpu", compile_kw=None, steps=2, fc1_bias=False,
              tokens=128):
    """Forward + backward ``steps`` times; returns per step
    [y, x.grad, grads..., buffers...] (buffers: DelayedScaling state)."""
    model = TwoLayers(device, fc1_bias)
    fn = model if compile_kw is None else torch.compile(model, fullgraph=True, **compile_kw)
    x0 = torch.randn(tokens, 128, dtype=torch.bfloat16, device=device)
    out = []
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.5 * i)).requires_grad_()
        y = fn(x, rec, fp8_grad)
        (y.float() * torch.linspace(-1, 1, 128, device=device)).sum().backward()
        out.append([y.detach().clone(), x.grad.clone()]
                   + [p.grad.clone() for p in model.parameters()]
                   + [b.detach().clone() for b in model.buffers()])
        model.zero_grad(set_to_none=True)  # CUDA graphs: never accumulate into .grad
    return out


def assert_steps_equal(want, got):
    assert len(want) == len(got)
    for i, (a_step, b_step) in enumerate(zip(want, got)):
        assert len(a_step) == len(b_step)
        for j, (a, b) in enumerate(zip(a_step, b_step)):
            assert torch.equal(a, b), f"step {i}: result {j} differs"


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_consumer_results_equal_without_fp8_grad(name):
    rec = FP8_GRAD_RECIPES[name]
    assert_steps_equal(run_steps(rec, False), run_steps(rec, True))


@pytest.mark.parametrize("name", ALL_FP8_GRAD)
def test_compiled_equals_eager_in_one_graph(name):
    _reset()
    rec = ALL_FP8_GRAD[name]
    steps = 22 if name == "delayed" else 2
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        got = run_steps(rec, True, compile_kw={"backend": "aot_eager"}, fc1_bias=True,
                        steps=steps)
    assert counters["stats"]["unique_graphs"] == 1
    assert_steps_equal(run_steps(rec, True, fc1_bias=True, steps=steps), got)


def test_delayed_scaling_results_equal_without_fp8_grad():
    """fc1's GEMMs read dy with fc2's grad-input scale instead of its own
    grad-output scale; both come from the same tensor's amax history, so
    outputs and gradients stay bit-identical step after step (the state
    differs: fc2 keeps the history column fc1 keeps without fp8_grad)."""
    want, got = run_steps(DELAYED, False, steps=6), run_steps(DELAYED, True, steps=6)
    n_results = 5  # y, x.grad, fc1.weight, fc2.weight, fc2.bias gradients
    assert_steps_equal([w[:n_results] for w in want], [g[:n_results] for g in got])


def _delayed_two_steps(fp8_grad):
    """Two steps of TwoLayers under DelayedScaling; returns the model, the
    gradient fc1's output received in step 2, and fc2's scale_bwd then."""
    model = TwoLayers()
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # in step 2 the scales are no longer 1
        with te.autocast(enabled=True, recipe=DELAYED):
            h = model.fc1(x)
            seen = []
            h.register_hook(seen.append)
            y = model.fc2(h, fp8_grad=fp8_grad)
        scale = model.fc2.fp8_scale_bwd.clone()
        y.float().sum().backward()
    return model, seen[0], scale


def test_delayed_scaling_producer_state_and_consumer_history():
    """fc2 quantizes its dgrad with scale_bwd[1] and records the dgrad's
    amax in history column 1: the amaxes fc1 records for its plain dy
    without fp8_grad.  fc1 reads the quantized dy as is and records the
    amax of its values in its own column 0."""
    plain, _, _ = _delayed_two_steps(False)
    model, dy, scale = _delayed_two_steps(True)
    assert isinstance(dy, te.Float8Tensor) and not torch.equal(scale[1], torch.ones(()))
    assert torch.equal(dy._scale_inv, torch.reciprocal(scale[1]).reshape(dy._scale_inv.shape))
    hist2, hist1 = model.fc2.fp8_amax_history_bwd, model.fc1.fp8_amax_history_bwd
    assert torch.equal(hist2[:, 1], plain.fc1.fp8_amax_history_bwd[:, 0])
    assert torch.equal(hist2[:, 0], plain.fc2.fp8_amax_history_bwd[:, 0])
    assert torch.equal(hist1[1, 0], dy.dequantize().abs().amax().float())
    assert torch.equal(hist1[:, 1], torch.zeros(4))  # fc1 made no quantized dgrad


def _count_quantize_calls(monkeypatch) -> list:
    """Record (shape, internal) of every tensor ``linear/ops.py`` quantizes
    through ``_quantize`` or as an input/weight pair (current scaling):
    internal for a layer's own operands, a wrapper (not internal) for the
    fp8_grad output."""
    from transformer_engine_compile.quantization.float8 import Float8CurrentScalingQuantizer as Q

    calls, original, pair = [], L._quantize, Q.quantize_pair_unchecked

    def spy(q, x, scales, slot, amaxes=None, step=None):
        calls.append((tuple(x.shape), q.internal))
        return original(q, x, scales, slot, amaxes, step)

    def pair_spy(q, x, other, w):
        calls.extend([(tuple(x.shape), q.internal), (tuple(w.shape), other.internal)])
        return pair(q, x, other, w)

    monkeypatch.setattr(L, "_quantize", spy)
    monkeypatch.setattr(Q, "quantize_pair_unchecked", pair_spy)
    return calls


@pytest.mark.parametrize("fp8_grad", [False, True])
def test_consumer_does_not_quantize_dy_again(monkeypatch, fp8_grad):
    """fc1's dy (128 x 256) is quantized once: by fc2's backward as its
    dgrad (a wrapper) with fp8_grad, else by fc1's backward (internal)."""
    model = TwoLayers()
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    y = model(x, FP8_GRAD_RECIPES["fp8_current"], fp8_grad)
    calls = _count_quantize_calls(monkeypatch)
    y.float().sum().backward()
    assert calls == [((128, 128), True), ((128, 256), not fp8_grad)]


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_input_gradient_is_the_quantized_dgrad(name):
    """A single layer's input gradient is a wrapper with both copies whose
    values are the quantized high-precision dgrad."""
    rec = FP8_GRAD_RECIPES[name]
    torch.manual_seed(0)
    layer = te.Linear(128, 256, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    grads = {}
    for fp8_grad in (False, True):
        x.grad = None
        with te.autocast(enabled=True, recipe=rec):
            y = layer(x, fp8_grad=fp8_grad)
        y.backward(dy)
        grads[fp8_grad] = x.grad
    g = grads[True]
    assert type(g) is WRAPPER[name]
    assert g.shape == x.shape and g.dtype == x.dtype
    assert g.get_usages() == {"rowwise": True, "columnwise": True}
    expected = te.quantizer_for(rec, "grad_input")(grads[False])
    assert list(g.buffers()) == list(expected.buffers())
    for (n, a), (_, b) in zip(g.buffers().items(), expected.buffers().items()):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), n


def _backward_seen_by_fc1(fc1_recipe, fc2_recipe, fc1_bias=False):
    """Run fc1 and fc2 (``fp8_grad=True``) under their recipes and backward;
    returns the model, x and the gradient fc1's output received."""
    model = TwoLayers(fc1_bias=fc1_bias)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=fc1_recipe):
        h = model.fc1(x)
    seen = []
    h.register_hook(seen.append)
    with te.autocast(enabled=True, recipe=fc2_recipe):
        y = model.fc2(h, fp8_grad=True)
    y.float().sum().backward()
    return model, x, seen[0]


def test_consumer_bias_gradient_sums_the_dequantized_dy(monkeypatch):
    current = FP8_GRAD_RECIPES["fp8_current"]
    calls = _count_quantize_calls(monkeypatch)
    model, _, dy = _backward_seen_by_fc1(current, current, fc1_bias=True)
    assert isinstance(dy, te.Float8Tensor)
    # forward: x, fc1's W, h, fc2's W; backward: fc2's dy and its dgrad (fc1's dy,
    # which fc1 reads as is)
    assert [shape for shape, _ in calls] == [(128, 128), (256, 128), (128, 256), (128, 256),
                                             (128, 128), (128, 256)]
    assert [internal for _, internal in calls[-2:]] == [True, False]
    assert torch.equal(model.fc1.bias.grad, dy.dequantize().sum(0))


def test_gradient_in_another_format_is_dequantized_first():
    """fc2 under MXFP8 sends fc1 (FP8 current scaling) an MXFP8 gradient:
    fc1 dequantizes it and quantizes its own dy, as for a plain gradient."""
    current = FP8_GRAD_RECIPES["fp8_current"]
    model, x, dy = _backward_seen_by_fc1(current, FP8_GRAD_RECIPES["mxfp8"])
    assert isinstance(dy, te.MXFP8Tensor)
    got = model.fc1.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with te.autocast(enabled=True, recipe=current):
        h = model.fc1(x)
    h.backward(dy.dequantize())
    assert torch.equal(model.fc1.weight.grad, got)


def test_gradient_missing_a_needed_copy_is_dequantized_first():
    """A rowwise-only quantized dy cannot feed wgrad: the layer requantizes it."""
    torch.manual_seed(0)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    rec = FP8_GRAD_RECIPES["fp8_current"]
    dy = te.quantizer_for(rec, "grad_output").with_usage(columnwise=False)(
        torch.randn(128, 128, dtype=torch.bfloat16))
    results = []
    for grad in (dy, dy.dequantize()):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with te.autocast(enabled=True, recipe=rec):
            y = layer(x)
        y.backward(grad)
        results.append((x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _fp8_grad_step(layer):
    def step(x):
        with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
            return layer(x, fp8_grad=True)
    return step


def test_graph_input_under_compile_falls_back():
    """AOTAutograd cannot return a quantized gradient for a graph input: the
    layer falls back to eager with a high-precision input gradient (a graph
    break, so fullgraph=True raises), for a leaf input and for one made by
    an earlier compiled graph."""
    _reset()
    torch.manual_seed(0)
    first = te.Linear(128, 128, params_dtype=torch.bfloat16)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    step = _fp8_grad_step(layer)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    _reset()
    with pytest.warns(RuntimeWarning, match="fp8_grad_graph_input"):
        torch.compile(step, backend="aot_eager")(x).float().sum().backward()
    assert layer.compile_fallbacks() == ("fp8_grad_graph_input",)
    got = x.grad
    x.grad = None
    with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
        layer(x).float().sum().backward()
    assert type(got) is torch.Tensor and torch.equal(got, x.grad)
    x.grad = None  # the input comes out of an earlier compiled graph
    h = torch.compile(first, backend="aot_eager")(x)
    torch.compile(step, backend="aot_eager")(h).float().sum().backward()
    assert type(x.grad) is torch.Tensor and x.grad.abs().sum() > 0
    # without a gradient for the input there is nothing to fall back for
    _reset()
    layer.zero_grad(set_to_none=True)
    x.requires_grad_(False)
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("rec, error, match", [
    (None, ValueError, "needs an active quantization recipe"),
    (RECIPES["nvfp4"], ValueError, "no FP8 gradient format under NVFP4"),
])
def test_unsupported_recipes_are_refused(rec, error, match):
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=rec is not None, recipe=rec):
        with pytest.raises(error, match=match):
            layer(x, fp8_grad=True)


def test_tensor_parallel_is_refused(monkeypatch):
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    monkeypatch.setattr(layer, "_tp_active", lambda: True)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
        with pytest.raises(NotImplementedError, match="fp8_grad=True with tensor parallel"):
            layer(x, fp8_grad=True)


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_ragged_token_count_with_fp8_grad(name):
    """200 tokens (no whole number of 128- or 32-row blocks): the quantized
    gradient carries the padded columnwise copy the consumer's wgrad reads,
    and results equal the plain path, eager and compiled."""
    rec = FP8_GRAD_RECIPES[name]
    want = run_steps(rec, False, tokens=200)
    assert_steps_equal(want, run_steps(rec, True, tokens=200))
    _reset()
    assert_steps_equal(want, run_steps(rec, True, tokens=200, compile_kw={"backend": "aot_eager"}))


def test_quantized_gradient_into_a_non_te_op_names_the_fix():
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
        y = layer(torch.nn.functional.gelu(x), fp8_grad=True)
    with pytest.raises(NotImplementedError, match="fp8_grad=True\\) can flow only into"):
        y.float().sum().backward()
