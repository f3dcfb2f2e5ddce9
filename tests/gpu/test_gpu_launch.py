"""The cached Triton launcher and the kernels added with it (partial-amax
current scaling, delayed-scaling step, MXFP8 dequantization) against the
reference on the same GPU.  Skips without CUDA."""

import pytest
import torch

from transformer_engine_compile import kernels
from transformer_engine_compile.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import triton_block as tbk, triton_quant as tq
    from transformer_engine_compile.kernels.triton_launch import Launcher, _Handle


def _bits_equal(a, b):
    if a.element_size() == 1 and a.dtype != torch.uint8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(torch.nan_to_num(a, nan=1.5) if a.is_floating_point() else a,
                       torch.nan_to_num(b, nan=1.5) if b.is_floating_point() else b)


@pytest.mark.parametrize("shape", [(8192, 2048), (33, 4096), (17, 16)], ids=str)
def test_current_scaling_many_partials_equals_reference(shape):
    """More tiles than amax programs (grid-stride partials), and fewer."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    x[-1, -1] = 1000.0  # the max sits in the last tile
    fast = tq.quantize_fp8_current(x, "e4m3", False, 0.0, True, True)
    slow = ref.quantize_fp8_current(x, "e4m3", False, 0.0, True, True)
    for k in slow:
        assert _bits_equal(fast[k], slow[k]), k


def test_given_scale_records_amax_into_slot():
    x = torch.randn(300, 512, device="cuda") * 5
    slot = torch.zeros(1, device="cuda")
    fast = tq.quantize_fp8_tensorwise(x, torch.tensor([2.0], device="cuda"), "e4m3", True, True,
                                      amax_out=slot)
    slow = ref.quantize_fp8_tensorwise(x, torch.tensor([2.0], device="cuda"), "e4m3", True, True)
    assert torch.equal(slot, x.abs().amax().reshape(1))
    for k in slow:
        assert _bits_equal(fast[k], slow[k]), k


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scaling_step_equals_reference(algo, margin):
    hist = torch.rand(1024, 3, device="cuda") * 100
    amaxes = torch.tensor([5.0, 0.0, float("nan")], device="cuda")
    hist[7, 1] = float("inf")
    fast = tq.delayed_scaling_step(hist, amaxes, "e4m3", margin, algo)
    slow = ref.delayed_scaling_step(hist, amaxes, "e4m3", margin, algo)
    for f, s in zip(fast, slow):
        assert f.shape == s.shape and _bits_equal(f, s)


@pytest.mark.parametrize("n_len", [1024, 16384])
def test_delayed_scaling_step_in_place_equals_reference(n_len):
    """The step kernel written over its own history (what a lowered op does
    once inductor reinplaces it): each column is read before it is rolled."""
    hist = torch.rand(n_len, 2, device="cuda") * 100
    amaxes = torch.tensor([5.0, 300.0], device="cuda")
    want_hist, want_scale = ref.delayed_scaling_step(hist, amaxes, "e4m3", 0, "max")
    scale = torch.full((2,), 7.0, device="cuda")
    tq._step_into(hist, amaxes, hist, scale, "e4m3", 0, "max")
    assert _bits_equal(hist, want_hist) and _bits_equal(scale, want_scale)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shape", [(300, 512), (8192, 4096)], ids=str)
def test_cast_runs_the_delayed_step_after_the_last_amax(shape, in_place):
    """The cast recording an op call's last amax runs the step in the program
    that finishes last: the other programs' maxima are all in (a large grid,
    the max in the last tile), and with the step written over the history and
    the scale the cast reads, every program still casts with the old scale."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 5
    x[-1, -1] = 900.0
    hist = torch.rand(1024, 2, device="cuda") * 100
    scale = torch.tensor([3.0, 0.25], device="cuda")
    amaxes = torch.zeros(ref.STEP_COUNTER + 1, device="cuda")
    amaxes[0] = 40.0
    want_bytes = tq.quantize_fp8_tensorwise(x, scale[1].clone(), "e4m3", True, True)
    want_hist, want_scale = ref.delayed_scaling_step(
        hist, torch.stack([amaxes[0], x.float().abs().max()]), "e4m3", 0, "max")
    new_hist, new_scale = ((hist, scale) if in_place else
                           (torch.empty_like(hist), torch.empty_like(scale)))
    got = tq.quantize_fp8_tensorwise(x, scale[1], "e4m3", True, True, ref.AmaxSlot(
        amaxes, 1, ref.StepAfter(hist, new_hist, new_scale, "e4m3", 0, "max")))
    for key in want_bytes:
        assert _bits_equal(got[key], want_bytes[key]), key
    assert _bits_equal(new_hist, want_hist) and _bits_equal(new_scale, want_scale)


@pytest.mark.parametrize("algo,margin,in_place", [("max", 0, False), ("max", 1, True),
                                                   ("most_recent", 0, True)])
@pytest.mark.parametrize("shapes,b_usage", [
    (((300, 512), (256, 512)), (True, False)), (((4096, 2048), (2048, 2048)), (True, True)),
    (((4096, 1024), None), (False, False)), (((8192, 2048), (2048, 2048)), (True, False)),
    (((300, 512), (256, 512)), (False, False))], ids=str)
def test_delayed_casts_in_one_launch_equal_two(shapes, b_usage, algo, margin, in_place):
    """Delayed scaling's casts of an op call in one launch (x and W, or dy
    alone; kernels/triton_delayed.py) equal the two-launch kernels with a
    zeroed amax vector bit for bit: the FP8 copies, the stepped history and
    scale (written over the ones the casts read, or into new buffers), with
    the max in the last tile.  The counter slot is zero again after each
    call, so a second call on the same stream is right too.  A grid of
    over 2048 programs takes the two launches.  W without copies: its amax
    alone (a forward reading the FP8 weight cache)."""
    from transformer_engine_compile.kernels import grid_state, triton_delayed as td
    a = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16) * 5
    a[-1, -1] = 900.0
    b = None if shapes[1] is None else torch.randn(shapes[1], device="cuda",
                                                   dtype=torch.bfloat16) * 0.1
    a_usage = (True, True)
    launches, real = [], td._fp8_delayed_launch
    tiles = sum(-(-m // 64) * -(-k // 128) for m, k in filter(None, shapes))
    for call in range(2):
        hist = torch.rand(16, 2, device="cuda") * 100
        scale = torch.tensor([3.0, 0.25], device="cuda") * (call + 1)
        want_hist, want_scale = hist.clone(), scale.clone()
        want = ref.delayed_casts(tq.quantize_fp8_tensorwise, a, b, want_scale, "e4m3", a_usage,
                                 b_usage, ref.StepAfter(want_hist, want_hist, want_scale, "e4m3",
                                                        margin, algo))
        new_hist, new_scale = ((hist, scale) if in_place else
                               (torch.empty_like(hist), torch.empty_like(scale)))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(td, "_fp8_delayed_launch",
                       lambda *args: (launches.append(1), real(*args))[1])
            got = td.quantize_fp8_delayed(a, b, scale, "e4m3", a_usage, b_usage, ref.StepAfter(
                hist, new_hist, new_scale, "e4m3", margin, algo))
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            for key in (w or {}):
                assert _bits_equal(g[key], w[key]), (call, key)
        assert _bits_equal(new_hist, want_hist) and _bits_equal(new_scale, want_scale), call
        torch.cuda.synchronize()
        assert not grid_state.pool(a.device).any()
    assert len(launches) == (2 if tiles <= 2048 else 0)


def test_given_scale_records_amax_into_a_slot_of_a_vector():
    x = torch.randn(300, 512, device="cuda") * 5
    amaxes = torch.zeros(3, device="cuda")
    tq.quantize_fp8_tensorwise(x, torch.tensor([2.0], device="cuda"), "e4m3", True, False,
                               amax_out=ref.AmaxSlot(amaxes, 1))
    assert torch.equal(amaxes, torch.stack([amaxes[0] * 0, x.abs().amax(), amaxes[0] * 0]))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rowwise", [True, False])
def test_mxfp8_dequantize_equals_reference(rowwise, out_dtype):
    x = torch.randn(256, 384, device="cuda") * 10
    x[:32, :32] = 0
    x[40, 40] = float("nan")
    q = ref.quantize_mxfp8(x, "e4m3", True, True)
    key = "rowwise" if rowwise else "columnwise"
    data, scale = q[f"{key}_data"], q[f"{key}_scale_inv"]
    fast = tbk.dequantize_mxfp8(data, scale, rowwise, out_dtype)
    slow = ref.dequantize_mxfp8(data, scale, rowwise).to(out_dtype)
    assert fast.dtype == out_dtype and _bits_equal(fast, slow)
    assert kernels.get("dequantize_mxfp8", data) is tbk.dequantize_mxfp8


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mxfp8_dequantize_pair_equals_two_reference_dequantizes(out_dtype):
    """An emulated GEMM's two MXFP8 operands dequantized in one launch, for
    every pairing of rowwise and columnwise copies and unequal shapes."""
    x = torch.randn(256, 384, device="cuda") * 10
    x[:32, :32] = 0
    x[40, 40] = float("nan")
    w = torch.randn(640, 384, device="cuda", dtype=torch.bfloat16)
    qx, qw = (ref.quantize_mxfp8(t, "e4m3", True, True) for t in (x, w))
    for a_row, b_row in ((True, True), (True, False), (False, True), (False, False)):
        parts = []
        for q, row in ((qx, a_row), (qw, b_row)):
            key = "rowwise" if row else "columnwise"
            parts += [q[f"{key}_data"], q[f"{key}_scale_inv"], row]
        fast = tbk.dequantize_mxfp8_pair(*parts, out_dtype)
        slow = ref.dequantize_mxfp8_pair(*parts, out_dtype)
        assert all(f.dtype == out_dtype and _bits_equal(f, s_) for f, s_ in zip(fast, slow))
    assert kernels.get("dequantize_mxfp8_pair", x) is tbk.dequantize_mxfp8_pair


@pytest.mark.parametrize("shapes", [((256, 384), (640, 384)), ((4096, 2048), (5632, 2048)),
                                    ((40, 96), (64, 96))], ids=str)
def test_mxfp8_pair_equals_two_reference_quantizes(shapes):
    """The MXFP8 x/W pair kernel: both matrices' buffers bit for bit as two
    reference quantizes, for every usage pairing, both formats, mixed
    dtypes and special values."""
    x = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16) * 30
    x[:32, :32] = 0
    x[3, 7] = float("nan")
    x[5, 9] = float("inf")
    w = torch.randn(shapes[1], device="cuda") * 1e-3
    whole = shapes[0][0] % 32 == 0 and shapes[1][0] % 32 == 0
    for fmt in ("e4m3", "e5m2"):
        for x_usage, w_usage in (((True, True), (True, True)), ((True, True), (True, False)),
                                 ((True, False), (False, True)), ((False, True), (True, True))):
            if not whole and (x_usage[1] or w_usage[1]):
                continue  # columnwise copies take whole blocks of rows (padded before)
            fast = tbk.quantize_mxfp8_pair(x, w, fmt, x_usage, w_usage)
            slow = ref.quantize_mxfp8_pair(x, w, fmt, x_usage, w_usage)
            for f, s_ in zip(fast, slow):
                assert sorted(f) == sorted(s_)
                assert all(f[k].shape == s_[k].shape and _bits_equal(f[k], s_[k]) for k in f)


def test_launcher_caches_a_handle_and_check_mode_catches_a_wrong_key():
    launch = Launcher(tq._amax_kernel)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    key = tq._x_key(x, 64, 256)
    outs = []
    for _ in range(2):  # first call compiles through kernel[grid], second through the handle
        out = torch.zeros(1, dtype=torch.float32, device="cuda")
        launch((1, 1), key, x, 64, 256, out, 0, 64, 256)
        outs.append(out)
    assert all(torch.equal(o, x.abs().amax().float().reshape(1)) for o in outs)
    handle = launch.handles[(torch.cuda.current_device(), key)]
    assert isinstance(handle, _Handle)  # no Triton launch hooks in the test run
    checked = Launcher(tq._amax_kernel)
    checked.check = True
    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    checked((1, 1), key, x, 64, 256, out, 0, 64, 256)
    with pytest.raises(RuntimeError, match="two compiled kernels"):
        checked((1, 1), key, x.float(), 64, 256, out, 0, 64, 256)  # same key, other dtype
