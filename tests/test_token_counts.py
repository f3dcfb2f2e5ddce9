"""Any token count in every recipe: the block formats pad the
rows of their columnwise copies inside the quantizer (``column_block``),
so a layer takes 1, 7, 200 or 4095 tokens, eager and compiled, in one
dynamic graph."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from conftest import STATELESS
from test_linear import RECIPES, _reset

# quantizers whose columnwise blocks run along the rows, with their block
ROW_BLOCKED = {"block_1d": 128, "block_1d_nopow2_e5m2": 128, "mxfp8_e4m3": 32,
               "mxfp8_e5m2": 32, "nvfp4": 16, "nvfp4_rht": 16}
ALL_RECIPES = {**RECIPES, "delayed": recipe.DelayedScaling(amax_history_len=4)}
# relative error of y = x W^T against the exact product, per recipe
TOLERANCE = {"bf16": 0.01, "fp8_current": 0.06, "fp8_block": 0.06, "mxfp8": 0.06,
             "nvfp4": 0.2, "delayed": 0.06}


def _buffers(t) -> dict:
    return dict(t.buffers())


@pytest.mark.parametrize("rows", [1, 7, 40, 200])
@pytest.mark.parametrize("name", sorted(ROW_BLOCKED))
def test_ragged_rows_quantize_as_the_zero_padded_matrix(name, rows):
    """The columnwise buffers are those of the matrix padded with zero rows
    (bit for bit), the rowwise ones those of its real rows; the declared
    layout (what the fakes build) matches; dequantize gives ``rows`` rows."""
    block = ROW_BLOCKED[name]
    padded_rows = -(-rows // block) * block
    torch.manual_seed(rows)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    xp = F.pad(x, (0, 0, 0, padded_rows - rows))
    q = STATELESS[name](True, True)
    t, tp = q.quantize(x), q.quantize(xp)
    got, want = _buffers(t), _buffers(tp)
    assert list(got) == list(want)
    for key, buf in got.items():
        ref = want[key]
        if key in type(t)._ROWS_LAST:  # FP8 blockwise 1D scales: (K/128, M)
            ref = ref[:, :rows]
        elif key in type(t)._ROW_BUFFERS:
            ref = ref[:rows]
        assert buf.shape == ref.shape and torch.equal(buf.view(torch.uint8), ref.view(torch.uint8)), key
    layout = {n: d.shape for n, d in q.describe_buffers((rows, 128)).items()}
    assert layout == {n: tuple(b.shape) for n, b in got.items()}
    for r, c in ((True, False), (False, True)):
        one = STATELESS[name](r, c).quantize(x).dequantize()
        assert one.shape == x.shape
        assert torch.equal(one, STATELESS[name](r, c).quantize(xp).dequantize()[:rows])


@pytest.mark.parametrize("name", sorted(ROW_BLOCKED))
def test_feature_dims_keep_the_format_rules(name):
    q = STATELESS[name](True, True)
    with pytest.raises(ValueError, match="needs the last dim divisible by"):
        q.quantize(torch.randn(7, 24))


def _layer_step(layer, rec):
    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x)
    return step


def _run(step, layer, x, dy, mark_dynamic=False):
    x = x.detach().clone().requires_grad_()
    if mark_dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    torch.manual_seed(5)  # NVFP4's stochastic rounding of gradients
    y = step(x)
    y.backward(dy)
    out = [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
    layer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("tokens", [1, 7, 64, 200, 1000])
@pytest.mark.parametrize("name", sorted(ALL_RECIPES))
def test_any_token_count_eager_compiled_and_within_the_format_error(name, tokens):
    """Shapes as the caller's, the output within the format's error of the
    exact product, padding rows adding nothing to wgrad (equal to the
    gradients of the same rows followed by zero rows), compiled == eager."""
    rec = ALL_RECIPES[name]
    _reset()
    torch.manual_seed(0)
    layer = te.Linear(256, 128)
    x = torch.randn(tokens, 256)
    dy = torch.randn(tokens, 128)
    step = _layer_step(layer, rec)
    y, dx, dw, db = _run(step, layer, x, dy)
    assert y.shape == (tokens, 128) and dx.shape == x.shape
    exact = x @ layer.weight.detach().t() + layer.bias.detach()
    assert ((y - exact).norm() / exact.norm()).item() < TOLERANCE[name]
    if name in ("fp8_block", "mxfp8"):  # the padded recipes without stochastic rounding
        pad = -(-tokens // 128) * 128 - tokens
        yp, dxp, dwp, dbp = _run(step, layer, F.pad(x, (0, 0, 0, pad)), F.pad(dy, (0, 0, 0, pad)))
        # the same products, the GEMMs' blocking over rows aside
        for a, b in ((yp[:tokens], y), (dxp[:tokens], dx), (dwp, dw), (dbp, db)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.manual_seed(0)
    fresh, layer2 = te.Linear(256, 128), te.Linear(256, 128)
    layer2.load_state_dict(fresh.state_dict())
    compiled = torch.compile(_layer_step(layer2, rec), fullgraph=True, backend="aot_eager")
    for a, b in zip(_run(_layer_step(fresh, rec), fresh, x, dy), _run(compiled, layer2, x, dy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
@pytest.mark.parametrize("name", sorted(ALL_RECIPES))
def test_one_dynamic_graph_serves_every_token_count(name, how):
    """Counts below one block, multiples and ragged counts share one graph
    (no guard on the number of row blocks) and equal eager bit for bit."""
    rec = ALL_RECIPES[name]
    _reset()
    torch.manual_seed(0)
    layer, ref_layer = te.Linear(256, 128), te.Linear(256, 128)
    ref_layer.load_state_dict(layer.state_dict())
    kw = {"dynamic": True} if how == "dynamic" else {}
    compiled = torch.compile(_layer_step(layer, rec), fullgraph=True, backend="aot_eager", **kw)
    eager = _layer_step(ref_layer, rec)
    for tokens in (7, 64, 200, 128, 1000, 2):
        x, dy = torch.randn(tokens, 256), torch.randn(tokens, 128)
        got = _run(compiled, layer, x, dy, mark_dynamic=how == "mark_dynamic")
        for a, b in zip(_run(eager, ref_layer, x, dy), got):
            assert torch.equal(a, b), tokens
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_ragged_tokens_of_a_3d_input_and_under_inductor():
    """(batch, seq, hidden) with seq * batch not a multiple of any block, inductor."""
    _reset()
    rec = RECIPES["mxfp8"]
    torch.manual_seed(0)
    layer = te.Linear(256, 128, params_dtype=torch.bfloat16)
    x = torch.randn(3, 67, 256, dtype=torch.bfloat16)
    dy = torch.randn(3, 67, 128, dtype=torch.bfloat16)
    step = _layer_step(layer, rec)
    want = _run(step, layer, x, dy)
    got = _run(torch.compile(step, fullgraph=True, backend="inductor"), layer, x, dy)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
