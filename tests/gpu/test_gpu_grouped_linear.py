"""te.GroupedLinear on CUDA: the bf16 and FP8 grouped GEMMs against the
reference numerics (the same layer on CPU), compiled against eager bit for
bit, and training under CUDA graphs while the routing changes every step
(one compile, no cudagraph skip, no host synchronisation).  Skips without
CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, IN, OUT = 4, 256, 128
RECIPES = {"bf16": None, "fp8_current": te.recipe.Float8CurrentScaling(),
           "fp8_current_e4m3": te.recipe.Float8CurrentScaling(
               fp8_format=te.recipe.Format.E4M3),
           # fast accumulation in all three FP8 GEMMs (recipe.MMParams)
           "fp8_current_e4m3_fast": te.recipe.Float8CurrentScaling(
               fp8_format=te.recipe.Format.E4M3,
               fp8_gemm_dgrad=te.recipe.MMParams(use_split_accumulator=False),
               fp8_gemm_wgrad=te.recipe.MMParams(use_split_accumulator=False)),
           # the block-scaled path (blocked.py): bf16 GEMMs of the dequantized values
           "fp8_block": te.recipe.Float8BlockScaling(), "mxfp8": te.recipe.MXFP8BlockScaling(),
           # per-expert amax histories; current scaling's GEMMs
           "delayed_e4m3": te.recipe.DelayedScaling(fp8_format=te.recipe.Format.E4M3,
                                                    amax_history_len=4)}


def _layer(device):
    """The same weights on every device (made on the CPU, then moved)."""
    torch.manual_seed(0)
    layer = te.GroupedLinear(E, IN, OUT, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.normal_()
    return layer.to(device)


def _data(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    x = (torch.randn(sum(sizes), IN, generator=g) * (rows + 1).unsqueeze(1)).to(torch.bfloat16)
    return x, torch.randn(sum(sizes), OUT, generator=g).to(torch.bfloat16)


def _run(layer, x, sizes, dy, rec, step=None):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with te.autocast(enabled=rec is not None, recipe=rec):
        y = (layer if step is None else step)(x, torch.tensor(sizes, device=x.device))
    y.backward(dy)
    return [t.detach() for t in (y, x.grad, layer.weight.grad, layer.bias.grad)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("sizes", [(37, 0, 300, 175), (0, 0, 512, 0)], ids=["ragged", "one"])
def test_cuda_matches_the_reference(name, sizes):
    """The CUDA kernels against the same layer's CPU numerics (fp32 GEMMs of
    the same FP8 values): equal up to accumulation order and rounding."""
    rec = RECIPES[name]
    x, dy = _data(sizes)
    cpu = _run(_layer("cpu"), x, sizes, dy, rec)
    cuda = _run(_layer("cuda"), x.cuda(), sizes, dy.cuda(), rec)
    for a, b, what in zip(cuda, cpu, ("y", "dx", "dw", "db")):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a.cpu(), b) < 1e-2, what
    for g, n in enumerate(sizes):  # an expert without tokens gets zero gradients
        assert (torch.count_nonzero(cuda[2][g]) == 0) == (n == 0)


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
def test_fp8_is_not_bf16(name):
    x, dy = _data((37, 0, 300, 175))
    layer = _layer("cuda")
    fp8 = _run(layer, x.cuda(), (37, 0, 300, 175), dy.cuda(), RECIPES[name])
    bf16 = _run(layer, x.cuda(), (37, 0, 300, 175), dy.cuda(), None)
    assert 1e-3 < _rel(fp8[0], bf16[0]) < 0.1


COMPILED = list(RECIPES)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_equals_eager(name):
    torch._dynamo.reset()
    rec = RECIPES[name]
    layer, twin = _layer("cuda"), _layer("cuda")  # DelayedScaling: a state each
    step = torch.compile(twin, fullgraph=True)
    for seed, sizes in enumerate([(37, 0, 300, 175), (128, 128, 0, 256), (5, 60, 3, 0)]):
        x, dy = _data(sizes, seed=10 + seed)
        eager = _run(layer, x.cuda(), sizes, dy.cuda(), rec)
        compiled = _run(twin, x.cuda(), sizes, dy.cuda(), rec, step)
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b)
    for name, buf in layer.named_buffers():
        assert torch.equal(twin.get_buffer(name), buf), name


@pytest.mark.parametrize("name", COMPILED)
def test_moe_training_under_cuda_graphs_with_changing_routing(name):
    """50 steps of an MoE block whose router sends a different number of
    tokens to each expert every step (some none): one graph, no recompile,
    no cudagraph skip, the losses those of eager, and no host
    synchronisation in the eager step.  The compiled run starts with no
    kernel runner built (as a fresh process does): the CuTeDSL runners are
    built in its warm-up, whose allocations share the CUDA graphs' memory
    pool, and must keep none of it."""
    from transformer_engine_compile.kernels.runner import RUNNERS

    torch._dynamo.reset()
    counters.clear()
    rec, tokens, hidden, ffn, experts = RECIPES[name], 512, 256, 128, 8

    def build():
        torch.manual_seed(0)
        router = torch.nn.Linear(hidden, experts, bias=False, device="cuda",
                                 dtype=torch.bfloat16)
        block = te.GroupedExperts(experts, hidden, ffn, params_dtype=torch.bfloat16,
                                  device="cuda")
        return router, block, torch.optim.SGD([*router.parameters(), *block.parameters()],
                                              lr=0.1)

    def loss_fn(router, block, x, bias):
        probs = torch.softmax(router(x).float() + bias, dim=-1)
        weights, index = probs.topk(2, dim=-1)
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = block(x, index, weights.to(x.dtype))
        return y.float().pow(2).mean()

    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(50, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    # a routing bias that moves every step, sending no token to some experts
    biases = torch.randn(50, experts, device="cuda", generator=gen) * 4
    biases[::3, :3] = -1e4

    losses = {}
    for mode in ("eager", "reduce-overhead"):
        if mode != "eager":
            built = dict(RUNNERS.runners)
            RUNNERS.runners.clear()
        router, block, opt = build()
        fn = loss_fn if mode == "eager" else torch.compile(loss_fn, fullgraph=True, mode=mode)
        out = torch.zeros(50, device="cuda")
        for i in range(50):
            if mode == "eager" and i == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                if mode != "eager":
                    torch.compiler.cudagraph_mark_step_begin()
                loss = fn(router, block, xs[i], biases[i])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out[i].copy_(loss.detach())
            finally:
                torch.cuda.set_sync_debug_mode(0)
        losses[mode] = out.cpu()
    RUNNERS.runners.update(built)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
    assert torch.isfinite(losses["eager"]).all()
    torch.testing.assert_close(losses["reduce-overhead"], losses["eager"], rtol=5e-2, atol=1e-4)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_grouped_quantize_kernels_equal_the_reference(fmt):
    """kernels/triton_grouped.py against the reference, bit for bit: the
    amaxes, current scaling's scales and their reciprocals, and the casts (rowwise, transposed into padded token groups,
    transposed per stacked weight) of tokens by their group index (empty
    groups, Inf, NaN) and of stacked weights by rows per group."""
    from transformer_engine_compile.kernels import reference as ref
    from transformer_engine_compile.kernels import triton_grouped as tg
    from transformer_engine_compile.module.grouped.padding import padded_sources

    sizes = [0, 37, 300, 1, 0, 175]
    rows = torch.repeat_interleave(torch.arange(6), torch.tensor(sizes)).cuda()
    x = (torch.randn(sum(sizes), 520, device="cuda") * 4.0 ** rows.unsqueeze(1)).bfloat16()
    x[40, 3], x[100, 0] = float("inf"), float("nan")
    sources = padded_sources(torch.tensor(sizes).cumsum(0).int().cuda(), rows, 16)[0]
    for kwargs, x2d, groups, more in (
            (dict(group_of_row=rows), x, 6, dict(columns_from=sources)),
            (dict(rows_per_group=64), x[:448], 7, dict(transpose_groups=True))):
        amax = tg.amax_grouped(x2d, groups, **kwargs)
        assert torch.equal(amax.nan_to_num(), ref.amax_grouped(x2d, groups, **kwargs).nan_to_num())
        special = torch.tensor([0.0, 1e-45, 3e-3, 3e38, float("inf"), float("nan")],
                               device="cuda")
        for pow2, eps in ((False, 0.0), (True, 1e-3)):
            for a in (amax, special):
                got = tg.current_scales_grouped(a, fmt, pow2, eps)
                want = ref.current_scales_grouped(a, fmt, pow2, eps)
                assert all(torch.equal(u.view(torch.int32), v.view(torch.int32))
                           for u, v in zip(got, want))
        scale = ref.current_scale(amax, fmt, False, 0.0)
        for extra in ({}, more):
            got = tg.cast_fp8_grouped(x2d, scale, fmt, **kwargs, **extra)
            want = ref.cast_fp8_grouped(x2d, scale, fmt, **kwargs, **extra)
            for a, b in zip(got, want):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("name", ["fp8_current", "fp8_current_e4m3"])
def test_saved_original_weight_requantized_on_cuda(name, compiled):
    """``save_original_weight`` (te.fsdp.fully_shard's high-precision
    gather) on the FP8 grouped GEMMs: the backward quantizes the experts'
    transposed copies again from W, bit for bit the kept copies' results."""
    rec, sizes = RECIPES[name], (40, 0, 88, 128)
    x, dy = _data(sizes)
    runs = []
    for sow in (False, True):
        torch._dynamo.reset()
        layer = _layer("cuda")
        layer.save_original_weight = sow
        step = torch.compile(layer, fullgraph=True) if compiled else None
        runs.append(_run(layer, x.cuda(), sizes, dy.cuda(), rec, step))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["fp8_current_e4m3", "delayed_e4m3"])
def test_weight_cache_across_microbatches_on_cuda(name):
    """``is_first_microbatch`` on the FP8 grouped GEMMs: microbatches
    (True, False, False) compiled with inductor equal eager bit for bit;
    under current scaling they also equal uncached calls, and a False call
    after the weights changed still computes with the cached FP8 weights."""
    rec, sizes = RECIPES[name], (40, 0, 88, 128)
    x, dy = (t.cuda() for t in _data(sizes))
    torch._dynamo.reset()
    eager, compiled, plain = _layer("cuda"), _layer("cuda"), _layer("cuda")
    step = torch.compile(compiled, fullgraph=True)

    def run(layer, fn, first):
        xg = x.detach().requires_grad_()
        with te.autocast(recipe=rec):
            y = fn(xg, torch.tensor(sizes, device="cuda"), first)
        y.backward(dy)
        return [y.detach(), xg.grad, layer.weight.grad.clone()]

    for first in (True, False, False):
        got = run(eager, eager, first)
        for a, b in zip(got, run(compiled, step, first)):
            assert torch.equal(a, b)
        if name == "fp8_current_e4m3":
            for a, b in zip(got, run(plain, plain, None)):
                assert torch.equal(a, b)
    if name == "fp8_current_e4m3":
        before = run(eager, eager, False)[0]
        with torch.no_grad():
            eager.weight.mul_(2)
        assert torch.equal(run(eager, eager, False)[0], before)
        assert not torch.equal(run(eager, eager, None)[0], before)


def test_experts_weight_cache_on_cuda():
    """te.GroupedExperts caches both grouped GEMMs' FP8 weights: its
    microbatches (True, False, False) equal uncached ones bit for bit, eager
    and compiled with inductor (E4M3 current scaling, the FP8 grouped
    GEMMs; inductor fuses the activation and the unpermutation, so each
    is compared with its own mode)."""
    rec = RECIPES["fp8_current_e4m3"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    make = lambda: te.GroupedExperts(8, 256, 128, params_dtype=torch.bfloat16).cuda()  # noqa
    cached, plain = make(), make()
    plain.load_state_dict(cached.state_dict())
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    weights, index = torch.rand(512, 8, device="cuda", generator=g).topk(2, dim=-1)
    index = index.clamp(max=6)  # expert 7 gets no tokens
    dy = torch.randn(512, 256, device="cuda", generator=g).bfloat16()

    def run(module, fn, first):
        xg = x.detach().requires_grad_()
        with te.autocast(recipe=rec):
            y = fn(xg, index, weights.bfloat16(), first)
        y.backward(dy)
        return [y.detach(), xg.grad, module.gate_up_proj.grad.clone(),
                module.down_proj.grad.clone()]

    for compiled in (False, True):
        cached.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        fn_c, fn_p = ((torch.compile(m, fullgraph=True) if compiled else m)
                      for m in (cached, plain))
        for first in (True, False, False):
            for a, b in zip(run(plain, fn_p, None), run(cached, fn_c, first)):
                assert torch.equal(a, b), (compiled, first)
    assert cached.down_fp8_weight_transposed.shape == (8, 128, 256)


@pytest.mark.parametrize("name", COMPILED)
def test_fused_wgrad_accumulation_on_cuda(name):
    """``fuse_wgrad_accumulation``: two microbatches add W's gradients into
    an fp32 ``weight.main_grad`` (``weight.grad`` stays None), compiled with
    inductor equal to eager bit for bit, and the sum within bf16 rounding
    of the unfused layer's gradients (the blockwise CuTeDSL kernel writes
    its fp32 wgrad straight into the add; the other GEMMs give bf16)."""
    rec, sizes = RECIPES[name], (40, 0, 88, 128)
    torch._dynamo.reset()
    eager, compiled, plain = _layer("cuda"), _layer("cuda"), _layer("cuda")
    for layer in (eager, compiled):
        layer.fuse_wgrad_accumulation = True
        layer.weight.main_grad = torch.zeros(layer.weight.shape, device="cuda")
    step = torch.compile(compiled, fullgraph=True)
    plain.zero_grad(set_to_none=True)
    total = torch.zeros(plain.weight.shape, device="cuda")
    for seed in range(2):
        x, dy = (t.cuda() for t in _data(sizes, seed=20 + seed))
        outs = []
        for layer, fn in ((eager, eager), (compiled, step), (plain, plain)):
            xg = x.detach().requires_grad_()
            with te.autocast(enabled=rec is not None, recipe=rec):
                y = fn(xg, torch.tensor(sizes, device="cuda"))
            y.backward(dy)
            outs.append((y.detach(), xg.grad))
        total += plain.weight.grad.float()
        plain.weight.grad = None
        for a, b in zip(outs[0], outs[1]):
            assert torch.equal(a, b)
        assert torch.equal(eager.weight.main_grad, compiled.weight.main_grad)
        assert eager.weight.grad is None and compiled.weight.grad is None
        assert _rel(eager.weight.main_grad, total) < 1e-2
    assert torch.count_nonzero(eager.weight.main_grad[1]) == 0  # expert 1 saw no token


@pytest.mark.parametrize("name", ["bf16", "fp8_current_e4m3", "fp8_block"])
def test_experts_fused_wgrad_accumulation_on_cuda(name):
    """te.GroupedExperts(fuse_wgrad_accumulation=True), eager and compiled
    with inductor, over two microbatches of changing routing: outputs and dx
    those of the unfused module in the same mode, bit for bit; both weights'
    fp32 main_grad the sum of the unfused module's per-call gradients (bf16:
    bit for bit; FP8: within 1%, the blockwise kernel writing its wgrad in
    fp32); .grad stays None.  (Inductor fuses the activation and the
    unpermutation, so each mode is compared with itself.)"""
    rec = RECIPES[name]
    torch._dynamo.reset()

    def make(fused):
        torch.manual_seed(0)
        experts = te.GroupedExperts(8, 256, 128, params_dtype=torch.bfloat16, device="cuda",
                                    fuse_wgrad_accumulation=fused)
        if fused:
            for w in (experts.gate_up_proj, experts.down_proj):
                w.main_grad = torch.zeros(w.shape, device="cuda")
        return experts

    for compiled in (False, True):
        fused, plain = make(True), make(False)
        fns = [torch.compile(m, fullgraph=True) if compiled else m for m in (fused, plain)]
        totals = [torch.zeros(w.shape, device="cuda") for w in (plain.gate_up_proj,
                                                                 plain.down_proj)]
        g = torch.Generator(device="cuda").manual_seed(5)
        for i in range(2):
            x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
            weights, index = torch.rand(512, 8, device="cuda", generator=g).topk(2, dim=-1)
            if i == 0:
                index = index.clamp(max=6)  # expert 7 gets no tokens
            plain.zero_grad(set_to_none=True)
            outs = []
            for fn in fns:
                xg = x.detach().requires_grad_()
                with te.autocast(enabled=rec is not None, recipe=rec):
                    y = fn(xg, index, weights.bfloat16())
                y.float().pow(2).mean().backward()
                outs.append((y.detach(), xg.grad))
            for a, b in zip(*outs):
                assert torch.equal(a, b), (compiled, i)
            for total, wf, wp in zip(totals, (fused.gate_up_proj, fused.down_proj),
                                     (plain.gate_up_proj, plain.down_proj)):
                total += wp.grad.float()
                assert wf.grad is None
                if rec is None:
                    assert torch.equal(wf.main_grad, total), (compiled, i)
                else:
                    assert _rel(wf.main_grad, total) < 1e-2, (compiled, i)
