"""Quantized dgrad output (``te.Linear(..., fp8_grad=True)``).

The layer quantizes the gradient of its input with the recipe's grad-input
quantizer; the ``te.Linear`` that produced that input reads it as its dy
without quantizing again.  Formats whose grad-input and grad-output
quantization agree (FP8 current, FP8 blockwise, MXFP8) give the consumer's
GEMMs the bytes it would have made itself, so every result but the
consumer's bias gradient (summed from the dequantized dy, as in Transformer
Engine) is bit-identical to ``fp8_grad=False``.  Compiled runs equal eager,
bit for bit, in one graph.  tests/gpu runs the same under reduce-overhead.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.module import linear as L

from test_linear import RECIPES, _reset

FP8_GRAD_RECIPES = {n: RECIPES[n] for n in ("fp8_current", "fp8_block", "mxfp8")}
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


def run_steps(rec, fp8_grad, *, device="cpu", compile_kw=None, steps=2, fc1_bias=False):
    """Forward + backward ``steps`` times; returns per step [y, x.grad, grads...]."""
    model = TwoLayers(device, fc1_bias)
    fn = model if compile_kw is None else torch.compile(model, fullgraph=True, **compile_kw)
    x0 = torch.randn(128, 128, dtype=torch.bfloat16, device=device)
    out = []
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.5 * i)).requires_grad_()
        y = fn(x, rec, fp8_grad)
        (y.float() * torch.linspace(-1, 1, 128, device=device)).sum().backward()
        out.append([y.detach().clone(), x.grad.clone()]
                   + [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)  # CUDA graphs: never accumulate into .grad
    return out


def assert_steps_equal(want, got, skip=()):
    for i, (a_step, b_step) in enumerate(zip(want, got)):
        for j, (a, b) in enumerate(zip(a_step, b_step)):
            if j not in skip:
                assert torch.equal(a, b), f"step {i}: result {j} differs"


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_consumer_results_equal_without_fp8_grad(name):
    rec = FP8_GRAD_RECIPES[name]
    assert_steps_equal(run_steps(rec, False), run_steps(rec, True))


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_compiled_equals_eager_in_one_graph(name):
    _reset()
    rec = FP8_GRAD_RECIPES[name]
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        got = run_steps(rec, True, compile_kw={"backend": "aot_eager"}, fc1_bias=True)
    assert counters["stats"]["unique_graphs"] == 1
    assert_steps_equal(run_steps(rec, True, fc1_bias=True), got)


def test_compiled_equals_eager_inductor():
    _reset()
    rec = FP8_GRAD_RECIPES["fp8_current"]
    got = run_steps(rec, True, compile_kw={"backend": "inductor"}, fc1_bias=True)
    assert_steps_equal(run_steps(rec, True, fc1_bias=True), got)


def _count_quantize_calls(monkeypatch) -> list:
    """Record the shape of every tensor ``linear.py`` quantizes through ``_quantize``."""
    calls, original = [], L._quantize

    def spy(q, x, scales, slot):
        calls.append(tuple(x.shape))
        return original(q, x, scales, slot)

    monkeypatch.setattr(L, "_quantize", spy)
    return calls


@pytest.mark.parametrize("fp8_grad", [False, True])
def test_consumer_does_not_quantize_dy_again(monkeypatch, fp8_grad):
    """fc1's dy (128 x 256) is quantized by fc2's backward (as its dgrad),
    never again by fc1's: the one quantization left is fc2's own dy."""
    model = TwoLayers()
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    y = model(x, FP8_GRAD_RECIPES["fp8_current"], fp8_grad)
    calls = _count_quantize_calls(monkeypatch)
    y.float().sum().backward()
    assert calls == ([(128, 128)] if fp8_grad else [(128, 128), (128, 256)])


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
    # forward: x, fc1's W, h, fc2's W; backward: fc2's dy only (fc1 reads its dy as is)
    assert calls == [(128, 128), (256, 128), (128, 256), (128, 256), (128, 128)]
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


def test_graph_input_under_compile_is_refused():
    """AOTAutograd cannot return a quantized gradient for a graph input."""
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)

    def step(x):
        with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
            return layer(x, fp8_grad=True)

    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(Exception, match="fp8_grad=True under torch.compile needs the input "
                                        "produced inside"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    # without a gradient for the input there is nothing to refuse
    x.requires_grad_(False)
    torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("rec, error, match", [
    (None, ValueError, "needs an active quantization recipe"),
    (recipe.DelayedScaling(), NotImplementedError, "under DelayedScaling"),
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


def test_sizes_the_gradient_format_cannot_take_are_refused():
    """MXFP8's columnwise copy needs 32-row blocks: 48 tokens fit the
    forward (rowwise only without weight gradient) but not the gradient."""
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(48, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["mxfp8"]):
        layer(x)  # fits without fp8_grad
        with pytest.raises(ValueError, match=r"gradient of the input \(fp8_grad\)"):
            layer(x, fp8_grad=True)


def test_quantized_gradient_into_a_non_te_op_names_the_fix():
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=FP8_GRAD_RECIPES["fp8_current"]):
        y = layer(torch.nn.functional.gelu(x), fp8_grad=True)
    with pytest.raises(NotImplementedError, match="fp8_grad=True\\) can flow only into"):
        y.float().sum().backward()
