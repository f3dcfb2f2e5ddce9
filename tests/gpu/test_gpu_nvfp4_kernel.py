"""The Triton NVFP4 quantization (kernels/triton_nvfp4.py) against the
reference on the same GPU, bit for bit: every flag combination, random and
special values, stochastic rounding under one seed, odd shapes; no host
synchronisation and CUDA-graph capture.  Skips without CUDA."""

import itertools

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import kernels
from transformer_engine_compile.kernels import reference as ref

from conftest import USAGES, USAGE_IDS
from test_gpu_kernels import _same_bits, reference_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import triton_nvfp4


def _special(shape, dtype):
    x = torch.randn(shape, device="cuda") * 4
    x[torch.rand(shape, device="cuda") < 0.01] *= 1e4  # outliers
    x[:, :32] = 0  # all-zero blocks
    x[6, 32:48] = -0.0
    x[1, 40] = float("nan")
    x[2, 50] = float("inf")
    x[3, 60] = float("-inf")
    x[4, 64:96] = 1e-39  # subnormal block (fp32)
    x[16:32, 112:128] = 1e-42  # subnormal 16x16 tile
    x[5, 100] = 3e38
    return x.to(dtype)


def _wide(shape, dtype):
    """Values across many binades: one exponent per row."""
    e = torch.randint(-60, 60, (shape[0], 1), device="cuda").float()
    return (torch.randn(shape, device="cuda") * torch.exp2(e)).to(dtype)


def _input(data, shape, dtype):
    if data == "random":
        return torch.randn(shape, device="cuda", dtype=dtype) * 3
    return _special(shape, dtype) if data == "special" else _wide(shape, dtype)


def _assert_same(fast, slow):
    assert list(fast) == list(slow)
    for k in fast:
        assert fast[k].shape == slow[k].shape and fast[k].dtype == slow[k].dtype, k
        assert fast[k].is_contiguous(), k
        assert _same_bits(fast[k], slow[k]), f"{k} differs"


def _both(x, args, seed=7):
    """(fast, reference) buffers of quantize_nvfp4, each drawn under ``seed``."""
    torch.manual_seed(seed)
    fast = triton_nvfp4.quantize_nvfp4(x, *args)
    torch.manual_seed(seed)
    return fast, ref.quantize_nvfp4(x, *args)


FLAGS = list(itertools.product((False, True), repeat=3))  # block_2d, rht, stochastic
FLAG_IDS = ["-".join(n for n, on in zip(("2d", "rht", "sr"), f) if on) or "plain" for f in FLAGS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("data", ["random", "special", "wide"])
@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
def test_nvfp4_kernel_equals_reference(flags, usage, data, dtype):
    if dtype == torch.float16 and data != "random":
        pytest.skip("fp16 overflows the special values")
    x = _input(data, (384, 640), dtype)
    _assert_same(*_both(x, (*flags, *usage)))


@pytest.mark.parametrize("shape", [(16, 16), (16, 2048), (208, 384), (4096, 1024),
                                   (8192, 4096)], ids=str)
@pytest.mark.parametrize("flags", [(False, True, True), (True, False, False)], ids=["rht-sr", "2d"])
def test_nvfp4_kernel_shapes(flags, shape):
    """One tile, partial tiles, and more tiles than amax-pass programs."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    _assert_same(*_both(x, (*flags, True, True)))


def test_nvfp4_kernel_strided_input_and_fallbacks():
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16).t()  # non-contiguous
    _assert_same(*_both(x, (False, True, True, True, True)))
    empty = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    _assert_same(*_both(empty, (False, False, False, True, True)))


@pytest.mark.parametrize("name,kwargs", [
    ("plain", {}), ("rht", {"with_rht": True}), ("2d", {"with_2d_quantization": True}),
    ("rht_sr", {"with_rht": True, "stochastic_rounding": True}),
    ("sr", {"stochastic_rounding": True})])
def test_nvfp4_quantizer_fast_equals_reference(name, kwargs):
    """Through the dispatch (kernels.get) as the quantizer calls it."""
    q = te.NVFP4Quantizer(**kwargs)
    x = _special((256, 384), torch.bfloat16)
    assert kernels.get("quantize_nvfp4", x) is triton_nvfp4.quantize_nvfp4
    torch.manual_seed(3)
    fast = q.quantize(x).buffers()
    with reference_kernels():
        torch.manual_seed(3)
        slow = q.quantize(x).buffers()
    _assert_same(fast, slow)


def test_nvfp4_stochastic_rounding_is_unbiased():
    x = torch.full((64, 4096), 2.6, device="cuda")
    x[:, ::16] = 6.0  # decode scale exactly 1
    out = triton_nvfp4.quantize_nvfp4(x, False, False, True, True, False)
    vals = ref.dequantize_nvfp4(out["rowwise_data"], out["rowwise_scale_inv"], out["rowwise_amax"])
    body = vals[:, 1::16]
    assert set(torch.unique(body).tolist()) == {2.0, 3.0}
    assert body.mean().item() == pytest.approx(2.6, abs=0.01)


def test_nvfp4_kernel_never_syncs_with_host():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    for args in ((False, True, True, True, True), (True, False, False, True, True)):
        for _ in range(2):  # the first call compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                triton_nvfp4.quantize_nvfp4(x, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_nvfp4_kernel_in_cuda_graph():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    args = (False, True, False, True, True)
    triton_nvfp4.quantize_nvfp4(x, *args)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = triton_nvfp4.quantize_nvfp4(x, *args)
    x.copy_(_special((256, 512), torch.bfloat16))
    g.replay()
    _assert_same(out, ref.quantize_nvfp4(x, *args))


def _launched_kernels(fn) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("shape,programs_per_sm", [((64, 128), None), ((256, 512), None),
                                                   ((4096, 1024), 1)], ids=str)
@pytest.mark.parametrize("x_flags", [(False, True, False), (False, True, True),
                                     (False, False, False)], ids=["rht", "rht-sr", "plain"])
def test_nvfp4_pair_in_one_launch_equals_reference(monkeypatch, x_flags, shape, programs_per_sm):
    """x (1x16, the RHT on its columnwise copy) and W (16x16) quantized in
    one launch (amax and quantize passes with a grid_state slot) equal two
    reference quantizations, stochastic draws in the reference's order; the
    slot is left zeroed for the next kernel.  The large shape lifts the
    size limit and runs one program per SM, so programs claim and quantize
    many tiles each."""
    from transformer_engine_compile.kernels import grid_state
    if programs_per_sm:
        monkeypatch.setattr(triton_nvfp4, "_ONE_LAUNCH_MAX", 1 << 30)
        monkeypatch.setattr(triton_nvfp4, "_ONE_PROGRAMS_PER_SM", programs_per_sm)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    w = _special((384, shape[1]), torch.bfloat16)
    x_config, w_config = (*x_flags, True, True), (True, False, False, True, True)
    triton_nvfp4.quantize_nvfp4_pair(x, w, x_config, w_config)  # compile
    torch.manual_seed(5)
    names = _launched_kernels(lambda: triton_nvfp4.quantize_nvfp4_pair(x, w, x_config, w_config))
    quantize = [n for n in names if "nvfp4" in n]
    assert quantize == ["_nvfp4_one_kernel"], names
    torch.manual_seed(5)
    fast_x, fast_w = triton_nvfp4.quantize_nvfp4_pair(x, w, x_config, w_config)
    torch.manual_seed(5)
    slow_x, slow_w = ref.quantize_nvfp4(x, *x_config), ref.quantize_nvfp4(w, *w_config)
    _assert_same(fast_x, slow_x)
    _assert_same(fast_w, slow_w)
    torch.manual_seed(5)
    _assert_same(triton_nvfp4.quantize_nvfp4(x, *x_config), slow_x)
    lo, hi = grid_state.slot(x.device)
    start = ((hi << 31) + lo - grid_state.pool(x.device).data_ptr()) // 4
    torch.cuda.synchronize()
    assert not grid_state.pool(x.device)[start:start + grid_state.SLOT_BYTES // 4].any()


def test_nvfp4_large_calls_keep_two_launches():
    """Above ``_ONE_LAUNCH_MAX`` elements the fused passes cost more GPU
    time than a launch saves: two launches per tensor, alone and paired."""
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    config = (False, True, False, True, True)
    names = _launched_kernels(lambda: triton_nvfp4.quantize_nvfp4_pair(x, x, config, config))
    assert [n for n in names if "nvfp4" in n] == ["_nvfp4_amax_kernel", "_nvfp4_kernel"] * 2
    small = x[:256]
    names = _launched_kernels(lambda: triton_nvfp4.quantize_nvfp4(small, *config))
    assert [n for n in names if "nvfp4" in n] == ["_nvfp4_one_kernel"]


@pytest.mark.parametrize("flags", [(False, True, True), (True, False, False)], ids=["rht-sr", "2d"])
def test_nvfp4_two_launches_where_no_slot_equal_reference(monkeypatch, flags):
    """Without a counter slot (CUDA-graph capture, AOTInductor) the amax and
    quantize passes run as two launches, alone and for a pair."""
    from transformer_engine_compile.kernels import grid_state
    monkeypatch.setattr(grid_state, "slot", lambda device: None)
    x = _special((256, 384), torch.bfloat16)
    args = (*flags, True, True)
    names = _launched_kernels(lambda: triton_nvfp4.quantize_nvfp4(x, *args))
    assert [n for n in names if "nvfp4" in n] == ["_nvfp4_amax_kernel", "_nvfp4_kernel"]
    _assert_same(*_both(x, args))
    torch.manual_seed(2)
    fast = triton_nvfp4.quantize_nvfp4_pair(x, x, args, args)
    torch.manual_seed(2)
    slow = ref.quantize_nvfp4_pair(x, x, args, args)
    for a, b in zip(fast, slow):
        _assert_same(a, b)
