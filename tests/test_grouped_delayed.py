"""te.GroupedLinear and te.GroupedExperts under DelayedScaling on CPU: each
expert's x, W and dy scaled from an amax history of its own, step after
step bit for bit a te.Linear per expert (outputs, gradients, histories and
scales), compiled equal to eager, the generated ops opcheck-clean, the
state saved in ``_extra_state``."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.kernels.reference import FP8_MAX
from transformer_engine_compile.module.grouped import GROUPED_LINEAR_OPS as OPS
from transformer_engine_compile.module.grouped import GroupedLinearFwdArgs
from transformer_engine_compile.module.grouped.compute import (grouped_linear_forward,
                                                                grouped_linear_setup_context)

E, IN, OUT = 4, 64, 32
RECIPE = te.recipe.DelayedScaling(amax_history_len=3)
# per step: tokens per expert (one expert idle each step), and the scale of
# the data, which moves so that the history and its max matter
STEPS = [((5, 0, 11, 16), 1.0), ((3, 9, 0, 20), 8.0), ((0, 7, 7, 2), 0.5), ((6, 6, 6, 6), 2.0)]


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = te.GroupedLinear(E, IN, OUT, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def _data(sizes, gain, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(sizes)
    x = torch.randn(tokens, IN, generator=g) * gain
    x = x * torch.arange(1, tokens + 1).unsqueeze(1) / tokens  # experts' amaxes differ
    dy = torch.randn(tokens, OUT, generator=g) * gain
    return x.to(torch.bfloat16), dy.to(torch.bfloat16)


def _step(layer, x, sizes, dy, call=None):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with te.autocast(recipe=RECIPE):
        y = (layer if call is None else call)(x, torch.tensor(sizes))
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


def _experts_as_te_linears(layer):
    linears = []
    for g in range(E):
        lin = te.Linear(IN, OUT, params_dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(layer.weight[g])
            lin.bias.copy_(layer.bias[g])
        linears.append(lin)
    return linears


def _loop_step(linears, x, sizes, dy):
    outs, dxs, dws, dbs, start = [], [], [], [], 0
    for lin, m in zip(linears, sizes):
        xg = x[start:start + m].detach().requires_grad_()
        lin.zero_grad(set_to_none=True)
        with te.autocast(recipe=RECIPE):
            y = lin(xg)
        y.backward(dy[start:start + m])
        outs.append(y)
        dxs.append(xg.grad)
        dws.append(lin.weight.grad)
        dbs.append(lin.bias.grad)
        start += m
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws), torch.stack(dbs)


def _assert_state_is_the_linears(layer, linears, prefix=""):
    hist_fwd = getattr(layer, f"{prefix}fp8_amax_history_fwd")
    scale_fwd = getattr(layer, f"{prefix}fp8_scale_fwd")
    hist_bwd = getattr(layer, f"{prefix}fp8_amax_history_bwd")
    scale_bwd = getattr(layer, f"{prefix}fp8_scale_bwd")
    assert hist_fwd.shape == (3, 2 * E) and hist_bwd.shape == (3, E)
    for g, lin in enumerate(linears):
        for col, (hist, scale, lcol) in {g: (hist_fwd, scale_fwd, 0), E + g: (hist_fwd, scale_fwd, 1),
                                         -1: (hist_bwd, scale_bwd, 0)}.items():
            col = g if col == -1 else col
            torch.testing.assert_close(hist[:, col], lin.fp8_amax_history_fwd[:, lcol]
                                       if hist is hist_fwd else lin.fp8_amax_history_bwd[:, lcol],
                                       rtol=0, atol=0)
            torch.testing.assert_close(scale[col], lin.fp8_scale_fwd[lcol] if hist is hist_fwd
                                       else lin.fp8_scale_bwd[lcol], rtol=0, atol=0)


def test_delayed_scaling_steps_as_a_te_linear_per_expert():
    layer = _layer()
    linears = _experts_as_te_linears(layer)
    for i, (sizes, gain) in enumerate(STEPS):
        x, dy = _data(sizes, gain, seed=i)
        got = _step(layer, x, sizes, dy)
        want = _loop_step(linears, x, sizes, dy)
        for name, a, b in zip(("y", "dx", "dW"), got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {i}: {name}")
        torch.testing.assert_close(got[3], want[3], rtol=1e-2, atol=1e-2)  # a sum's rounding
        _assert_state_is_the_linears(layer, linears)
    # the scales moved with the data, differently per expert
    assert layer.fp8_scale_fwd.unique().numel() > 2
    assert not torch.equal(layer.fp8_scale_fwd, torch.ones(2 * E))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_delayed_scaling_compiled_equals_eager(backend):
    torch._dynamo.reset()
    eager, compiled = _layer(), _layer()
    call = torch.compile(compiled, fullgraph=True, backend=backend)
    for i, (sizes, gain) in enumerate(STEPS):
        x, dy = _data(sizes, gain, seed=i)
        a, b = _step(eager, x, sizes, dy), _step(compiled, x, sizes, dy, call)
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u, rtol=0, atol=0, msg=f"step {i}")
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(compiled.get_buffer(name), buf, rtol=0, atol=0, msg=name)


def test_delayed_scaling_state_is_checkpointed():
    layer = _layer()
    for i, (sizes, gain) in enumerate(STEPS[:2]):
        x, dy = _data(sizes, gain, seed=i)
        _step(layer, x, sizes, dy)
    sd = layer.state_dict()
    assert sd["_extra_state"].shape == (3 * E * 3 + 3 * E,)  # (2E + E) x (L + 1)
    resumed = te.GroupedLinear(E, IN, OUT, params_dtype=torch.bfloat16)
    assert resumed.get_extra_state().numel() == 0  # nothing before a DelayedScaling run
    resumed.load_state_dict(sd)
    copied = copy.deepcopy(layer)
    sizes, gain = STEPS[2]
    x, dy = _data(sizes, gain, seed=2)
    want = _step(layer, x, sizes, dy)
    for other in (resumed, copied):
        for u, v in zip(want, _step(other, x, sizes, dy)):
            torch.testing.assert_close(v, u, rtol=0, atol=0)
        torch.testing.assert_close(other.get_extra_state(), layer.get_extra_state(),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"te.GroupedLinear: the extra state must be .*"
                                         r"\(12 \* amax_history_len \+ 12\)"):
        resumed.set_extra_state(torch.zeros(20))
    # a checkpoint without extra state (a bf16 run's, or older) loads strictly too
    plain = {k: v for k, v in sd.items() if k != "_extra_state"}
    te.GroupedLinear(E, IN, OUT, params_dtype=torch.bfloat16).load_state_dict(plain)


def test_delayed_scaling_needs_the_module_state():
    from transformer_engine_compile.module.grouped.layer import grouped_linear

    layer = _layer()
    x, _ = _data((4, 4, 4, 4), 1.0, seed=0)
    with te.autocast(recipe=RECIPE):
        with pytest.raises(ValueError, match="DelayedScaling keeps amax histories in a module"):
            grouped_linear(x, layer.weight, layer.bias, [4, 4, 4, 4])


def test_delayed_scaling_opcheck_forward_and_backward_ops():
    from test_linear_ops import opcheck

    layer = _layer()
    sizes = (5, 0, 11, 16)
    x, dy = _data(sizes, 1.0, seed=0)
    q = {f"{role}_quantizer": te.quantizer_for(RECIPE, role, internal=True)
         for role in ("input", "weight", "grad_output")}
    # opcheck runs the forward op's backward twice on the same arguments, and
    # the backward steps the dy history in place: a history whose max (2)
    # stays above dy's amax (1: the gradient of a sum) keeps the dy scale
    bwd_scale = FP8_MAX[q["grad_output_quantizer"].fp8_format] / 2
    state = {"amax_history_fwd": torch.rand(3, 2 * E), "scale_fwd": torch.rand(2 * E) + 1,
             "amax_history_bwd": torch.full((3, E), 2.0), "scale_bwd": torch.full((E,), bwd_scale)}
    args = GroupedLinearFwdArgs(
        inp=x.requires_grad_(), weight=layer.weight.detach(),
        m_offsets=torch.tensor(sizes).cumsum(0).to(torch.int32), bias=layer.bias.detach(),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=True,
        **q, **{k: v.clone() for k, v in state.items()})
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), True)
    with torch.no_grad():
        real = grouped_linear_forward(args)
    assert set(real.outputs) >= {"amax_history_fwd", "scale_fwd"}  # the updates, as outputs
    assert not torch.equal(real.outputs["scale_fwd"], state["scale_fwd"])
    args.inp.requires_grad_(False)
    bwd = OPS.make_bwd_args(real.saved, grouped_linear_setup_context(args), {"grad_output": dy})
    opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), True)


def test_grouped_experts_keep_a_state_per_gemm():
    torch.manual_seed(0)
    experts = te.GroupedExperts(E, IN, OUT, params_dtype=torch.bfloat16)
    tokens, top_k = 12, 2
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, IN, generator=g).to(torch.bfloat16)
    index = torch.randint(0, E, (tokens, top_k), generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    with te.autocast(recipe=RECIPE):
        y = experts(h, index, weights)
    y.float().pow(2).sum().backward()
    for prefix in ("gate_up_", "down_"):
        hist = getattr(experts, f"{prefix}fp8_amax_history_fwd")
        assert hist.shape == (3, 2 * E) and hist[1].count_nonzero() > 0  # rolled once
        assert getattr(experts, f"{prefix}fp8_amax_history_bwd")[1].count_nonzero() > 0
    assert experts.get_extra_state().numel() == 2 * (3 * E * 4)
    resumed = te.GroupedExperts(E, IN, OUT, params_dtype=torch.bfloat16)
    resumed.load_state_dict(experts.state_dict())
    torch.testing.assert_close(resumed.get_extra_state(), experts.get_extra_state(),
                               rtol=0, atol=0)
