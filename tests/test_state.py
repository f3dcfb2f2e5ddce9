"""Layer state through the ops: FP8 weight caching, DelayedScaling, main_grad.

Compiled (fullgraph) against eager, bit for bit, step by step, including the
state itself (module buffers, ``weight.main_grad``), with graph counts.  The
same helpers run on CUDA under ``mode="reduce-overhead"`` (tests/gpu).
"""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.dynamo import arg_plan, updates as op_updates
from transformer_engine_compile.kernels import reference as ref

from test_linear import RECIPES, _reset

QUANTIZED = {"delayed": recipe.DelayedScaling(amax_history_len=4),
             **{n: r for n, r in RECIPES.items() if r is not None}}


def _layer(device, fuse=False, seed=0):
    torch.manual_seed(seed)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16, device=device,
                      fuse_wgrad_accumulation=fuse)
    if fuse:
        layer.weight.main_grad = torch.zeros(128, 128, device=device)
    return layer


def _pair(device, fuse=False):
    """Two identical layers: one for eager, one for compiled."""
    a, b = _layer(device, fuse), _layer(device, fuse)
    assert torch.equal(a.weight, b.weight)
    return a, b


def _step_fn(rec, **kw):
    def step(layer, x, first):
        with te.autocast(enabled=rec is not None, recipe=rec):  # inside the compiled region
            return layer(x, is_first_microbatch=first, **kw)
    return step


def _state(layer) -> dict:
    """Every buffer (bytes, float8 included) and main_grad, cloned."""
    out = {n: b.detach().view(torch.uint8).clone() if b.dtype.itemsize == 1 else b.detach().clone()
           for n, b in layer.named_buffers()}
    if getattr(layer.weight, "main_grad", None) is not None:
        out["main_grad"] = layer.weight.main_grad.clone()
    return out


def _microbatch(layer, step, x0, first, i):
    torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
    torch.manual_seed(100 + i)  # NVFP4 stochastic rounding
    x = (x0 * (1 + 0.1 * i)).requires_grad_()
    y = step(layer, x, first)
    (y.float() * torch.linspace(-1, 1, 128, device=y.device)).sum().backward()
    grads = [x.grad] + [None if p.grad is None else p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)  # CUDA graphs: never accumulate into .grad
    return [y.detach().clone()] + grads


def run_compare(rec, firsts, *, device="cpu", fuse=False, backend="aot_eager", mode=None,
                update_weight=True):
    """Eager and compiled microbatches with the same ``is_first_microbatch``
    sequence; asserts every output, gradient and state tensor equal after each."""
    _reset()
    eager_layer, comp_layer = _pair(device, fuse)
    step = _step_fn(rec)
    compiled = torch.compile(step, fullgraph=True, backend=backend, mode=mode)
    x0 = torch.randn(128, 128, dtype=torch.bfloat16, device=device)  # blockwise: 128 rows
    for i, first in enumerate(firsts):
        got = _microbatch(comp_layer, compiled, x0, first, i)
        want = _microbatch(eager_layer, step, x0, first, i)
        for name, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), want, got):
            assert (a is None) == (b is None), (i, name)
            assert a is None or torch.equal(a, b), f"microbatch {i}: {name} differs"
        ws, cs = _state(eager_layer), _state(comp_layer)
        assert ws.keys() == cs.keys()
        for name in ws:
            assert torch.equal(ws[name], cs[name]), f"microbatch {i}: {name} differs"
        if update_weight:  # an optimizer step: a cached weight must not see it
            with torch.no_grad():
                for layer in (eager_layer, comp_layer):
                    layer.weight.mul_(1.0625)
    assert sum(counters["graph_break"].values()) == 0
    return eager_layer, comp_layer


# -- FP8 weight caching ------------------------------------------------------------------
FIRSTS = (True, False, False, True, False)


@pytest.mark.parametrize("name", QUANTIZED)
def test_weight_caching_compiled_equals_eager(name):
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        _, layer = run_compare(QUANTIZED[name], FIRSTS)
    assert counters["stats"]["unique_graphs"] == 2  # one per is_first_microbatch value
    assert any(n.startswith("fp8_weight_") for n, _ in layer.named_buffers())


def test_cached_weight_is_reused_until_the_next_first_microbatch():
    _reset()
    layer = _layer("cpu")
    step = torch.compile(_step_fn(RECIPES["fp8_current"]), fullgraph=True, backend="aot_eager")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        first = step(layer, x, True)
        layer.weight.mul_(2)
        reused = step(layer, x, False)
        fresh = step(layer, x, True)
    assert torch.equal(first, reused)          # the cached (old) weight
    assert not torch.equal(fresh, first)       # re-quantized from the doubled weight
    assert torch.equal(step(layer, x, False), fresh)


def test_reuse_without_a_cached_weight_is_an_error():
    layer = _layer("cpu")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with te.autocast(recipe=RECIPES["mxfp8"]), pytest.raises(ValueError, match="no"):
        layer(x, is_first_microbatch=False)
    _reset()
    step = torch.compile(_step_fn(RECIPES["mxfp8"]), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="is_first_microbatch=False reuses"):
        step(_layer("cpu"), x, False)


def test_weight_cache_state_is_module_buffers_written_in_the_graph():
    """The cached weight is a module buffer, mutated by a visible copy_."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    _reset()
    layer = _layer("cpu")
    backend = AotEagerAndRecordGraphs()
    step = torch.compile(_step_fn(RECIPES["fp8_current"]), fullgraph=True, backend=backend)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    step(layer, x, True).sum().backward()
    fwd = backend.fw_graphs[0].code
    # three buffers written in place: data, transpose, scale_inv
    assert "te_compile.linear_fwd" in fwd and fwd.count("aten.copy_.default(primals_") == 3
    assert {"fp8_weight_data", "fp8_weight_transpose",
            "fp8_weight_scale_inv"} <= dict(layer.named_buffers()).keys()


# -- DelayedScaling --------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_20_steps_compiled_equals_eager(algo):
    rec = recipe.DelayedScaling(amax_history_len=8, amax_compute_algo=algo, margin=1)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        eager, _ = run_compare(rec, (None,) * 22)
    assert counters["stats"]["unique_graphs"] == 1
    # the scales moved off their initial 1.0: the state is live
    assert not torch.equal(eager.fp8_scale_fwd, torch.ones(2))
    assert not torch.equal(eager.fp8_scale_bwd[0], torch.ones(()))


def test_delayed_scaling_update_follows_the_recipe():
    """After one step: row 1 of the history holds this step's amaxes and the
    scale is fp8_max / amax / 2^margin (E4M3 forward, E5M2 backward)."""
    layer = _layer("cpu")
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=3, margin=1)):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    amaxes = torch.stack([x.detach().abs().amax().float(), layer.weight.detach().abs().amax().float()])
    assert torch.equal(layer.fp8_amax_history_fwd[1], amaxes)
    assert torch.equal(layer.fp8_amax_history_fwd[0], torch.zeros(2))
    assert torch.equal(layer.fp8_scale_fwd, ref.compute_scale(amaxes, 448.0, 1))
    # columns grad_output, grad_input (zero amax, scale 1: no fp8_grad here)
    dy_amax = torch.stack([dy.abs().amax().float(), torch.zeros(())])
    assert torch.equal(layer.fp8_amax_history_bwd[1], dy_amax)
    assert torch.equal(layer.fp8_scale_bwd, ref.compute_scale(dy_amax, 57344.0, 1))


def test_delayed_scaling_first_step_uses_scale_one():
    """Step 1 quantizes with the initial scale 1 (no history yet), as TE does."""
    layer = _layer("cpu")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=recipe.DelayedScaling()):
        y = layer(x)
    q = te.Float8DelayedScalingQuantizer("e4m3")
    expect = (q.quantize_with_scale(x, torch.ones(1)).dequantize().float()
              @ q.quantize_with_scale(layer.weight, torch.ones(1)).dequantize().float().t())
    expect = expect + layer.bias.float()
    assert torch.equal(y, expect.to(torch.bfloat16))


def test_eager_delayed_step_writes_the_buffers_itself(monkeypatch):
    """Eager calls run the impls, not the ops, and the delayed-scaling step
    writes the layer's amax histories and scales itself: no update output
    is copied into them (two copies per op call before).  The op itself
    stays functional (compiled: the updates are written after the op), and
    the state equals the eager one."""
    writes = []
    real_write = op_updates._write

    def spy(dst, new, how, where, detach=False):
        writes.append(where)
        return real_write(dst, new, how, where, detach)

    monkeypatch.setattr(op_updates, "_write", spy)
    rec = recipe.DelayedScaling(amax_history_len=3)
    eager, compiled = _pair("cpu")
    step = _step_fn(rec)
    cstep = torch.compile(step, backend="aot_eager", fullgraph=True)
    x0 = torch.randn(32, 128, dtype=torch.bfloat16)
    for i in range(3):
        _microbatch(eager, step, x0, None, i)
    assert writes == []
    for i in range(3):
        _microbatch(compiled, cstep, x0, None, i)
    assert any("amax_history_fwd" in w for w in writes)  # the forward op's, traced
    assert _state(eager).keys() == _state(compiled).keys()
    for name, value in _state(eager).items():
        assert torch.equal(value, _state(compiled)[name]), name


def test_delayed_scaling_refuses_what_it_cannot_do():
    # (tensor parallelism works: tests/test_tp.py::test_tp_delayed_scaling)
    layer = te.Linear(128, 128, save_original_input=True)
    with te.autocast(recipe=recipe.DelayedScaling()), pytest.raises(ValueError, match="save_ori"):
        layer(torch.randn(64, 128, requires_grad=True))
    with torch.no_grad(), te.autocast(recipe=recipe.DelayedScaling()), \
            pytest.raises(NotImplementedError, match="fp8_output=True under DelayedScaling"):
        layer(torch.randn(64, 128), fp8_output=True)
    with pytest.raises(RuntimeError, match="quantize_with_scale"):
        te.Float8DelayedScalingQuantizer().quantize(torch.randn(4, 4))


def test_delayed_scaling_history_length_change_reallocates():
    layer = _layer("cpu")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        for n in (4, 16):
            with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=n)):
                layer(x)
            assert layer.fp8_amax_history_fwd.shape == (n, 2)


# -- fuse_wgrad_accumulation -------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "delayed", "mxfp8"])
def test_main_grad_accumulates_in_place_compiled_equals_eager(name):
    rec = QUANTIZED.get(name)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        eager, comp = run_compare(rec, (None,) * 4, fuse=True)
    assert counters["stats"]["unique_graphs"] == 1
    assert comp.weight.grad is None and comp.weight.main_grad.dtype == torch.float32
    assert comp.weight.main_grad.abs().sum() > 0


def test_main_grad_is_the_same_tensor_and_sums_microbatches():
    _reset()
    layer = _layer("cpu", fuse=True)
    main_grad = layer.weight.main_grad
    step = torch.compile(_step_fn(None), fullgraph=True, backend="aot_eager")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    total = torch.zeros(128, 128)
    for i in range(3):
        xi = x * (i + 1)
        step(layer, xi, None).float().sum().backward()
        total += (torch.ones(64, 128, dtype=torch.bfloat16).t().float() @ xi.float())
    assert layer.weight.main_grad is main_grad
    torch.testing.assert_close(main_grad, total, rtol=0, atol=1e-3)


def test_main_grad_with_weight_caching_and_delayed_scaling_together():
    rec = recipe.DelayedScaling(amax_history_len=4)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        run_compare(rec, FIRSTS, fuse=True)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name", ["fp8_current", "delayed"])
def test_state_under_inductor(name):
    run_compare(QUANTIZED[name], (True, False, True), fuse=True, backend="inductor")


# -- the generator's update mechanism ----------------------------------------------------
def test_update_declarations_are_checked():
    from transformer_engine_compile.module.linear import LinearFwdArgs

    plan = arg_plan.ArgPlan(LinearFwdArgs)
    with pytest.raises(TypeError, match="not a tensor field"):
        op_updates._check_updates({"x": "tp_size"}, plan, "forward_updates")
    with pytest.raises(TypeError, match="'copy' or 'add'"):
        op_updates._check_updates({"x": ("main_grad", "mul")}, plan, "forward_updates")


def test_apply_updates_copies_adds_and_refuses_bad_targets():
    class Args:
        a = torch.zeros(3)
        b = torch.ones(3)
        c = None

    updates = {"x": op_updates.Update("a"), "y": op_updates.Update("b", "add"),
               "z": op_updates.Update("c")}
    rest = op_updates.apply_updates(updates, Args, {"x": torch.full((3,), 2.0),
                                                   "y": torch.full((3,), 2.0), "out": 1})
    assert rest == {"out": 1}
    assert torch.equal(Args.a, torch.full((3,), 2.0)) and torch.equal(Args.b, torch.full((3,), 3.0))
    with pytest.raises(RuntimeError, match="no target"):
        op_updates.apply_updates(updates, Args, {"z": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="shape"):
        op_updates.apply_updates(updates, Args, {"x": torch.zeros(4)})
