"""Kernels that only eager code launches build for Hopper on a machine
without a GPU.

The lowering tests (``test_lowering.py``) build the TTIR of every kernel
a lowered op launches; the Triton interpreter (``test_triton_interpreted.py``)
runs the kernels' arithmetic but accepts Python that Triton's compiler
refuses (a module global that is not a ``tl.constexpr``, for one).  The
kernels eager code alone launches are built here for sm_90
(:func:`cuda_trace.ttir_launches`); nothing runs.
"""

import pytest
import torch

pytest.importorskip("triton")

from cuda_trace import ttir_launches  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_many_builds_for_hopper(dtype, fmt):
    """``te.fsdp.precompute_scales``' one launch for every FP8-current shard."""
    from transformer_engine_compile.kernels import triton_cast_many as tm

    xs = [torch.randn(64, 128).to(dtype), torch.randn(7, 300).to(dtype)]
    with ttir_launches() as built:
        outs = tm.quantize_fp8_many(xs, torch.ones(2), fmt, fmt == "e5m2", 0.0)
    assert built == ["_cast_many_kernel"]
    assert [tuple(d.shape) for d, _ in outs] == [(64, 128), (7, 300)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_grouped_casts_build_for_hopper(fmt):
    """The per-expert FP8 kernels of ``te.GroupedLinear`` (kernels/triton_grouped.py),
    each call one launch through its compiled handle."""
    from transformer_engine_compile.kernels import triton_grouped as tg
    from transformer_engine_compile.module.grouped.padding import padded_sources

    sizes = torch.tensor([5, 0, 40])
    rows = torch.repeat_interleave(torch.arange(3), sizes)
    x = torch.randn(45, 256).to(torch.bfloat16)
    sources = padded_sources(sizes.cumsum(0).to(torch.int32), rows, 16)[0]
    with ttir_launches() as built:
        amax = tg.amax_grouped(x, 3, group_of_row=rows)
        scale, scale_inv = tg.current_scales_grouped(amax, fmt, False, 0.0)
        data, t = tg.cast_fp8_grouped(x, scale, fmt, group_of_row=rows, columns_from=sources)
        tg.cast_fp8_grouped(x, scale, fmt, group_of_row=rows)
        w = torch.randn(3, 64, 256).to(torch.bfloat16).view(192, 256)
        tg.amax_grouped(w, 3, rows_per_group=64)
        wdata, wt = tg.cast_fp8_grouped(w, scale, fmt, rows_per_group=64, transpose_groups=True)
    assert built == ["_grouped_amax_kernel", "_grouped_scales_kernel", "_token_cast_t_kernel",
                     "_grouped_cast_kernel", "_grouped_amax_kernel", "_stacked_cast_t_kernel"]
    assert data.shape == (45, 256) and t.shape == (256, sources.shape[0])
    assert wdata.shape == (192, 256) and wt.shape == (3, 256, 64)


def test_launch_key_tells_apart_what_triton_specializes_on():
    """``triton_launch.args_key``: a pointer's dtype and 16-byte alignment,
    an int's 1 / multiple-of-16 / int32 range, a bool apart from an int,
    constexpr values as they are."""
    from transformer_engine_compile.kernels.triton_launch import args_key

    x = torch.zeros(64)
    assert args_key((x, 32, 7)) == args_key((torch.ones(8), 48, 9))
    assert args_key((x,)) != args_key((x.to(torch.bfloat16),))
    assert args_key((x,)) != args_key((x[1:],))           # 4 bytes off 16-byte alignment
    assert args_key((x[4:],)) == args_key((x,))           # 16 bytes off: aligned
    assert len({args_key((v,)) for v in (1, 16, 17, 2 ** 31, 2 ** 31 + 1)}) == 5
    assert args_key((True,)) != args_key((1,))
    assert args_key((448.0, "e4m3")) != args_key((57344.0, "e5m2"))


@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)], ids=str)
def test_blockwise_cast_of_gathered_rows_builds_for_hopper(usage):
    """The MoE blockwise path's cast of tokens read through the padded
    layout's row map (``kernels.quantize_fp8_blockwise_rows``), one launch."""
    from transformer_engine_compile.kernels import triton_block as tbk

    sources = torch.full((512,), -1, dtype=torch.int32)
    sources[:300] = torch.arange(300, dtype=torch.int32)
    with ttir_launches() as built:
        out = tbk.quantize_fp8_blockwise_rows(torch.randn(300, 256).bfloat16(), sources, "e4m3",
                                              False, 0.0, *usage)
    assert built == ["_fp8_block_rows_kernel"]
    assert ("rowwise_data" in out) == usage[0] and ("columnwise_data" in out) == usage[1]
