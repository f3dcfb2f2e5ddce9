"""Fast CUDA paths (Triton quantization, cuBLAS GEMMs) against the reference
on the same GPU: quantization bit for bit, GEMMs within accumulation
rounding; and no host synchronisation inside a training step.  Skips
without CUDA; qa/L0_gpu/test.sh runs it on a GPU machine."""

import contextlib

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import kernels
from transformer_engine_compile.kernels import reference as ref
from transformer_engine_compile.quantization.cuda_gemm import gemm_path
from transformer_engine_compile.quantization.gemm import gemm, gemm_reference

from conftest import STATELESS, USAGES, USAGE_IDS
from test_linear import RECIPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
triton = pytest.importorskip("triton") if torch.cuda.is_available() else None


@contextlib.contextmanager
def reference_kernels():
    kernels.set_fast_kernels(False)
    try:
        yield
    finally:
        kernels.set_fast_kernels(True)


def _same_bits(a, b):
    """Equal bytes, NaN matching any NaN (its sign bit is not specified)."""
    if a.element_size() == 1 and a.dtype != torch.uint8:
        nan = torch.isnan(a.float()) & torch.isnan(b.float())
        return torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(
        torch.nan_to_num(a, nan=1.5), torch.nan_to_num(b, nan=1.5)))


def _special(shape, dtype):
    x = torch.randn(shape, device="cuda") * 4
    x[torch.rand(shape, device="cuda") < 0.01] *= 1e4  # outliers
    x[:, :32] = 0  # all-zero blocks
    x[1, 40] = float("nan")
    x[2, 50] = float("inf")
    x[3, 60] = float("-inf")
    x[4, 64:96] = 1e-39  # subnormal block (fp32)
    x[5, 100] = 3e38
    return x.to(dtype)


FAST = ["fp8_current_e4m3", "fp8_current_e5m2", "fp8_current_pow2", "mxfp8_e4m3",
        "mxfp8_e5m2", "block_1d", "block_2d", "block_1d_nopow2_e5m2"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("data", ["random", "special"])
@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", FAST)
def test_fast_quantize_equals_reference(name, usage, data, dtype):
    shape = (384, 640)
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3 if data == "random" \
        else _special(shape, dtype)
    q = STATELESS[name](*usage)
    fast = q.quantize(x).buffers()
    with reference_kernels():
        slow = q.quantize(x).buffers()
    assert list(fast) == list(slow)
    for k in fast:
        assert fast[k].shape == slow[k].shape and fast[k].dtype == slow[k].dtype, k
        assert _same_bits(fast[k], slow[k]), f"{name} {k} differs"


@pytest.mark.parametrize("shape", [(200, 384), (1, 128), (130, 256), (4096, 1024)], ids=str)
@pytest.mark.parametrize("name", ["fp8_current_e4m3", "block_1d", "mxfp8_e4m3"])
def test_fast_quantize_rowwise_odd_token_counts(name, shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = STATELESS[name](True, False)
    fast = q.quantize(x).buffers()
    with reference_kernels():
        slow = q.quantize(x).buffers()
    for k in fast:
        assert _same_bits(fast[k], slow[k]), k


@pytest.fixture(params=["one_launch", "two_launches", "more_programs_than_fit"])
def current_launch(request, monkeypatch):
    """Current scaling in one launch (counter slots, kernels/grid_state.py),
    in two (no slot), and in one whose grid far exceeds what the GPU holds
    at once (64 programs of 8 warps per SM: most start only after others
    finished, which the claimed amax tiles must survive).  Every slot is
    left zeroed for the next kernel."""
    from transformer_engine_compile.kernels import grid_state
    from transformer_engine_compile.kernels import triton_current as tc
    if request.param == "two_launches":
        monkeypatch.setattr(grid_state, "slot", lambda device: None)
    elif request.param == "more_programs_than_fit":
        monkeypatch.setattr(tc, "_CURRENT_PROGRAMS_PER_SM", 64)
    yield request.param
    torch.cuda.synchronize()
    assert all(int(p.count_nonzero()) == 0 for p in grid_state._POOLS.values())


@pytest.mark.parametrize("fmt,pow2,eps", [("e4m3", False, 0.0), ("e5m2", True, 1e-3)])
@pytest.mark.parametrize("shapes", [((384, 640), (640, 640)), ((1, 128), (4096, 1024)),
                                    ((4097, 200), (7, 200)), ((300, 5632), (2048, 5632))],
                         ids=str)
def test_fast_quantize_pair_equals_two_reference_quantizes(shapes, fmt, pow2, eps,
                                                           current_launch):
    """The x/W pair kernel: both matrices' buffers bit for bit as two reference
    quantizes, for mixed dtypes, every usage pairing and special values."""
    from transformer_engine_compile.kernels import triton_current as tq
    a = _special(shapes[0], torch.bfloat16) if shapes[0][0] > 5 and shapes[0][1] > 100 \
        else torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16)
    b = torch.randn(shapes[1], device="cuda", dtype=torch.float32) * 7
    for a_usage, b_usage in [((True, True), (True, True)), ((True, False), (True, True)),
                             ((True, True), (False, True)), ((False, True), (True, False))]:
        fast = tq.quantize_fp8_current_pair(a, b, fmt, pow2, eps, a_usage, b_usage)
        slow = ref.quantize_fp8_current_pair(a, b, fmt, pow2, eps, a_usage, b_usage)
        for f, s_ in zip(fast, slow):
            assert sorted(f) == sorted(s_)
            for k in f:
                assert f[k].shape == s_[k].shape and _same_bits(f[k], s_[k]), (k, a_usage, b_usage)


@pytest.mark.parametrize("shapes", [((256, 384), (640, 384)), ((128, 1024), (128, 1024)),
                                    ((4096, 2048), (5632, 2048)), ((200, 256), (256, 256))],
                         ids=str)
def test_fast_block_pair_equals_two_reference_quantizes(shapes):
    """The blockwise x/W pair kernel (one launch): both matrices' buffers
    bit for bit as two reference quantizes, for 1x128 and 128x128 tiles on
    either side, every usage pairing (x's columnwise copy only where its
    rows are whole blocks, as the quantizer pairs it), mixed dtypes,
    special values and scales padded (K/128 = 3, N/128 = 5)."""
    from transformer_engine_compile.kernels import triton_block as tbk
    x = _special(shapes[0], torch.bfloat16)
    w = torch.randn(shapes[1], device="cuda", dtype=torch.float32) * 7
    whole = shapes[0][0] % 128 == 0
    for fmt, pow2, eps in (("e4m3", True, 0.0), ("e5m2", False, 1e-3)):
        for x_flags, w_flags in (((False, True, whole), (True, True, True)),
                                 ((False, True, False), (True, True, False)),
                                 ((True, whole, whole), (False, True, True)),
                                 ((False, False, whole), (True, False, True))):
            if not any(x_flags[1:]) or (x_flags[0] and not whole):
                continue
            fast = tbk.quantize_fp8_blockwise_pair(x, w, fmt, pow2, eps, x_flags, w_flags)
            slow = ref.quantize_fp8_blockwise_pair(x, w, fmt, pow2, eps, x_flags, w_flags)
            for f, s_ in zip(fast, slow):
                assert sorted(f) == sorted(s_)
                for k in f:
                    assert f[k].shape == s_[k].shape and _same_bits(f[k], s_[k]), (k, x_flags)


@pytest.mark.parametrize("cols", [256, 7168])
def test_fast_block_cast_of_gathered_rows_equals_reference(cols):
    """The MoE blockwise path's cast of tokens gathered into groups padded to
    128-row tiles (``quantize_fp8_blockwise_rows``): every buffer bit for bit
    the reference's (the gather, zeros for padding, then the 1x128 cast),
    special values, an empty group and trailing padding included."""
    from transformer_engine_compile.kernels import triton_block as tbk
    t = _special((300, cols), torch.bfloat16)
    sources = torch.full((896,), -1, dtype=torch.int32, device="cuda")
    sources[:130] = torch.arange(130, dtype=torch.int32, device="cuda")
    sources[384:554] = torch.arange(130, 300, dtype=torch.int32, device="cuda")
    for fmt, pow2, eps in (("e4m3", True, 0.0), ("e5m2", False, 1e-3)):
        for usage in ((True, False), (False, True), (True, True)):
            fast = tbk.quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, *usage)
            slow = ref.quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, *usage)
            assert sorted(fast) == sorted(slow)
            for k in fast:
                assert fast[k].shape == slow[k].shape and _same_bits(fast[k], slow[k]), (k, usage)


@pytest.mark.parametrize("shape", [(1, 16), (4097, 200), (4096, 2048), (300, 5632)], ids=str)
def test_fast_current_scaling_equals_reference(shape, current_launch):
    from transformer_engine_compile.kernels import triton_current as tq
    x = _special(shape, torch.bfloat16) if shape[0] > 5 and shape[1] > 100 \
        else torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for fmt, pow2, eps, usage in [("e4m3", False, 0.0, (True, True)),
                                  ("e5m2", True, 1e-3, (True, False)),
                                  ("e4m3", False, 0.0, (False, True))]:
        fast = tq.quantize_fp8_current(x, fmt, pow2, eps, *usage)
        slow = ref.quantize_fp8_current(x, fmt, pow2, eps, *usage)
        assert sorted(fast) == sorted(slow)
        for k in fast:
            assert fast[k].shape == slow[k].shape and _same_bits(fast[k], slow[k]), (k, usage)


def test_current_scaling_on_two_streams_at_once():
    """Each stream has its own counter slot: one-launch quantizations queued
    on two streams, which may run at the same time, stay exact."""
    from transformer_engine_compile.kernels import triton_current as tq
    xs = [torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * s for s in (1, 100)]
    want = [ref.quantize_fp8_current(x, "e4m3", False, 0.0, True, True) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    got = [[], []]
    for _ in range(20):
        for i, (s, x) in enumerate(zip(streams, xs)):
            with torch.cuda.stream(s):
                got[i].append(tq.quantize_fp8_current(x, "e4m3", False, 0.0, True, True))
    torch.cuda.synchronize()
    for w, outs in zip(want, got):
        for out in outs:
            assert all(_same_bits(out[k], w[k]) for k in w)


def test_current_scaling_keeps_two_launches_in_cuda_graphs():
    """While a CUDA graph is captured no counter slot is handed out (a
    replay costs no host time; two launches are the faster on the GPU),
    and the captured quantization replays exactly."""
    from transformer_engine_compile.kernels import grid_state
    from transformer_engine_compile.kernels import triton_current as tq
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    want = ref.quantize_fp8_current(x, "e4m3", False, 0.0, True, True)
    tq.quantize_fp8_current(x, "e4m3", False, 0.0, True, True)  # compiled before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert grid_state.slot(x.device) is None
        out = tq.quantize_fp8_current(x, "e4m3", False, 0.0, True, True)
    g.replay()
    torch.cuda.synchronize()
    assert all(_same_bits(out[k], want[k]) for k in want)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shapes", [((384, 640), (640, 640)), ((4097, 2048), (2048, 2048)),
                                    ((3, 200), (5632, 200))], ids=str)
def test_norm_side_amax_then_pair_cast_equals_two_quantizes(shapes, rms):
    """The norm kernel with ``side=W`` (W's partial maxima after y's, same
    launch) and the pair cast from those partials: y, mean, rstd as without
    ``side``, and both quantized tensors bit for bit as two reference
    quantizes of y and W, the weight holding NaN / Inf in a second run."""
    from transformer_engine_compile.kernels import triton_norm as tn, triton_quant as tq
    (m, k), wshape = shapes
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    gamma = torch.randn(k, device="cuda")
    for special in (False, True):
        w = torch.randn(wshape, device="cuda", dtype=torch.bfloat16) * 7
        if special:
            w[0, 1], w[-1, -1] = float("inf"), float("nan")
        y, mean, rstd = tn.norm_forward(x, gamma, None, 1e-5, rms)
        y2, mean2, rstd2, parts, n_y = tn.norm_forward(x, gamma, None, 1e-5, rms, True, w)
        assert _same_bits(y2, y) and _same_bits(rstd2, rstd)
        for usage in [((True, True), (True, True)), ((True, False), (True, True))]:
            fast = tq.quantize_fp8_current_pair_from_parts(y2, w, parts, n_y, "e4m3", False,
                                                           0.0, *usage)
            slow = ref.quantize_fp8_current_pair(y, w, "e4m3", False, 0.0, *usage)
            for f, s_ in zip(fast, slow):
                assert sorted(f) == sorted(s_)
                for key in f:
                    assert f[key].shape == s_[key].shape and _same_bits(f[key], s_[key]), \
                        (key, usage, special)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", ["layernorm_bias", "rmsnorm"])
@pytest.mark.parametrize("shape", [(384, 640), (4097, 2048), (3, 200), (1000, 4096)], ids=str)
def test_norm_writing_fp8_equals_norm_then_quantize(shape, norm, dtype):
    """Delayed scaling's fused norm (``norm_forward_fp8``): y when asked, mean,
    rstd, the FP8 copies, scale_inv and the recorded amax bit for bit as the
    norm kernel followed by the reference quantize of its y, in both FP8
    formats, with the scale and amax in slot 1 of the layer's vectors (off
    16-byte alignment), columnwise or not, with Inf / NaN in x, for bf16 and
    fp32 input (the FP8 store's vector width follows x's, see the kernel)."""
    from transformer_engine_compile.kernels import triton_norm as tn
    m, k = shape
    rms = norm == "rmsnorm"
    gamma = torch.randn(k, device="cuda")
    beta = None if rms else torch.randn(k, device="cuda")
    for special in (False, True):
        x = torch.randn(m, k, device="cuda", dtype=dtype) * 3
        if special:
            x[0, 1], x[-1, -1] = float("inf"), float("nan")
        y, mean, rstd = tn.norm_forward(x, gamma, beta, 1e-5, rms)
        for fmt, columnwise, with_y in (("e4m3", True, False), ("e5m2", True, True),
                                        ("e4m3", False, True)):
            scales = torch.tensor([2.0, 0.75 if fmt == "e4m3" else 96.0], device="cuda")
            want_amax = torch.zeros(2, device="cuda")
            want = ref.quantize_fp8_tensorwise(y, scales[1], fmt, True, columnwise,
                                               want_amax[1])
            amaxes = torch.zeros(2, device="cuda")
            y2, mean2, rstd2, got = tn.norm_forward_fp8(x, gamma, beta, 1e-5, rms, scales[1],
                                                        fmt, columnwise, amaxes[1], with_y)
            assert (y2 is not None) == with_y and (y2 is None or _same_bits(y2, y))
            assert _same_bits(rstd2, rstd) and (rms or _same_bits(mean2, mean))
            assert sorted(got) == sorted(want)
            for key in want:
                assert got[key].shape == want[key].shape and _same_bits(got[key], want[key]), \
                    (key, fmt, special)
            assert _same_bits(amaxes, want_amax), (amaxes, want_amax)


def test_fast_amax_and_delayed_scaling_equal_reference():
    x = _special((256, 512), torch.bfloat16)
    assert torch.isnan(kernels.get("amax", x)(x))
    y = torch.randn(300, 500, device="cuda") * 7
    assert torch.equal(kernels.get("amax", y)(y), ref.amax(y))
    for fmt in ("e4m3", "e5m2"):
        outs = []
        for fast in (True, False):
            kernels.set_fast_kernels(fast)
            try:
                amax = torch.zeros(1, device="cuda")
                q = te.Float8Quantizer(torch.full((1,), 3.0, device="cuda"), amax, fmt)
                outs.append((q.quantize(y).buffers(), amax.clone()))
            finally:
                kernels.set_fast_kernels(True)
        (f, fa), (s, sa) = outs
        assert torch.equal(fa, sa)
        for k in f:
            assert _same_bits(f[k], s[k]), k


def test_fast_quantize_strided_input():
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16).t()  # non-contiguous (384, 512)
    q = STATELESS["block_1d"](True, True)
    fast = q.quantize(x).buffers()
    with reference_kernels():
        slow = q.quantize(x).buffers()
    for k in fast:
        assert _same_bits(fast[k], slow[k]), k


# -- GEMMs --------------------------------------------------------------------------
def _operands(rec, m=256, k=384, n=512):
    from transformer_engine_compile.quantization.factory import quantizer_for
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return (quantizer_for(rec, "input", internal=True).quantize(x),
            quantizer_for(rec, "weight", internal=True).quantize(w),
            quantizer_for(rec, "grad_output", internal=True).quantize(dy))


EXPECTED_PATH = {"fp8_current": "fp8_tensorwise", "fp8_block": "fp8_blockwise",
                 "mxfp8": "emulated_bf16", "nvfp4": "emulated_nvfp4"}


def test_emulated_nvfp4_gemm_pieces_equal_the_reference():
    """The NVFP4 GEMM's bf16 operands (values times block scales, every byte
    pattern, NaN scales included) and its epilogue equal the reference bit
    for bit on the GPU; the whole product (fprop, dgrad, wgrad with the RHT)
    agrees with the fp32 reference GEMM to fp32 accumulation rounding."""
    from transformer_engine_compile.kernels import triton_nvfp4 as tn4
    packed = torch.randint(0, 256, (130, 128), device="cuda", dtype=torch.uint8)
    scales = torch.arange(130 * 16, device="cuda").remainder(256).to(torch.uint8)
    scales = scales.reshape(130, 16).view(torch.float8_e4m3fn)
    want = ref.dequantize_nvfp4_blocks(packed, scales, torch.float32)
    assert want.isnan().any()
    packed2 = torch.randint(0, 256, (64, 320), device="cuda", dtype=torch.uint8)
    scales2 = (torch.rand(64, 40, device="cuda") * 8).to(torch.float8_e4m3fn)
    want2 = ref.dequantize_nvfp4_blocks(packed2, scales2, torch.float32)
    for dt in (torch.bfloat16, torch.float32):
        assert _same_bits(tn4.dequantize_nvfp4_blocks(packed, scales, dt), want.to(dt))
        a16, b16 = tn4.dequantize_nvfp4_blocks_pair(packed, scales, packed2, scales2, dt)
        assert _same_bits(a16, want.to(dt)) and _same_bits(b16, want2.to(dt))  # one launch
    acc = torch.randn(70, 300, device="cuda") * 1000
    for amax_a, amax_b in ((3.5, 0.02), (0.0, 7.0), (float("inf"), 1e-30)):
        aa = torch.tensor([amax_a], device="cuda")
        ab = torch.tensor([amax_b], device="cuda")
        for bias in (None, torch.randn(300, device="cuda"),
                     torch.randn(300, device="cuda").bfloat16()):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                got = tn4.nvfp4_gemm_epilogue(acc, aa, ab, bias, dt)
                assert torch.equal(got, ref.nvfp4_gemm_epilogue(acc, aa, ab, bias, dt))
    xq, wq, gq = _operands(RECIPES["nvfp4"], m=512)
    for a, au, b, bu in ((xq, "rowwise", wq, "rowwise"), (gq, "rowwise", wq, "columnwise"),
                         (gq, "columnwise", xq, "columnwise")):
        fast = gemm(a, au, b, bu, torch.float32)
        slow = gemm_reference(a, au, b, bu, torch.float32)
        assert ((fast - slow).abs().max() / slow.abs().max()).item() < 1e-5, (au, bu)


@pytest.mark.parametrize("name", list(EXPECTED_PATH))
def test_fast_gemm_matches_reference(name):
    xq, wq, gq = _operands(RECIPES[name])
    expected = EXPECTED_PATH[name]
    if expected == "fp8_blockwise" and torch.cuda.get_device_capability() != (9, 0):
        expected = "reference"
    assert gemm_path(xq, wq, torch.bfloat16) == expected
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    for a, au, b, bu, bias_, fa in ((xq, "rowwise", wq, "rowwise", bias, True),
                                    (gq, "rowwise", wq, "columnwise", None, False),
                                    (gq, "columnwise", xq, "columnwise", None, False)):
        fast = gemm(a, au, b, bu, torch.bfloat16, bias_, fast_accum=fa)
        slow = gemm_reference(a, au, b, bu, torch.bfloat16, bias_)
        assert fast.shape == slow.shape and fast.dtype == slow.dtype
        rel = ((fast.float() - slow.float()).norm() / slow.float().norm()).item()
        assert rel < 1e-2, (au, bu, rel)


@pytest.mark.parametrize("k,n", [(512, 512), (384, 640)], ids=str)
def test_block_scaled_gemms_read_the_stored_scales_without_copies(k, n):
    """The 1x128 scales are stored as cuBLAS reads them (blocks outer), and
    the 128x128 ones with their blocks padded to a multiple of 4, so fprop,
    dgrad and wgrad are one ``scaled_mm`` call each: no copy of a scale
    (each cost a kernel, an allocation and ~15 us of host time), also where
    K/128 or N/128 is not a multiple of 4."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLAS block-scaled FP8 GEMM: sm_90 only")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    xq, wq, gq = _operands(RECIPES["fp8_block"], m=256, k=k, n=n)
    for a, au, b, bu in ((xq, "rowwise", wq, "rowwise"), (gq, "rowwise", wq, "columnwise"),
                         (gq, "columnwise", xq, "columnwise")):  # cuBLAS skips the padding
        want = gemm_reference(a, au, b, bu, torch.float32)
        assert ((gemm(a, au, b, bu, torch.float32) - want).norm() / want.norm()).item() < 1e-3
    for a, au, b, bu in ((xq, "rowwise", wq, "rowwise"), (gq, "rowwise", wq, "columnwise"),
                         (gq, "columnwise", xq, "columnwise")):
        with Ops() as ops:
            gemm(a, au, b, bu, torch.bfloat16)
        gemms = [n for n in ops.names if n.startswith("_scaled_mm")]
        writes = [n for n in ops.names if n in ("clone", "copy_", "new_zeros", "zeros", "cat",
                                                "fill_", "empty_like")]
        assert len(gemms) == 1 and writes == [], (au, bu, ops.names)


def test_fast_gemm_fp32_output_and_odd_shapes_fall_back_correctly():
    xq, wq, _ = _operands(RECIPES["fp8_current"], m=128, k=256, n=200)  # N not a multiple of 16
    out = gemm(xq, "rowwise", wq, "rowwise", torch.float32)
    ref_out = gemm_reference(xq, "rowwise", wq, "rowwise", torch.float32)
    assert torch.equal(out, ref_out)  # took the reference path
    xq, wq, _ = _operands(RECIPES["fp8_current"], m=128, k=200, n=512)  # K padded to 208
    out = gemm(xq, "rowwise", wq, "rowwise", torch.float32)
    ref_out = gemm_reference(xq, "rowwise", wq, "rowwise", torch.float32)
    assert not torch.equal(out, ref_out)  # cuBLAS, not the reference...
    assert ((out - ref_out).norm() / ref_out.norm()).item() < 1e-3  # ...within its accumulation
    xq, wq, _ = _operands(RECIPES["fp8_current"])
    out = gemm(xq, "rowwise", wq, "rowwise", torch.float32)
    assert out.dtype == torch.float32
    ref_out = gemm_reference(xq, "rowwise", wq, "rowwise", torch.float32)
    assert ((out - ref_out).norm() / ref_out.norm()).item() < 1e-3  # cuBLAS FP8 accumulation


@pytest.mark.parametrize("m", [7, 200, 4095])
@pytest.mark.parametrize("name", ["fp8_current", "fp8_block"])
def test_fast_gemm_takes_any_row_count(name, m, monkeypatch):
    """cuBLAS for every GEMM of a ragged token count: fprop and dgrad
    (tokens = A's rows: tensorwise as is, blockwise padded to 16 inside the
    GEMM) and wgrad (tokens = the inner dim: blockwise copies padded by the
    quantizer, tensorwise padded to 16 inside the GEMM)."""
    from transformer_engine_compile.quantization import cuda_gemm
    if name == "fp8_block" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLAS block-scaled FP8 GEMM: sm_90 only")
    xq, wq, gq = _operands(RECIPES[name], m=m, k=384, n=512)
    slow = gemm_reference(xq, "rowwise", wq, "rowwise", torch.bfloat16)
    slow_wgrad = gemm_reference(gq, "columnwise", xq, "columnwise", torch.float32)

    def no_reference(*args, **kwargs):
        raise AssertionError("fell back to the reference GEMM")

    monkeypatch.setattr(cuda_gemm, "gemm_reference", no_reference)
    fast = gemm(xq, "rowwise", wq, "rowwise", torch.bfloat16)
    assert fast.shape == slow.shape == (m, 512)
    assert ((fast.float() - slow.float()).norm() / slow.float().norm()).item() < 1e-2
    fast_wgrad = gemm(gq, "columnwise", xq, "columnwise", torch.float32)
    assert fast_wgrad.shape == slow_wgrad.shape == (512, 384)
    assert ((fast_wgrad - slow_wgrad).norm() / slow_wgrad.norm()).item() < 1e-3  # FP8 accumulation


def test_bf16_path_is_torch_matmul():
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemm(x, "rowwise", w, "rowwise", torch.bfloat16), x @ w.t())


# -- no host synchronisation -----------------------------------------------------------
@pytest.mark.parametrize("name", RECIPES)
def test_training_step_never_syncs_with_host(name):
    layer = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    rec = RECIPES[name]
    for _ in range(2):  # the first run compiles kernels and creates handles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with te.autocast(enabled=rec is not None, recipe=rec):
                y = layer(x)
            y.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and layer.weight.grad is not None


def test_prepare_cuda_graphs_then_manual_capture():
    ops = te.prepare_cuda_graphs()
    assert "gemm" in ops and "quantize_fp8_current" in ops
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    rec = RECIPES["fp8_current"]
    with torch.no_grad(), te.autocast(recipe=rec):
        expected = layer(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = layer(x)
        x.mul_(2)
        g.replay()
        expected2 = layer(x)
    assert not torch.equal(expected, expected2)
    assert torch.equal(out, expected2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,pow2,eps", [("e4m3", False, 0.0), ("e5m2", True, 1e-3)])
def test_cast_many_equals_one_cast_per_tensor(dtype, fmt, pow2, eps):
    """``quantize_fp8_many`` (precompute_scales' one launch for FSDP2's FP8
    shards) writes each tensor's bytes and scale_inv as the one-tensor
    current-scaling cast with the same amax does, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1024, 4096), (7, 300), (1, 1), (257, 33), (3584, 4096)]
    xs = [(torch.randn(*s, device="cuda", generator=g) * 3).to(dtype) for s in shapes]
    amaxes = torch.stack([x.abs().max().float() for x in xs])
    amaxes[1] *= 2  # another rank's larger amax
    outs = kernels.get("quantize_fp8_many", xs[0])(xs, amaxes, fmt, pow2, eps)
    for i, (x, (data, sinv)) in enumerate(zip(xs, outs)):
        one = kernels.get("quantize_fp8_current", x)(x, fmt, pow2, eps, True, False,
                                                     amaxes[i:i + 1].clone())
        assert torch.equal(data.view(torch.uint8), one["data"].view(torch.uint8))
        assert torch.equal(sinv, one["scale_inv"].reshape(1))
        assert data.data_ptr() % 16 == 0 and sinv.data_ptr() % 16 == 0
    # FSDP2 hands the scales to the FP8 GEMMs as they are: cuBLASLt takes them
    data = outs[4][0]
    a, b = data[:32], data[16:32]
    if fmt == "e4m3":  # _scaled_mm takes E4M3 x E4M3
        for i in range(len(outs)):
            si = outs[i][1]
            out = torch._scaled_mm(a, b.t(), scale_a=si, scale_b=si, out_dtype=torch.bfloat16)
            ref = torch._scaled_mm(a, b.t(), scale_a=si.clone(), scale_b=si.clone(),
                                   out_dtype=torch.bfloat16)
            assert torch.equal(out, ref)
