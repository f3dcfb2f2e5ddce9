"""The operands te.GroupedLinear hands the FP8 blockwise grouped GEMM
(module/grouped/blockwise_gemm.py) on CPU, with the kernel's reference
(kernels/blockwise_grouped.reference) standing in for the CuTeDSL kernel:
the tile schedules, the stacked weight's views against each expert
quantized alone, and whole training steps equal to the dequantized path
the layer takes without the kernel, eager and compiled.  The kernel
itself runs in tests/gpu/test_gpu_blockwise_grouped_gemm.py."""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.kernels import blockwise_grouped as kernel
from transformer_engine_compile.kernels.reference import FP8_BLOCK
from transformer_engine_compile.module.grouped import blocked, blockwise_gemm
from transformer_engine_compile.module.grouped.padding import padded_offsets
from transformer_engine_compile.quantization.factory import quantizer_for

T = FP8_BLOCK
SIZES = [(5, 0, 130, 16), (128, 128, 0, 256), (0, 0, 0, 7)]


@pytest.mark.parametrize("sizes", SIZES)
def test_tile_schedules(sizes):
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    tokens = sum(sizes)
    pad_offs = padded_offsets(offs, tokens, T)
    size = int(pad_offs[-1])
    tiles = blockwise_gemm._row_tiles(offs, pad_offs, size).tolist()
    k_tiles = blockwise_gemm._k_tiles(offs, pad_offs).tolist()
    start, want, want_k = 0, [], []
    for g, n in enumerate(sizes):
        used = -(-n // T)
        span = (int(pad_offs[g]) - start) // T
        want += [g] * used + [-1] * (span - used)
        want_k.append([start // T, start // T + used])
        start = int(pad_offs[g])
    assert tiles == want and k_tiles == want_k


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_stacked_weight_views_equal_each_expert_quantized_alone(usage):
    w = torch.randn(3, 256, 384) * torch.tensor([1.0, 30.0, 0.01]).view(3, 1, 1)
    quantizers = _quantizers(te.recipe.Float8BlockScaling())
    wq = blockwise_gemm._quantize_weight(quantizers["weight"], w.bfloat16(),
                                         usage == "rowwise", usage == "columnwise")
    data, scales = (blockwise_gemm._rowwise_weight(wq, 3) if usage == "rowwise" else
                    blockwise_gemm._columnwise_weight(wq._columnwise_data,
                                                      wq._columnwise_scale_inv, 3))
    for g in range(3):
        alone = quantizers["weight"].usage_variant(usage == "rowwise", usage == "columnwise") \
            .quantize(w[g].bfloat16()).fp8_operand(usage)
        assert torch.equal(data[g].view(torch.uint8), alone[0].view(torch.uint8))
        blocks = alone[1][:, :data.shape[2] // T]
        assert torch.equal(scales[g][:, :blocks.shape[1]], blocks)


def _quantizers(rec):
    return {role: quantizer_for(rec, role) for role in ("input", "weight", "grad_output")}


def _layer():
    torch.manual_seed(0)
    layer = te.GroupedLinear(4, 256, 384, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def _step(layer, x, sizes, dy, step=None):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = (layer if step is None else step)(x, torch.tensor(sizes))
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("sizes", SIZES[:2])
def test_training_step_equals_the_dequantized_path(stand_in_kernel, sizes):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 256, generator=g).bfloat16()
    dy = torch.randn(sum(sizes), 384, generator=g).bfloat16()
    layer = _layer()
    with te.autocast(recipe=te.recipe.Float8BlockScaling()):
        got = _step(layer, x, sizes, dy)
    assert stand_in_kernel == [False, False, True]  # fprop, dgrad, wgrad
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockwise_gemm, "applies", lambda *a: False)
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            want = _step(layer, x, sizes, dy)
    for a, b in zip(got, want):
        # the same FP8 operands and scales; fp32 sums in another order
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_compiled_equals_eager_on_the_kernel_path(stand_in_kernel):
    torch._dynamo.reset()
    layer = _layer()
    step = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for seed, sizes in enumerate(SIZES[:2]):
        g = torch.Generator().manual_seed(10 + seed)
        x = torch.randn(sum(sizes), 256, generator=g).bfloat16()
        dy = torch.randn(sum(sizes), 384, generator=g).bfloat16()
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            eager = _step(layer, x, sizes, dy)
            compiled = _step(layer, x, sizes, dy, step)
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b)


def test_the_kernel_path_needs_whole_blocks_and_the_default_tiles():
    x = torch.zeros(4, 256)
    q = _quantizers(te.recipe.Float8BlockScaling())
    # never on CPU tensors
    assert not blockwise_gemm.applies(x, 256, 384, q["input"], q["weight"], q["grad_output"])
    other = _quantizers(te.recipe.Float8BlockScaling(x_block_scaling_dim=2))
    assert not blockwise_gemm._is_blockwise(other["input"], 1)
    assert blocked.blockwise_gemm is blockwise_gemm


@pytest.mark.parametrize("sizes", SIZES)
def test_the_cast_of_gathered_rows_equals_the_cast_of_the_scattered_ones(sizes):
    """The padded layout read through ``sources`` (the kernel path's casts)
    is the one ``dest`` scatters into: every buffer of the 1x128 cast equal."""
    from transformer_engine_compile.kernels import reference as ref
    from transformer_engine_compile.module.grouped.compute import group_ids
    from transformer_engine_compile.module.grouped.padding import padded_sources, scatter_rows
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    t = torch.randn(sum(sizes), 256).bfloat16()
    sources, dest, _ = padded_sources(offs, group_ids(offs, t.shape[0]), T)
    want = ref.quantize_fp8_blockwise(scatter_rows(t, dest, sources.shape[0]), "e4m3", False,
                                      False, 0.0, True, True)
    got = ref.quantize_fp8_blockwise_rows(t, sources, "e4m3", False, 0.0, True, True)
    for name, buf in want.items():
        assert torch.equal(got[name].view(torch.uint8) if buf.dtype.itemsize == 1 else got[name],
                           buf.view(torch.uint8) if buf.dtype.itemsize == 1 else buf), name


def _saved_tensors(layer, x, sizes):
    """The tensors autograd keeps from one forward (pack hook)."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            layer(x.detach().requires_grad_(), torch.tensor(sizes))
    return kept


def test_the_kernel_path_keeps_fp8_copies_not_x_and_w(stand_in_kernel):
    """The backward reads the forward's columnwise FP8 copies of x and W (1
    byte per element, quantized once) instead of x and W themselves."""
    sizes = (5, 0, 130, 16)
    layer = _layer()
    x = torch.randn(sum(sizes), 256).bfloat16()
    kept = _saved_tensors(layer, x, sizes)
    fp8 = [t for t in kept if t.dtype == torch.float8_e4m3fn]
    shapes = blockwise_gemm.kept_shapes(sum(sizes), 4, 256, 384)
    assert sorted(t.shape for t in fp8) == sorted([shapes["x"], shapes["w"]])
    assert not any(t.dtype == torch.bfloat16 and t.shape in (x.shape, layer.weight.shape)
                   for t in kept)
    # save_original_weight: W itself, quantized again in the backward
    layer.save_original_weight = True
    kept = _saved_tensors(layer, x, sizes)
    assert any(t is layer.weight or (t.shape == layer.weight.shape
                                     and t.dtype == torch.bfloat16) for t in kept)
    assert [t.shape for t in kept if t.dtype == torch.float8_e4m3fn] == [shapes["x"]]


@pytest.mark.parametrize("save_original_weight", [False, True])
def test_kernel_path_ops_pass_opcheck(stand_in_kernel, save_original_weight):
    """Real and fake agree on the kept copies' layout (both ops)."""
    from test_grouped_linear import _opcheck_both_ops

    sizes = (5, 0, 130, 16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes), 256, generator=g).bfloat16()
    dy = torch.randn(sum(sizes), 384, generator=g).bfloat16()
    saved = _opcheck_both_ops(te.recipe.Float8BlockScaling(), _layer(), sizes, x, dy,
                              save_original_weight)
    assert saved.dtype == torch.float8_e4m3fn  # x's columnwise copy


@pytest.mark.parametrize("grouped_k", [False, True])
def test_the_gemms_run_persistent_ctas(monkeypatch, grouped_k):
    """fprop, dgrad and wgrad run persistent CTAs (measured faster at every
    expert shape): the configuration the runner gets says so, one cached
    object per choice."""
    seen = []
    monkeypatch.setattr(kernel, "run_kernel", lambda cfg, inputs: seen.append(cfg) or [None])
    fp8 = torch.float8_e4m3fn
    a, b = torch.empty(128, 4096, dtype=fp8), torch.empty(2, 128, 4096, dtype=fp8)
    sched = torch.zeros(2, 2, dtype=torch.int32)  # wgrad: 2 groups over 32 K tiles
    kernel.grouped_gemm(a, b, None, None, sched, grouped_k, torch.bfloat16)
    wide = {"tma_store": True, "tile_m": 192} if grouped_k else {}
    assert seen[0].as_dict()["persistent"] is True
    assert seen[0] is kernel.config(grouped_k, fp8, fp8, torch.bfloat16, **wide)
    assert kernel.config(grouped_k, fp8, fp8, torch.bfloat16, persistent=False) not in seen


@pytest.mark.parametrize("groups", [8, 3])
def test_wgrad_takes_the_tall_tma_store_tiles(monkeypatch, groups):
    """wgrad's persistent CTAs compute 192 x 128 tiles with three consumer
    warpgroups and store them through TMA (measured faster over short and
    long K alike); fprop and dgrad never (their rows are mapped, their
    weights' scales 128x128)."""
    seen = []
    monkeypatch.setattr(kernel, "run_kernel", lambda cfg, inputs: seen.append(cfg) or [None])
    fp8 = torch.float8_e4m3fn
    a, b = torch.empty(256, 16 * 128, dtype=fp8), torch.empty(384, 16 * 128, dtype=fp8)
    kernel.grouped_gemm(a, b, None, None, torch.zeros(groups, 2, dtype=torch.int32), True,
                        torch.float32)
    assert seen[-1] is kernel.config(True, fp8, fp8, torch.float32, tma_store=True, tile_m=192)
    cfg = seen[-1].as_dict()
    assert (cfg["tile_m"], cfg["tile_n"], cfg["tma_store"]) == (192, 128, True)
    # the 128 x 192 tiles stay a configuration of their own
    assert kernel.config(True, fp8, fp8, torch.float32, tma_store=True,
                         tile_n=192).as_dict()["tile_m"] == 128
    # the options exist for persistent wgrad alone
    assert kernel.config(False, fp8, fp8, torch.float32, tma_store=True).as_dict()[
        "tma_store"] is False
    assert kernel.config(True, fp8, fp8, torch.float32, persistent=False,
                         tma_store=True).as_dict()["tma_store"] is False
    with pytest.raises(ValueError, match="TMA-store wgrad only"):
        kernel.config(False, fp8, fp8, torch.float32, tile_n=192)
    with pytest.raises(ValueError, match="TMA-store wgrad only"):
        kernel.config(False, fp8, fp8, torch.float32, tile_m=192)
    with pytest.raises(TypeError, match="128 x 192 or 192 x 128"):
        kernel.config(True, fp8, fp8, torch.float32, tma_store=True, tile_n=256)
    with pytest.raises(TypeError, match="128 x 192 or 192 x 128"):  # 192 x 192: no registers
        kernel.config(True, fp8, fp8, torch.float32, tma_store=True, tile_m=192, tile_n=192)


def test_compiles_fullgraph_where_the_kernel_cannot_run(monkeypatch):
    """A CUDA layer on a machine without the kernel (no nvidia-cutlass-dsl):
    torch.compile(fullgraph=True) does not trace the warning, and the op's
    run says why once; the dequantized path's results, compiled as eager."""
    monkeypatch.setattr(blockwise_gemm, "_on_cuda", lambda t: True)
    monkeypatch.setattr(blockwise_gemm, "_unavailable_reason", lambda: "no DSL on this machine")
    blockwise_gemm._say_once.cache_clear()
    torch._dynamo.reset()
    layer = _layer()
    step = torch.compile(layer, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    sizes = SIZES[0]
    x = torch.randn(sum(sizes), 256, generator=g).bfloat16()
    dy = torch.randn(sum(sizes), 384, generator=g).bfloat16()
    with te.autocast(recipe=te.recipe.Float8BlockScaling()):
        with pytest.warns(UserWarning, match="no DSL on this machine") as said:
            compiled = _step(layer, x, sizes, dy, step)
        eager = _step(layer, x, sizes, dy)
    assert len([w for w in said if "no DSL" in str(w.message)]) == 1
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    blockwise_gemm._say_once.cache_clear()
