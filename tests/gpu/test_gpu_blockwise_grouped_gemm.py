"""The CuTeDSL FP8 blockwise grouped GEMM (kernels/blockwise_grouped.py) on
a Hopper GPU against the fp32 GEMMs of its dequantized operands: groups
along the rows (fprop, dgrad; padding-only tiles skipped) and along the
reduced dim (wgrad; an empty group gives zeros), through the opaque op
eager and under torch.compile, and the runner compiled once per
configuration.  Skips without CUDA, a Hopper GPU or nvidia-cutlass-dsl."""

import pytest
import torch

from transformer_engine_compile.kernels import blockwise_grouped as bg
from transformer_engine_compile.kernels.runner import RUNNERS, run_kernel

pytestmark = pytest.mark.skipif(bg.unavailable_reason() is not None,
                                reason=str(bg.unavailable_reason()))

T = bg.TILE


def _fp8(shape, gen, dtype=torch.float8_e4m3fn):
    return (torch.randn(shape, generator=gen, device="cuda") * 2).to(dtype)


def _scales(shape, gen):
    """Powers of two in [2^-4, 2^3] (the recipe's power-of-two scales)."""
    return torch.exp2(torch.randint(-4, 4, shape, generator=gen, device="cuda").float())


def _rows_dequantized(q, s):
    """``(rows, K)`` FP8 with ``(rows, K/128)`` scales, in fp32."""
    return q.float() * s.repeat_interleave(T, dim=1)[:, :q.shape[1]]


def _blocks_dequantized(q, s):
    """``(N, K)`` FP8 with ``(N/128, >= K/128)`` block scales, in fp32."""
    n, k = q.shape
    return q.float() * s[:, :k // T].repeat_interleave(T, 0).repeat_interleave(T, 1)


def _assert_within_accumulation_error(out, ad, bd):
    """``out`` against ``ad @ bd^T``: the tensor cores sum each 128-long block
    of FP8 products with fewer mantissa bits than fp32, so an element may
    differ by a small fraction of the sum of its products' magnitudes (plus
    the output's rounding)."""
    ref = ad @ bd.t()
    bound = 2.0 ** -11 * (ad.abs() @ bd.abs().t()) + 2.0 ** -7 * ref.abs() + 1e-6
    err = (out.float() - ref).abs()
    assert bool((err <= bound).all()), (err - bound).max()
    # and not as loose as the bound allows everywhere
    assert (err.norm() / ref.norm()).item() < 2e-3


def _row_groups_case(gen, groups=3, k=384, n=256, b_dtype=torch.float8_e4m3fn):
    """A: 6 row tiles, tile 3 padding only (sched -1), the last 10 rows of
    tile 1 and of tile 5 padding too; B per group, its block scales padded
    along K to a multiple of 4 (as stored).  The tokens (output rows) are
    the other rows, in order."""
    sched = torch.tensor([0, 0, 1, -1, 2, 2], dtype=torch.int32, device="cuda")
    rows = T * sched.numel()
    real = (sched >= 0).repeat_interleave(T)
    real[2 * T - 10:2 * T] = False
    real[rows - 10:] = False
    dest = real.nonzero().flatten().int()
    sources = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    sources[dest.long()] = torch.arange(dest.numel(), dtype=torch.int32, device="cuda")
    a = _fp8((rows, k), gen)
    # the 1-D scales' layout: blocks outer, (rows, K/128) a transposed view
    sa = _scales((k // T, rows), gen).t()
    b = _fp8((groups, n, k), gen, b_dtype)
    sb = torch.zeros(groups, n // T, 4, device="cuda")
    sb[..., :k // T] = _scales((groups, n // T, k // T), gen)
    return a, b, sa, sb, sched, sources, dest


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_groups_along_rows(out_dtype, b_dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    a, b, sa, sb, sched, sources, dest = _row_groups_case(gen, b_dtype=b_dtype)
    out = bg.grouped_gemm(a, b, sa, sb, sched, False, out_dtype, sources, dest)
    assert out.shape == (dest.numel(), b.shape[1]) and out.dtype == out_dtype
    ad = _rows_dequantized(a, sa)
    tile_of = dest.long() // T
    for t, g in enumerate(sched.tolist()):
        if g < 0:
            continue
        mine = tile_of == t
        _assert_within_accumulation_error(out[mine], ad[dest[mine].long()],
                                          _blocks_dequantized(b[g], sb[g]))


def test_groups_along_rows_strided_weight():
    """dgrad's B: each group's transposed weight read as a view of one
    ``(K, groups * N)`` buffer (the stacked weight's columnwise copy)."""
    gen = torch.Generator("cuda").manual_seed(1)
    a, b, sa, sb, sched, sources, dest = _row_groups_case(gen)
    groups, n, k = b.shape
    wide = torch.empty(n, groups * k, dtype=b.dtype, device="cuda")
    view = wide.as_strided((groups, n, k), (k, groups * k, 1))
    view.copy_(b)
    out = bg.grouped_gemm(a, view, sa, sb, sched, False, torch.float32, sources, dest)
    ref = bg.grouped_gemm(a, b.contiguous(), sa, sb, sched, False, torch.float32, sources, dest)
    assert torch.equal(out, ref)


def test_groups_along_k():
    gen = torch.Generator("cuda").manual_seed(2)
    m, n, tiles = 256, 384, 7
    a, b = _fp8((m, tiles * T), gen), _fp8((n, tiles * T), gen)
    sa = _scales((tiles, m), gen).t()
    sb = _scales((tiles, n), gen).t()
    # group 1 has no tokens; the others' tiles, the last one unused
    sched = torch.tensor([[0, 2], [2, 2], [2, 3], [3, 6]], dtype=torch.int32, device="cuda")
    out = bg.grouped_gemm(a, b, sa, sb, sched, True, torch.float32)
    assert out.shape == (4, m, n)
    ad, bd = _rows_dequantized(a, sa), _rows_dequantized(b, sb)
    for g, (lo, hi) in enumerate(sched.tolist()):
        cols = slice(lo * T, hi * T)
        if hi > lo:
            _assert_within_accumulation_error(out[g], ad[:, cols], bd[:, cols])
    assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grouped_k", [False, True])
def test_persistent_ctas_equal_one_tile_per_cta(grouped_k, out_dtype):
    """``persistent``: at most one CTA per SM, each looping over tiles (its
    producer loading the next while its consumers store this one); every
    tile as a CTA of its own computes it, bit for bit (skipped tiles and an
    empty group included, more tiles than SMs).  Each way launched 20
    times, every output the same: one tile per CTA stages its output in
    the A ring, over the stage that its last K tile (2 or 3 K tiles here)
    was read from.  wgrad's persistent CTAs with the TMA-store epilogue
    (``tma_store``) too, with 128 x 128, 128 x 192 and 192 x 128 tiles (N
    = 1536 is 8 of 192, and 1664 ends in a partial one; M = 768 is 4 of
    192, and 640 ends in a partial one: their loads and stores clipped)."""
    gen = torch.Generator("cuda").manual_seed(6)
    if grouped_k:  # 3 groups x 6 x 12 tiles
        a, b = _fp8((768, 5 * T), gen), _fp8((1536, 5 * T), gen)
        sa, sb = _scales((5, 768), gen).t(), _scales((5, 1536), gen).t()
        inputs = [a, b, sa, sb, torch.tensor([[0, 2], [2, 2], [2, 5]], dtype=torch.int32,
                                             device="cuda")]
    else:  # 6 row tiles x 40 N tiles, K 3 tiles
        a, b, sa, sb, sched, sources, dest = _row_groups_case(gen, n=40 * T)
        inputs = [a, b, sa, sb, sched, sources, dest]
    ways = [(False, False, T, T), (True, False, T, T)]
    if grouped_k:
        ways += [(True, True, T, T), (True, True, T, 192), (True, True, 192, T)]
    cases = [inputs]
    if grouped_k:  # 13 N tiles of 128: 8 of 192 and a partial one
        b2, sb2 = _fp8((1664, 5 * T), gen), _scales((5, 1664), gen).t()
        cases.append([a, b2, sa, sb2, inputs[4]])
        # 5 M tiles of 128: 3 of 192 and a partial one
        cases.append([a[:640], b, sa[:640], sb, inputs[4]])
    for case in cases:
        outs = []
        for persistent, tma_store, tile_m, tile_n in ways:
            cfg = bg.config(grouped_k, a.dtype, b.dtype, out_dtype, persistent=persistent,
                            tma_store=tma_store, tile_m=tile_m, tile_n=tile_n)
            outs += [run_kernel(cfg, case)[0] for _ in range(20)]
        for i, out in enumerate(outs[1:], 1):
            assert torch.equal(outs[0], out), \
                f"launch {i % 20} of (persistent, tma_store, tile_m, tile_n)={ways[i // 20]}"


def test_compiled_equals_eager_and_builds_once():
    gen = torch.Generator("cuda").manual_seed(3)
    a, b, sa, sb, sched, sources, dest = _row_groups_case(gen)
    eager = bg.grouped_gemm(a, b, sa, sb, sched, False, torch.bfloat16, sources, dest)
    before = len(RUNNERS.runners)
    fn = torch.compile(lambda a, b, sa, sb, sched, sources, dest: bg.grouped_gemm(
        a, b, sa, sb, sched, False, torch.bfloat16, sources, dest), fullgraph=True)
    compiled = fn(a, b, sa, sb, sched, sources, dest)
    assert torch.equal(compiled, eager)
    assert len(RUNNERS.runners) == before  # the configuration's runner was reused


def test_cuda_graph_replay_follows_the_schedule():
    gen = torch.Generator("cuda").manual_seed(4)
    a, b, sa, sb, sched, sources, dest = _row_groups_case(gen)
    bg.grouped_gemm(a, b, sa, sb, sched, False, torch.float32, sources, dest)  # built first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bg.grouped_gemm(a, b, sa, sb, sched, False, torch.float32, sources, dest)
    sched.copy_(torch.tensor([2, 1, 0, 0, -1, 1], dtype=torch.int32))
    graph.replay()
    ref = bg.grouped_gemm(a, b, sa, sb, sched, False, torch.float32, sources, dest)
    valid = (sched[dest.long() // T] >= 0)
    assert torch.equal(out[valid], ref[valid])


def test_grouped_linear_runs_the_kernel_and_matches_the_dequantized_path(monkeypatch):
    import transformer_engine_compile as te
    from transformer_engine_compile.module.grouped import blockwise_gemm
    calls = []
    real = bg.grouped_gemm

    def spy(*args):
        calls.append(args[5])
        return real(*args)

    torch.manual_seed(0)
    layer = te.GroupedLinear(4, 256, 384, params_dtype=torch.bfloat16).cuda()
    sizes = (37, 0, 300, 175)
    x = torch.randn(sum(sizes), 256, device="cuda").bfloat16()
    dy = torch.randn(sum(sizes), 384, device="cuda").bfloat16()

    def step():
        xg = x.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            y = layer(xg, torch.tensor(sizes, device="cuda"))
        y.backward(dy)
        return y, xg.grad, layer.weight.grad

    monkeypatch.setattr(bg, "grouped_gemm", spy)
    got = step()
    assert calls == [False, False, True]
    monkeypatch.setattr(blockwise_gemm, "applies", lambda *a: False)
    want = step()
    for a, b in zip(got, want):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2
    assert torch.count_nonzero(got[2][1]) == 0  # the expert without tokens


def test_grouped_linear_weight_cache_on_the_kernel():
    """``is_first_microbatch`` on the kernel path: microbatches (True,
    False, False), eager and compiled with inductor, equal uncached calls
    bit for bit while the weights stay put, and a False call after the
    weights changed computes with the cached FP8 weights."""
    import transformer_engine_compile as te

    torch._dynamo.reset()
    torch.manual_seed(0)
    make = lambda: te.GroupedLinear(4, 256, 384, params_dtype=torch.bfloat16).cuda()  # noqa: E731
    cached, compiled, plain = make(), make(), make()
    compiled.load_state_dict(cached.state_dict())
    plain.load_state_dict(cached.state_dict())
    step_c = torch.compile(compiled, fullgraph=True)
    sizes = torch.tensor((37, 0, 300, 175), device="cuda")
    x = torch.randn(512, 256, device="cuda").bfloat16()
    dy = torch.randn(512, 384, device="cuda").bfloat16()

    def run(layer, fn, first):
        xg = x.detach().requires_grad_()
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            y = fn(xg, sizes, first)
        y.backward(dy)
        return [y.detach(), xg.grad, layer.weight.grad.clone()]

    for first in (True, False, False):
        got = run(cached, cached, first)
        for want in (run(plain, plain, None), run(compiled, step_c, first)):
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    before = run(cached, cached, False)[:2]
    with torch.no_grad():
        cached.weight.mul_(2)
    for a, b in zip(before, run(cached, cached, False)[:2]):
        assert torch.equal(a, b)
