"""te.GroupedLinear's ``fuse_wgrad_accumulation`` (Transformer Engine's and
Megatron-LM's ``weight.main_grad``) on CPU: W's gradient is added into
``main_grad`` and never returned, microbatch after microbatch, eager and
compiled alike; the ops opcheck-clean; clear errors without a usable
``main_grad``."""

import pytest
import torch

import transformer_engine_compile as te

from test_grouped_blockwise_kernel import _layer as _wide_layer
from test_grouped_linear import E, IN, OUT, _layer, opcheck_grouped_ops

SIZES = (5, 0, 11, 16)
RECIPES = {"bf16": None, "fp8_current": te.recipe.Float8CurrentScaling(),
           "delayed": te.recipe.DelayedScaling(), "fp8_block": te.recipe.Float8BlockScaling()}


def _fused(seed=0, wide=False):
    layer = _wide_layer() if wide else _layer(seed=seed)
    layer.fuse_wgrad_accumulation = True
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    return layer


def _microbatches(fn, layer, rec, n=2, sizes=SIZES, cols=(IN, OUT)):
    """``n`` forward + backward calls; each call's (y, dx, main_grad after it)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(sum(sizes), cols[0], generator=g).bfloat16().requires_grad_()
        dy = torch.randn(sum(sizes), cols[1], generator=g).bfloat16()
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = fn(x, torch.tensor(sizes))
        y.backward(dy)
        grad = layer.weight.main_grad if hasattr(layer.weight, "main_grad") else layer.weight.grad
        out.append((y.detach(), x.grad, grad.clone()))
    return out


def test_bf16_adds_each_microbatchs_gradient_into_main_grad():
    """main_grad after each microbatch is the fp32 sum of the gradients an
    unfused layer returns (the same bf16 GEMM outputs, summed in fp32);
    weight.grad stays None, the input and bias gradients are the unfused
    layer's."""
    fused, plain = _fused(), _layer()
    got = _microbatches(fused, fused, None)
    want, total, bias = [], torch.zeros(E, OUT, IN), 0
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        plain.zero_grad()
        x = torch.randn(sum(SIZES), IN, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(sum(SIZES), OUT, generator=g).bfloat16()
        y = plain(x, torch.tensor(SIZES))
        y.backward(dy)
        total += plain.weight.grad.float()
        bias = bias + plain.bias.grad  # autograd's own accumulation, in bf16
        want.append((y.detach(), x.grad, total.clone()))
    for (y, dx, mg), (wy, wdx, wmg) in zip(got, want):
        assert torch.equal(y, wy) and torch.equal(dx, wdx)
        assert torch.equal(mg, wmg)
    assert fused.weight.grad is None
    assert torch.equal(fused.bias.grad, bias)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(name, backend, request):
    """Compiled fullgraph, the same outputs and main_grad as eager, bit for
    bit, and main_grad close to the unfused layer's summed gradients."""
    rec = RECIPES[name]
    if name == "fp8_block":  # on the CuTeDSL kernel's path, its reference standing in
        request.getfixturevalue("stand_in_kernel")
    wide = name == "fp8_block"
    cols, sizes = ((256, 384), (128, 0, 130, 256)) if wide else ((IN, OUT), SIZES)
    torch._dynamo.reset()
    eager, compiled = _fused(wide=wide), _fused(wide=wide)
    step = torch.compile(compiled, fullgraph=True, backend=backend)
    got_e = _microbatches(eager, eager, rec, sizes=sizes, cols=cols)
    got_c = _microbatches(step, compiled, rec, sizes=sizes, cols=cols)
    for a, b in zip(got_e, got_c):
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u, rtol=0, atol=0)
    assert compiled.weight.grad is None and eager.weight.grad is None
    plain = _wide_layer() if wide else _layer()
    plain_grads = _microbatches(plain, plain, rec, sizes=sizes, cols=cols)
    # the unfused gradient: bf16 GEMM outputs summed in bf16 (.grad)
    want = plain_grads[-1][2].float()
    assert ((got_e[-1][2] - want).norm() / want.norm()).item() < 1e-2


def test_errors_and_no_grad():
    layer = _layer()
    layer.fuse_wgrad_accumulation = True
    x = torch.randn(sum(SIZES), IN).bfloat16()
    with pytest.raises(RuntimeError, match="needs weight.main_grad"):
        layer(x, list(SIZES))
    layer.weight.main_grad = torch.zeros(OUT, IN)
    with pytest.raises(ValueError, match="main_grad has shape"):
        layer(x, list(SIZES))
    del layer.weight.main_grad
    with torch.no_grad():  # no gradient, no main_grad needed
        assert layer(x, list(SIZES)).shape == (sum(SIZES), OUT)
    assert te.GroupedLinear(E, IN, OUT, fuse_wgrad_accumulation=True).fuse_wgrad_accumulation


def test_opcheck_with_main_grad():
    rec = RECIPES["fp8_current"]
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(SIZES), IN, generator=g).bfloat16()
    dy = torch.randn(sum(SIZES), OUT, generator=g).bfloat16()
    main_grad = torch.zeros(E, OUT, IN)
    real, _ = opcheck_grouped_ops(rec, layer, SIZES, x, dy, main_grad=main_grad)
    assert real.saved["main_grad"] is main_grad  # the backward's update target, not a copy


# te.GroupedExperts: both grouped GEMMs' weight gradients into their main_grad
EXPERTS, HIDDEN, FFN, TOKENS, TOP_K = 4, 64, 32, 24, 2


def _experts(fused: bool, hidden=HIDDEN, ffn=FFN):
    torch.manual_seed(0)
    experts = te.GroupedExperts(EXPERTS, hidden, ffn, params_dtype=torch.bfloat16,
                                fuse_wgrad_accumulation=fused)
    if fused:
        for w in (experts.gate_up_proj, experts.down_proj):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    return experts


def _expert_microbatches(fn, experts, rec, n=2):
    """``n`` calls with changing routing (expert 3 gets no tokens in the
    first); each call's (y, dx, gate_up grad, down grad) after it, the
    gradients from ``main_grad`` where fused, else ``.grad`` of that call
    alone."""
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(n):
        x = torch.randn(TOKENS, experts.hidden_size, generator=g).bfloat16().requires_grad_()
        weights, index = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOP_K, dim=-1)
        if i == 0:
            index = index.clamp(max=EXPERTS - 2)
        if not experts.fuse_wgrad_accumulation:
            experts.zero_grad(set_to_none=True)
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = fn(x, index, weights.bfloat16())
        y.float().pow(2).sum().backward()
        grads = [(w.main_grad if experts.fuse_wgrad_accumulation else w.grad).clone()
                 for w in (experts.gate_up_proj, experts.down_proj)]
        out.append((y.detach(), x.grad, *grads))
    return out


@pytest.mark.parametrize("name", ["bf16", "fp8_current"])
def test_experts_add_both_gradients_into_main_grad(name):
    """Each main_grad after each call is the sum of the unfused module's
    per-call gradients: in bf16 bit for bit (the same bf16 GEMM outputs,
    added in fp32); under FP8 within bf16 rounding (the wgrad comes in
    main_grad's fp32 here). .grad stays None; outputs and dx are the
    unfused module's."""
    rec = RECIPES[name]
    fused, plain = _experts(True), _experts(False)
    got = _expert_microbatches(fused, fused, rec)
    want = _expert_microbatches(plain, plain, rec)
    totals = [torch.zeros(EXPERTS, 2 * FFN, HIDDEN), torch.zeros(EXPERTS, HIDDEN, FFN)]
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
        for total, mg, grad in zip(totals, g[2:], w[2:]):
            total += grad.float()
            if rec is None:
                assert torch.equal(mg, total)
            else:
                assert ((mg - total).norm() / total.norm()).item() < 1e-2
    assert fused.gate_up_proj.grad is None and fused.down_proj.grad is None
    assert got[0][2][EXPERTS - 1].count_nonzero() == 0  # no tokens, no gradient yet


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block"])
def test_experts_compiled_equal_eager(name, request):
    """aot_eager fullgraph: the same outputs and main_grads as eager, bit for
    bit, over changing routing (blockwise on the CuTeDSL kernel's path with
    its reference standing in, features in whole 128-blocks)."""
    rec = RECIPES[name]
    dims, calls = (HIDDEN, FFN), None
    if name == "fp8_block":
        calls = request.getfixturevalue("stand_in_kernel")
        dims = (128, 128)
    torch._dynamo.reset()
    eager, compiled = _experts(True, *dims), _experts(True, *dims)
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    for a, b in zip(_expert_microbatches(eager, eager, rec),
                    _expert_microbatches(step, compiled, rec)):
        for u, v in zip(a, b):
            torch.testing.assert_close(v, u, rtol=0, atol=0)
    assert compiled.gate_up_proj.grad is None and compiled.down_proj.grad is None
    if calls is not None:  # both GEMMs' fprop, dgrad and wgrad ran on the kernel's path
        assert calls.count(True) >= 2 and calls.count(False) >= 4


def test_experts_errors_and_no_grad():
    experts = _experts(False)
    experts.fuse_wgrad_accumulation = True
    x = torch.randn(TOKENS, HIDDEN).bfloat16()
    weights, index = torch.rand(TOKENS, EXPERTS).topk(TOP_K, dim=-1)
    with pytest.raises(RuntimeError, match=r"te.GroupedExperts\(fuse_wgrad_accumulation=True\) "
                                           r"needs gate_up_proj.main_grad"):
        experts(x, index, weights.bfloat16())
    experts.gate_up_proj.main_grad = torch.zeros(experts.gate_up_proj.shape)
    experts.down_proj.main_grad = torch.zeros(EXPERTS, FFN, HIDDEN)  # transposed: refused
    with pytest.raises(ValueError, match="down_proj.main_grad has shape"):
        experts(x, index, weights.bfloat16())
    with torch.no_grad():  # no gradient, no main_grad read
        assert experts(x, index, weights.bfloat16()).shape == (TOKENS, HIDDEN)
    assert not te.GroupedExperts(EXPERTS, HIDDEN, FFN).fuse_wgrad_accumulation
