"""te.GroupedLinear (mixture-of-experts layer) on CPU, bf16 and the recipes:
numerics against a per-expert loop, the generated ops (opcheck), compiled
against eager, routing that changes every step without recompiling, and
the argument checks."""

import copy
import io

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.module.grouped import GROUPED_LINEAR_OPS as OPS
from transformer_engine_compile.module.grouped import GroupedLinearFwdArgs
from transformer_engine_compile.module.grouped.compute import (grouped_linear_forward,
                                                                grouped_linear_setup_context)

E, IN, OUT = 4, 64, 32


def _layer(bias=True, seed=0):
    torch.manual_seed(seed)
    layer = te.GroupedLinear(E, IN, OUT, bias=bias, params_dtype=torch.bfloat16)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    return layer


def _loop(layer, x, sizes, dy):
    """Output and gradients of one plain linear per expert, in bf16."""
    x = x.detach().requires_grad_()
    w = layer.weight.detach().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().requires_grad_()
    outs, start = [], 0
    for g, m in enumerate(sizes):
        y = x[start:start + m] @ w[g].t()
        outs.append(y if b is None else y + b[g])
        start += m
    y = torch.cat(outs)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


def _run(layer, x, routing, dy, step=None):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = (layer if step is None else step)(x, routing)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def _data(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(sizes)
    x = torch.randn(tokens, IN, generator=g).to(torch.bfloat16)
    dy = torch.randn(tokens, OUT, generator=g).to(torch.bfloat16)
    return x, dy


SIZES = [(5, 0, 11, 16), (0, 0, 0, 8), (8, 8, 8, 8)]


@pytest.mark.parametrize("sizes", SIZES, ids=["ragged", "one-expert", "even"])
@pytest.mark.parametrize("form", ["list", "tensor"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_a_loop_over_experts(sizes, form, bias):
    layer = _layer(bias)
    x, dy = _data(sizes)
    routing = list(sizes) if form == "list" else torch.tensor(sizes)
    y, dx, dw, db = _run(layer, x, routing, dy)
    ry, rdx, rdw, rdb = _loop(layer, x, sizes, dy)
    torch.testing.assert_close(y, ry, rtol=0, atol=0)
    torch.testing.assert_close(dx, rdx, rtol=0, atol=0)
    torch.testing.assert_close(dw, rdw, rtol=0, atol=0)
    empty = [g for g, m in enumerate(sizes) if m == 0]
    assert all(dw[g].count_nonzero() == 0 for g in empty)
    if bias:  # a GEMM against ones: fp32 sums, rounded once
        torch.testing.assert_close(db, rdb, rtol=1e-2, atol=1e-2)
        assert all(db[g].count_nonzero() == 0 for g in empty)


def test_offsets_and_leading_dims():
    layer = _layer()
    sizes = (3, 5, 0, 8)
    x, dy = _data(sizes)
    ref = layer(x, list(sizes))
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    torch.testing.assert_close(layer(x, m_offsets=ends), ref, rtol=0, atol=0)
    torch.testing.assert_close(layer(x, m_offsets=ends.tolist()), ref, rtol=0, atol=0)
    y3 = layer(x.view(2, 8, IN), list(sizes))
    assert y3.shape == (2, 8, OUT)
    torch.testing.assert_close(y3.view(16, OUT), ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager_and_routing_changes_without_recompiling(backend):
    torch._dynamo.reset()
    layer, compiled_layer = _layer(), _layer()
    compiled_layer.load_state_dict(layer.state_dict())
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import nop
        return aot_autograd(fw_compiler=nop, bw_compiler=nop)(gm, example_inputs)

    step = torch.compile(compiled_layer, fullgraph=True, backend=counting)
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        sizes = torch.randint(0, 9, (E,), generator=g)
        sizes[i % E] = 0  # an expert without tokens every step
        sizes[(i + 1) % E] += 1
        x, dy = _data(sizes.tolist(), seed=10 + i)
        eager = _run(layer, x, sizes, dy)
        compiled = _run(compiled_layer, x, sizes, dy, step)
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    # a recompile once the token count turns dynamic, none for the routing
    assert len(compiles) <= 2, len(compiles)


def test_an_expanded_gradient_is_taken():
    layer = _layer()
    sizes = (5, 0, 11, 16)
    x, _ = _data(sizes)
    layer(x.requires_grad_(), list(sizes)).sum().backward()  # dy: ones with zero strides
    ones = torch.ones(32, OUT, dtype=torch.bfloat16)
    ref = _loop(layer, x, sizes, ones)
    torch.testing.assert_close(x.grad, ref[1], rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, ref[2], rtol=0, atol=0)


def test_opcheck_forward_and_backward_ops():
    sizes = (5, 0, 11, 16)
    x, dy = _data(sizes)
    layer = _layer()
    args = GroupedLinearFwdArgs(
        inp=x.requires_grad_(), weight=layer.weight.detach(),
        m_offsets=torch.tensor(sizes).cumsum(0).to(torch.int32), bias=layer.bias.detach(),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=True)
    torch.library.opcheck(OPS.fwd_op, tuple(OPS.fwd_plan.encode(args)))
    real = grouped_linear_forward(args)
    args.inp.requires_grad_(False)
    bwd = OPS.make_bwd_args(real.saved, grouped_linear_setup_context(args), {"grad_output": dy})
    torch.library.opcheck(OPS.bwd_op, tuple(OPS.bwd_plan.encode(bwd)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_routing_is_refused(compiled):
    """Before any kernel, eager and compiled (where fullgraph=True's Dynamo
    wraps a raised error in Unsupported, the message intact)."""
    torch._dynamo.reset()
    layer = _layer()
    call = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    x, _ = _data((4, 4, 4, 4))

    def raises(exc, match):
        return pytest.raises(torch._dynamo.exc.Unsupported if compiled else exc, match=match)

    with raises(ValueError, "sum to 15, the input has 16 rows"):
        call(x, [4, 4, 4, 3])
    with raises(ValueError, "must not be negative"):
        call(x, [8, -4, 8, 4])
    with raises(ValueError, "one entry per expert"):
        call(x, [8, 8])
    with raises(ValueError, "one entry per expert"):
        call(x, torch.tensor([8, 8]))
    with raises(TypeError, "integer tensor"):
        call(x, torch.tensor([4.0, 4.0, 4.0, 4.0]))
    with pytest.raises(RuntimeError, match="m_splits must be non-negative counts"):
        call(x, torch.tensor([4, 4, 4, 3]))  # checked on the device
    with pytest.raises(RuntimeError, match="m_splits must be non-negative counts"):
        call(x, torch.tensor([12, -4, 4, 4]))
    with raises(ValueError, "in_features=64"):
        call(torch.zeros(16, 32, dtype=torch.bfloat16), [4, 4, 4, 4])
    with pytest.raises(TypeError, match="exactly one of m_splits and m_offsets"):
        layer(x, [4, 4, 4, 4], m_offsets=[4, 8, 12, 16])
    with pytest.raises(ValueError, match="non-decreasing"):
        layer(x, m_offsets=[4, 2, 12, 16])
    # Transformer Engine's weight caching flag: nothing to cache without a
    # recipe (test_grouped_weight_cache.py has the FP8 cases)
    for first in (True, False, None):
        assert torch.equal(call(x, [4, 4, 4, 4], first), layer(x, [4, 4, 4, 4]))


# -- FP8 current scaling: a te.Linear per expert, bit for bit (CPU reference) --------------
def _fp8_loop(layer, x, sizes, dy, rec):
    """te.Linear per expert (its reference path) on each expert's rows."""
    outs, grads_x, start = [], [], 0
    dw, db = torch.zeros_like(layer.weight), torch.zeros_like(layer.bias)
    for g, m in enumerate(sizes):
        lin = te.Linear(layer.in_features, layer.out_features, params_dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(layer.weight[g])
            lin.bias.copy_(layer.bias[g])
        xg = x[start:start + m].detach().requires_grad_()
        with te.autocast(recipe=rec):
            y = lin(xg)
        y.backward(dy[start:start + m])
        outs.append(y)
        grads_x.append(xg.grad)
        dw[g], db[g] = lin.weight.grad, lin.bias.grad
        start += m
    return torch.cat(outs), torch.cat(grads_x), dw, db


def _assert_matches_te_linear_per_expert(layer, x, sizes, dy, rec):
    """Output, dx and dW bit for bit those of a te.Linear per expert (the bias
    gradient within a sum's rounding), and not the bf16 result."""
    with te.autocast(recipe=rec):
        y, dx, dw, db = _run(layer, x, torch.tensor(sizes), dy)
    ry, rdx, rdw, rdb = _fp8_loop(layer, x, sizes, dy, rec)
    torch.testing.assert_close(y, ry, rtol=0, atol=0)
    torch.testing.assert_close(dx, rdx, rtol=0, atol=0)
    torch.testing.assert_close(dw, rdw, rtol=0, atol=0)
    torch.testing.assert_close(db, rdb, rtol=1e-2, atol=1e-2)
    assert not torch.equal(y, _run(layer, x, list(sizes), dy)[0])  # the rounding shows


@pytest.mark.parametrize("sizes", [(5, 0, 11, 16), (8, 8, 8, 8)], ids=["ragged", "even"])
def test_fp8_current_matches_a_te_linear_per_expert(sizes):
    rec = te.recipe.Float8CurrentScaling()
    layer = _layer()
    x, dy = _data(sizes)
    x = x * torch.arange(1, x.shape[0] + 1).unsqueeze(1)  # scales that differ by expert
    _assert_matches_te_linear_per_expert(layer, x, sizes, dy, rec)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_current_compiled_equals_eager(backend):
    torch._dynamo.reset()
    rec = te.recipe.Float8CurrentScaling()
    layer = _layer()
    step = torch.compile(layer, fullgraph=True, backend=backend)
    for seed, sizes in enumerate([(5, 0, 11, 16), (3, 9, 2, 18)]):
        x, dy = _data(sizes, seed=20 + seed)
        with te.autocast(recipe=rec):
            eager = _run(layer, x, torch.tensor(sizes), dy)
            compiled = _run(layer, x, torch.tensor(sizes), dy, step)
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def _opcheck_both_ops(rec, layer, sizes, x, dy, save_original_weight=False, **fields):
    """opcheck of the forward op and of the backward op on the forward's
    saved tensors (``fields``: more forward arguments); returns the saved x."""
    return opcheck_grouped_ops(rec, layer, sizes, x, dy, save_original_weight=save_original_weight,
                               **fields)[0].saved["inputmat"]


def opcheck_grouped_ops(rec, layer, sizes, x, dy, **fields):
    """:func:`_opcheck_both_ops`, returning the forward's real result and
    its arguments."""
    from test_linear_ops import opcheck

    q = {f"{role}_quantizer": te.quantizer_for(rec, role, internal=True)
         for role in ("input", "weight", "grad_output")}
    args = GroupedLinearFwdArgs(
        inp=x.requires_grad_(), weight=layer.weight.detach(),
        m_offsets=torch.tensor(sizes).cumsum(0).to(torch.int32), bias=layer.bias.detach(),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=True,
        **fields, **q)
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), True)
    with torch.no_grad():  # as the op runs its impl
        real = grouped_linear_forward(args)
    args.inp.requires_grad_(False)
    bwd = OPS.make_bwd_args(real.saved, grouped_linear_setup_context(args), {"grad_output": dy})
    opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), True)
    return real, args


@pytest.mark.parametrize("save_original_weight", [False, True])
def test_fp8_opcheck_forward_and_backward_ops(save_original_weight):
    sizes = (5, 0, 11, 16)
    x, dy = _data(sizes)
    saved = _opcheck_both_ops(te.recipe.Float8CurrentScaling(), _layer(), sizes, x, dy,
                              save_original_weight)
    assert saved.dtype == torch.float8_e4m3fn  # the backward keeps FP8


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("name", ["fp8_current", "delayed", "fp8_block"])
def test_saved_original_weight_requantized_bit_for_bit(name, compiled):
    """``save_original_weight`` (te.fsdp.fully_shard's high-precision
    gather): under current scaling the forward keeps W itself, not its
    transposed FP8 copy, and the backward quantizes it again, with outputs
    and gradients bit for bit the kept copy's; DelayedScaling keeps its
    copy, the block-scaled recipes keep W itself either way."""
    rec = {"fp8_current": te.recipe.Float8CurrentScaling(),
           "delayed": te.recipe.DelayedScaling(),
           "fp8_block": te.recipe.Float8BlockScaling()}[name]
    sizes = (5, 0, 11, 16) if name != "fp8_block" else (128, 0, 128, 256)
    runs = []
    for sow in (False, True):
        torch._dynamo.reset()
        layer = _layer() if name != "fp8_block" else _wide_layer()
        layer.save_original_weight = sow
        x, dy = _data(sizes) if name != "fp8_block" else _wide_data(sizes)
        f = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with te.autocast(recipe=rec):
                run = _run(layer, x, torch.tensor(sizes), dy, f)
        runs.append(run)
        fp8_w = [t for t in saved if t.dtype == torch.float8_e4m3fn and t.dim() == 3]
        kept = sow is False and name != "fp8_block"
        assert len(fp8_w) == (1 if kept or name == "delayed" else 0), (sow, len(fp8_w))
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_cuda_operand_rules_are_checked_before_any_kernel():
    from transformer_engine_compile.module.grouped.layer import _check_cuda_operands

    _check_cuda_operands(torch.bfloat16, 64, 32)
    with pytest.raises(TypeError, match="takes bfloat16, got torch.float32"):
        _check_cuda_operands(torch.float32, 64, 32)
    with pytest.raises(ValueError, match="divisible by 8.*in_features=60, out_features=30"):
        _check_cuda_operands(torch.bfloat16, 60, 30)
    _check_cuda_operands(torch.bfloat16, 64, 32, fp8=True)
    with pytest.raises(ValueError, match="FP8 grouped GEMM needs feature sizes divisible by 16"
                                         ", got out_features=40"):
        _check_cuda_operands(torch.bfloat16, 64, 40, fp8=True)


def test_constructor_checks_and_state():
    with pytest.raises(ValueError, match="num_gemms must be a positive int"):
        te.GroupedLinear(0, IN, OUT)
    layer = _layer()
    assert layer.weight.shape == (E, OUT, IN) and layer.bias.shape == (E, OUT)
    assert layer.weight_i(2).data_ptr() == layer.weight[2].data_ptr()
    # each expert initialised on its own (te.Linear's init), not one shared draw
    assert not torch.equal(layer.weight[0], layer.weight[1])
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    other = te.GroupedLinear(E, IN, OUT, params_dtype=torch.bfloat16)
    other.load_state_dict(torch.load(buf))
    clone = copy.deepcopy(layer)
    x, _ = _data((4, 4, 4, 4))
    torch.testing.assert_close(other(x, [4, 4, 4, 4]), layer(x, [4, 4, 4, 4]), rtol=0, atol=0)
    torch.testing.assert_close(clone(x, [4, 4, 4, 4]), layer(x, [4, 4, 4, 4]), rtol=0, atol=0)


def test_torch_autocast_computes_in_its_dtype():
    torch.manual_seed(0)
    layer = te.GroupedLinear(E, IN, OUT)  # fp32 parameters
    x = torch.randn(16, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, [4, 4, 4, 4])
    assert y.dtype == torch.bfloat16
    ref = _loop(_cast(layer), x.to(torch.bfloat16), (4, 4, 4, 4),
                torch.zeros(16, OUT, dtype=torch.bfloat16))[0]
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def _cast(layer):
    out = copy.deepcopy(layer).to(torch.bfloat16)
    return out


# -- block-scaled recipes: groups padded to whole 128-row blocks (blocked.py) ---------------
BLOCKED = {"fp8_block": te.recipe.Float8BlockScaling(), "mxfp8": te.recipe.MXFP8BlockScaling()}


def _wide_layer():
    torch.manual_seed(0)
    layer = te.GroupedLinear(4, 128, 256, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def _wide_data(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    x = (torch.randn(sum(sizes), 128, generator=g) * 4.0 ** rows.unsqueeze(1)).to(torch.bfloat16)
    return x, torch.randn(sum(sizes), 256, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("sizes", [(5, 0, 130, 16), (128, 128, 0, 256)], ids=["ragged", "blocks"])
@pytest.mark.parametrize("name", BLOCKED)
def test_block_scaled_recipes_match_a_te_linear_per_expert(name, sizes):
    """Every expert quantized as its own te.Linear: its tokens' 1x128 / 1x32
    blocks (and the wgrad operands' columnwise blocks, which would span
    experts without the padding), its weight's blocks."""
    rec = BLOCKED[name]
    layer = _wide_layer()
    x, dy = _wide_data(sizes)
    _assert_matches_te_linear_per_expert(layer, x, sizes, dy, rec)


def test_nvfp4_trains_close_to_bf16():
    """NVFP4: one second-level scale per grouped tensor (not per expert), and
    stochastic rounding of dy: close to bf16, not equal to it."""
    layer = _wide_layer()
    sizes = (5, 0, 130, 16)
    x, dy = _wide_data(sizes)
    torch.manual_seed(2)
    with te.autocast(recipe=te.recipe.NVFP4BlockScaling()):
        got = _run(layer, x, torch.tensor(sizes), dy)
    ref = _run(layer, x, list(sizes), dy)
    for a, b in zip(got[:3], ref[:3]):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert 1e-3 < rel < 0.2, rel
    assert torch.count_nonzero(got[2][1]) == 0  # the expert without tokens


@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "nvfp4"])
def test_block_scaled_compiled_equals_eager(name):
    torch._dynamo.reset()
    rec = {**BLOCKED, "nvfp4": te.recipe.NVFP4BlockScaling()}[name]
    layer = _wide_layer()
    step = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for seed, sizes in enumerate([(5, 0, 130, 16), (40, 9, 2, 100)]):
        x, dy = _wide_data(sizes, seed=20 + seed)
        with te.autocast(recipe=rec):
            torch.manual_seed(3)
            eager = _run(layer, x, torch.tensor(sizes), dy)
            torch.manual_seed(3)
            compiled = _run(layer, x, torch.tensor(sizes), dy, step)
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_block_scaled_opcheck():
    sizes = (5, 0, 130, 16)
    x, dy = _wide_data(sizes)
    saved = _opcheck_both_ops(te.recipe.MXFP8BlockScaling(), _wide_layer(), sizes, x, dy)
    assert saved.dtype == torch.bfloat16  # quantized again in the backward


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_ops_take_the_routing_indices_from_the_caller(monkeypatch, compiled):
    """Each row's expert and the padded wgrad layout are computed in the
    traced code (fused kernels under inductor) and shared by the forward
    and backward ops, which then compute none of their own."""
    from transformer_engine_compile.module.grouped import compute

    torch._dynamo.reset()
    layer, sizes = _layer(), (5, 0, 11, 16)
    x, dy = _data(sizes)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        want = _run(layer, x, torch.tensor(sizes), dy)

    def refuse(*args, **kwargs):
        raise AssertionError("an op computed the routing indices itself")

    monkeypatch.setattr(compute, "group_ids", refuse)
    step = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else None
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        got = _run(layer, x, torch.tensor(sizes), dy, step)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
