"""CUDA Triton kernels run by Triton's interpreter on CPU tensors (no GPU).

``TRITON_INTERPRET=1`` has to be set before the kernels are defined, so the
checks run in a fresh process (``_CHECKS``).  Covered: the bias kernels
(kernels/triton_bias.py: the add equals torch's ``out.add_(bias)`` bit for
bit in fp32 and fp16, and in bf16 up to the interpreter's conversion to bf16,
which truncates where the GPU rounds to nearest; the column sums equal an fp64 sum within fp32 summation error and are
deterministic), the norm backward's partial sums, which moved there, and
the amax kernel, alone and into a slot of a vector (exact), the norm
forward's partial maxima of y and of the weight it reads beside
(``side``), exact, and its delayed-scaling mode: the FP8 copies it writes
equal the quantize kernel's of its y (both cast by the interpreter), its
amax is exact (into a slot of a vector), and y is written only when
asked; the delayed-scaling step written over its own history, alone and
run by the cast that records an op call's last amax; the emulated NVFP4
GEMM's operand kernel (exact, every byte pattern) and epilogue.
The quantize kernels' FP8 casts differ from the GPU's in the interpreter,
so their numerics are left to tests/gpu.  Needs Triton.
"""

import os
import subprocess
import sys

import pytest


def _interpret(script: str) -> None:
    """Run ``script`` in a fresh process under Triton's interpreter; it
    prints "ok" last when every check held."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), \
        result.stdout[-2000:] + result.stderr[-4000:]


_CHECKS = r'''
import torch
from unittest import mock
from transformer_engine_compile.kernels import reference as ref, triton_bias as tb, triton_launch, triton_norm as tn
from transformer_engine_compile.kernels import triton_quant as tq

g = torch.Generator().manual_seed(0)


def trunc_bf16(t):
    """fp32 -> bf16 rounded toward zero, as Triton's interpreter converts
    (the GPU rounds to nearest even, as torch does)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


with mock.patch.object(triton_launch, "sm_count", lambda device: 4):
    for m, n in ((1, 1), (7, 200), (64, 128), (300, 257), (1000, 96)):
        for out_dtype, bias_dtype in ((torch.bfloat16, torch.bfloat16),
                                      (torch.bfloat16, torch.float32),
                                      (torch.float16, torch.float16),
                                      (torch.float32, torch.float32)):
            y = (torch.randn(m, n, generator=g) * 4).to(out_dtype)
            b = torch.randn(n, generator=g).to(bias_dtype)
            got = tb.bias_add(y.clone(), b)
            if out_dtype == torch.bfloat16:  # the interpreter truncates to bf16
                want = trunc_bf16(y.float() + trunc_bf16(b.float()).float())
            else:
                want = ref.bias_add(y.clone(), b)
            assert torch.equal(got, want), (m, n, out_dtype, bias_dtype)
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(m, n, generator=g) * 3).to(dtype)
            exact = x.double().sum(0)
            scale = x.double().abs().sum(0) + 1e-30
            for out in (torch.float32, dtype):
                got = tb.column_sum(x, out)
                assert got.shape == (n,) and got.dtype == out
                tol = 2 ** -7 if out == torch.bfloat16 else 1e-6
                assert ((got.double() - exact).abs() / scale).max() <= tol, (m, n, dtype, out)
                assert torch.equal(got, tb.column_sum(x, out))  # fixed order
        x = torch.randn(m, n, generator=g).to(torch.bfloat16)
        dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
        w = torch.randn(n, generator=g)
        _, mean, rstd = ref.norm_forward(x, w, None, 1e-5, False)
        got = tn.norm_backward(dy, x, mean, rstd, w, False, True, True, True)
        want = ref.norm_backward(dy, x, mean, rstd, w, False, True, True, True)
        for a, b in zip(got[1:], want[1:]):  # dgamma, dbeta
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-3 * (b.abs().max().item() + 1)), (m, n)
    # the forward's partial maxima, of y and of a side matrix (the weight) in the same launch
    for m, n, side_shape in ((7, 200, (96, 200)), (300, 257, (257, 1000)), (64, 128, (1, 1))):
        x = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16)
        w = torch.randn(n, generator=g)
        side = (torch.randn(*side_shape, generator=g) * 5).to(torch.bfloat16)
        side[-1, -1] = 40.0  # the largest |value| in the last tile
        for rms in (False, True):
            y, mean, rstd, parts = tn.norm_forward(x, w, None, 1e-5, rms, True)
            y2, mean2, rstd2, parts2, n_y = tn.norm_forward(x, w, None, 1e-5, rms, True, side)
            assert torch.equal(y2, y) and torch.equal(rstd2, rstd) and n_y == parts.numel()
            assert torch.equal(parts2[:n_y], parts)
            assert parts2[:n_y].max() == y.float().abs().max(), (m, n, rms)
            assert parts2[n_y:].max() == side.float().abs().max(), (m, n, side_shape)
    # delayed scaling: the FP8 copies cast as the rows are normalised, y's amax into a
    # given slot (slot 1 of the layer's vectors: pointers off 16-byte alignment), y
    # written only when asked; the same bytes as the quantize kernel gives the norm's y
    scales = torch.tensor([3.0, 7.5])
    for m, n in ((7, 200), (300, 257), (64, 128)):
        x = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16)
        w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        for rms, fmt, columnwise in ((False, "e4m3", True), (True, "e5m2", True),
                                     (True, "e4m3", False)):
            y, mean, rstd = tn.norm_forward(x, w, b, 1e-5, rms)
            want_amax = torch.zeros(2)
            want = tq.quantize_fp8_tensorwise(y, scales[1], fmt, True, columnwise,
                                              ref.AmaxSlot(want_amax, 1))
            assert want_amax[1] == y.float().abs().max() and want_amax[0] == 0
            for with_y in (True, False):
                amaxes = torch.zeros(2)
                y2, mean2, rstd2, got = tn.norm_forward_fp8(x, w, b, 1e-5, rms, scales[1], fmt,
                                                            columnwise, ref.AmaxSlot(amaxes, 1),
                                                            with_y)
                assert (y2 is not None) == with_y and (y2 is None or torch.equal(y2, y))
                assert torch.equal(rstd2, rstd) and (mean2 is None) == rms
                assert rms or torch.equal(mean2, mean)
                assert sorted(got) == sorted(want), (sorted(got), sorted(want))
                for key in want:
                    assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), \
                        (m, n, rms, fmt, key)
                assert torch.equal(amaxes, want_amax), (amaxes, want_amax)
# the amax kernel: alone, and raised into a slot of a zeroed vector (a cached
# weight's, or a quantized incoming dy's, under delayed scaling), exact
x = torch.randn(300, 384, generator=g).to(torch.bfloat16) * 3
want = x.float().abs().max()
assert torch.equal(tq.amax(x), want)
vector = torch.zeros(ref.STEP_COUNTER + 1)
vector[0] = 1.0
got = tq.amax(x, ref.AmaxSlot(vector, 1))
assert torch.equal(got, want) and vector[1] == want and vector[0] == 1.0
assert torch.count_nonzero(vector) == 2
# the delayed-scaling step written over its own history and scale, as a lowered
# op runs it once inductor reinplaces the update
for algo in ("max", "most_recent"):
    hist = torch.rand(1024, 2, generator=g) * 100
    amaxes = torch.tensor([5.0, 300.0])
    want_hist, want_scale = ref.delayed_scaling_step(hist, amaxes, "e4m3", 1, algo)
    scale = torch.full((2,), 7.0)
    tq._step_into(hist, amaxes, hist, scale, "e4m3", 1, algo)
    assert torch.equal(hist, want_hist) and torch.equal(scale, want_scale), algo
# a StepAfter run on its own (no cast records the last amax), into new buffers
# and over its own (amaxes: the op's vector, longer than the history's columns)
for in_place in (False, True):
    hist = torch.rand(16, 2, generator=g) * 100
    amaxes = torch.zeros(ref.STEP_COUNTER + 1)
    amaxes[:2] = torch.tensor([5.0, 300.0])
    want_hist, want_scale = ref.delayed_scaling_step(hist, amaxes[:2], "e5m2", 0, "max")
    scale = torch.full((2,), 7.0)
    new_hist, new_scale = (hist, scale) if in_place else (torch.empty_like(hist),
                                                          torch.empty_like(scale))
    tq.run_step(ref.StepAfter(hist, new_hist, new_scale, "e5m2", 0, "max"), amaxes)
    assert torch.equal(new_hist, want_hist) and torch.equal(new_scale, want_scale), in_place
# a cast that records the op call's last amax runs the step in its last program
# (counted in amaxes[STEP_COUNTER]), also over its own history and the scale it casts with;
# a history longer than one tile gets a step launch of its own
for in_place, algo, n_len, max_programs in ((False, "max", 1024, 2048),
                                            (True, "max", 1024, 2048),
                                            (True, "most_recent", 1024, 2048),
                                            (True, "max", 4096, 2048),
                                            (True, "max", 1024, 10)):
    tq._MAX_STEP_PROGRAMS = max_programs  # fewer than the grid's 20: a step launch of its own
    x = torch.randn(300, 512, generator=g) * 5
    hist = torch.rand(n_len, 2, generator=g) * 100
    scale = torch.tensor([3.0, 0.5])
    amaxes = torch.zeros(ref.STEP_COUNTER + 1)
    amaxes[0] = 40.0
    want_bytes = tq.quantize_fp8_tensorwise(x, scale[1].clone(), "e4m3", True, True)
    want_hist, want_scale = ref.delayed_scaling_step(
        hist, torch.stack([amaxes[0], x.abs().max()]), "e4m3", 2, algo)
    new_hist, new_scale = (hist, scale) if in_place else (torch.empty_like(hist),
                                                          torch.empty_like(scale))
    got = tq.quantize_fp8_tensorwise(x, scale[1], "e4m3", True, True, ref.AmaxSlot(
        amaxes, 1, ref.StepAfter(hist, new_hist, new_scale, "e4m3", 2, algo)))
    for key in want_bytes:
        assert torch.equal(got[key].view(torch.uint8), want_bytes[key].view(torch.uint8)), key
    assert torch.equal(new_hist, want_hist) and torch.equal(new_scale, want_scale), (in_place,
                                                                                     algo)
    counted = 20 if n_len == 1024 and max_programs > 20 else 0  # the (5, 4) grid, if fused
    assert amaxes[ref.STEP_COUNTER].view(torch.int32) == counted, (amaxes, n_len)
# the emulated NVFP4 GEMM's pieces (kernels/cuda_gemm.py): a copy's E2M1 values times its
# E4M3 block scales, exact in bf16 (so the interpreter's truncation to bf16 loses
# nothing), every code and every scale byte (subnormal, -0) but NaN, which the
# interpreter converts to 480 (tests/gpu covers it)
from transformer_engine_compile.kernels import triton_nvfp4 as tn4


for r, c in ((16, 32), (48, 160), (130, 256)):
    packed = torch.randint(0, 256, (r, c // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (r, c // 16), generator=g, dtype=torch.uint8)
    scales = torch.where(scales & 0x7F == 0x7F, scales - 1, scales).view(torch.float8_e4m3fn)
    want = ref.dequantize_nvfp4_blocks(packed, scales, torch.float32)
    assert torch.equal(want.to(torch.bfloat16).float(), want)  # exact in bf16
    for dt in (torch.bfloat16, torch.float32):
        got = tn4.dequantize_nvfp4_blocks(packed, scales, dt)
        assert got.dtype == dt and torch.equal(got.float(), want), (r, c, dt)
# its epilogue: the fp32 product divided by both per-tensor scales (edge amaxes: 0 and
# Inf give scale 1), plus the bias, rounded once (truncated to bf16 by the interpreter)
acc = torch.randn(70, 300, generator=g) * 1000
for amax_a, amax_b in ((3.5, 0.02), (0.0, 7.0), (float("inf"), 1e-30)):
    aa, ab = torch.tensor([amax_a]), torch.tensor([amax_b])
    for bias in (None, torch.randn(300, generator=g), torch.randn(300, generator=g).bfloat16()):
        want = ref.nvfp4_gemm_epilogue(acc, aa, ab, bias, torch.float32)
        assert torch.equal(tn4.nvfp4_gemm_epilogue(acc, aa, ab, bias, torch.float32), want)
        got = tn4.nvfp4_gemm_epilogue(acc, aa, ab, bias, torch.bfloat16)
        assert torch.equal(got, trunc_bf16(want)), (amax_a, amax_b)
print("ok")
'''


def test_bias_and_norm_sum_kernels_in_triton_interpreter():
    _interpret(_CHECKS)


_NVFP4_ONE_LAUNCH = r'''
import itertools
import torch
from transformer_engine_compile.kernels import triton_launch, triton_nvfp4 as tn

triton_launch.sm_count = lambda device: 4
g = torch.Generator().manual_seed(0)
pool = torch.zeros(128, dtype=torch.int32)  # one grid_state slot, zeroed
slot = (pool.data_ptr() & 0x7FFFFFFF, pool.data_ptr() >> 31)


def two_launches(x, config):
    launches, out = tn.quantize_calls(x, *config)
    for launcher, grid, key, args in launches:
        launcher.fn[grid](*args, num_warps=launcher.num_warps)
    return out


def one_launch(operands):
    # one program: the interpreter runs programs one after the other, so a
    # second would wait for the first forever
    grid, key, args, outs = tn.one_launch_call(operands, slot)
    tn._one_launch.fn[(1,)](*args, num_warps=4)
    assert not pool.any(), pool.nonzero()  # the kernel leaves its slot zeroed
    return outs


def same(a, b, what):
    assert sorted(a) == sorted(b), what
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (what, name)


w_config = (True, False, False, True, True)  # a weight's: 16x16 blocks, both copies
for (m, k), (config, seeded) in itertools.product(
        ((32, 64), (48, 160)),
        (((False, True, False, True, True), False),   # x: the RHT on its columnwise copy
         ((False, False, False, True, False), False),  # rowwise only
         ((False, True, True, False, True), True),     # dy: columnwise only, stochastic
         ((False, True, True, True, True), True))):    # both copies stochastic
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(k + 16, k, generator=g)
    torch.manual_seed(1)
    want_x, want_w = two_launches(x, config), two_launches(w, w_config)
    torch.manual_seed(1)
    got_x, got_w = one_launch(((x, config), (w, w_config)))
    same(want_x, got_x, (m, k, config, "pair x"))
    same(want_w, got_w, (m, k, config, "pair w"))
    torch.manual_seed(1)
    (alone,) = one_launch(((x, config),))
    same(want_x, alone, (m, k, config, "alone"))
print("ok")
'''


def test_nvfp4_one_launch_kernel_equals_two_launches_in_triton_interpreter():
    """The NVFP4 quantization in one launch (kernels/triton_nvfp4.py: amax
    and quantize passes with the counters of a grid_state slot), alone and
    for an x/W pair, writes the same bytes as the two-launch kernels (both
    run by the interpreter, whose FP8 casts differ from the GPU's: the
    GPU tests compare with the reference), draws its stochastic rounding's
    numbers in the same order, and leaves the slot zeroed."""
    _interpret(_NVFP4_ONE_LAUNCH)


_NVFP4_GEMM = r'''
import torch
from transformer_engine_compile.kernels import reference as ref, triton_nvfp4_gemm as tg

g = torch.Generator().manual_seed(0)


def operand(rows, k, wide):
    """A packed copy: every code, scales of one binade (each product sum then
    exact in fp32, whatever its order) or of many (wide)."""
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    if wide:
        scales = (torch.rand(rows, k // 16, generator=g) * 400 + 1e-3).to(torch.float8_e4m3fn)
    else:
        scales = torch.randint(0x38, 0x40, (rows, k // 16), generator=g, dtype=torch.uint8)
        scales = scales.view(torch.float8_e4m3fn)  # [1, 2)
    return packed, scales, torch.rand(1, generator=g) * 50


def trunc_bf16(t):  # the interpreter's fp32 -> bf16 conversion
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


for m, n, k in ((16, 32, 64), (70, 130, 272), (64, 64, 128), (130, 16, 400)):
    a, b = operand(m, k, False), operand(n, k, False)
    for bias in (None, torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()):
        want = ref.nvfp4_gemm(a, b, bias, torch.float32)
        assert torch.equal(tg.nvfp4_gemm(a, b, bias, torch.float32), want), (m, n, k)
        assert torch.equal(tg.nvfp4_gemm(a, b, bias, torch.bfloat16), trunc_bf16(want))
    # scales over many binades: the sums round, in another order than the reference's
    a, b = operand(m, k, True), operand(n, k, True)
    want = ref.nvfp4_gemm(a, b, None, torch.float32).double()
    bound = ref.nvfp4_gemm((a[0] & 0x77, a[1], a[2]), (b[0] & 0x77, b[1], b[2]), None,
                           torch.float32).double() * k * 2.0 ** -23  # |A| |B|^T, k roundings
    got = tg.nvfp4_gemm(a, b, None, torch.float32).double()
    assert ((got - want).abs() <= bound + 1e-30).all(), (m, n, k)
    assert not torch.equal(a[0] & 0x77, a[0])  # negative codes were there
# an empty product, a non-contiguous operand and a bias stride: the reference's results
a, b = operand(32, 64, False), operand(48, 64, False)
t = (a[0].t().contiguous().t(), a[1], a[2])
bias = torch.randn(96, generator=g)[::2]
assert torch.equal(tg.nvfp4_gemm(t, b, bias, torch.float32), ref.nvfp4_gemm(a, b, bias, torch.float32))
print("ok")
'''


def test_fused_nvfp4_gemm_in_triton_interpreter():
    """The emulated NVFP4 GEMM in one kernel (kernels/triton_nvfp4_gemm.py):
    where each sum of products is exact in fp32 (block scales of one
    binade) it equals ``reference.nvfp4_gemm`` bit for bit, bias and
    output rounding included; with scales over many binades it stays within
    K fp32 roundings of |A| |B|^T of it; strided inputs are copied.  The
    interpreter multiplies the tiles in fp32 (exact bf16 values, see the
    module); tests/gpu checks the bf16 tensor cores."""
    _interpret(_NVFP4_GEMM)


_GROUPED = r'''
import torch
from transformer_engine_compile.kernels import reference as ref, triton_grouped as tg

g = torch.Generator().manual_seed(0)
sizes = [0, 5, 40, 1, 0, 70]  # bands of 16 rows that hold one group, and several
rows = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
# groups 4x apart in size: a row cast with another group's scale is off by 4x or more
x = (torch.randn(sum(sizes), 300, generator=g) * 4.0 ** rows.unsqueeze(1)).to(torch.bfloat16)
x[7, 3] = float("inf")  # group 1's amax
x[50, 0] = float("nan")  # group 2's
# the padded layout of the transposed token copy: groups of 16, -1 between
from transformer_engine_compile.module.grouped.padding import padded_sources
sources = padded_sources(torch.tensor(sizes).cumsum(0).to(torch.int32), rows, 16)[0]


def close(a, b):
    # the interpreter's FP8 conversion is not the GPU's (E4M3 NaN, and a
    # binade lower at some powers of two): finite values within 2x
    assert a.dtype == b.dtype and a.shape == b.shape
    finite = torch.isfinite(b.float())
    u, v = a.float()[finite], b.float()[finite]
    assert ((u - v).abs() <= v.abs() * 0.5 + 2 ** -9).all()


for fmt in ("e4m3", "e5m2"):
    for kwargs, x2d, n in ((dict(group_of_row=rows), x, len(sizes)),
                           (dict(rows_per_group=29), x[:116], 4)):  # stacked: 4 x 29 rows
        amax, ramax = tg.amax_grouped(x2d, n, **kwargs), ref.amax_grouped(x2d, n, **kwargs)
        assert torch.equal(amax.isnan(), ramax.isnan())
        assert torch.equal(amax.nan_to_num(), ramax.nan_to_num()), (amax, ramax)
        scale = 448.0 / 4.0 ** torch.arange(n, dtype=torch.float32) / 4
        extra = (dict(columns_from=sources) if "group_of_row" in kwargs
                 else dict(transpose_groups=True))
        for more in ({}, extra):
            data, t = tg.cast_fp8_grouped(x2d, scale, fmt, **kwargs, **more)
            rdata, rt = ref.cast_fp8_grouped(x2d, scale, fmt, **kwargs, **more)
            close(data, rdata)
            assert (t is None) == (rt is None) == (not more)
            if more:
                close(t, rt)
                if "columns_from" in more:  # the padding columns: zeros
                    assert t.view(torch.uint8)[:, sources < 0].count_nonzero() == 0
# current scaling's scales from amaxes, bit for bit (fp32 arithmetic: the
# interpreter's is the GPU's): zero, subnormal, tiny, huge, Inf and NaN
# amaxes, with and without an epsilon and rounding to powers of two
amax = torch.cat([torch.tensor([0.0, 1e-45, 1e-30, 3e-3, 1.0, 448.0, 3e38, float("inf"),
                                float("nan")]), torch.rand(300, generator=g) * 1e3])
for fmt in ("e4m3", "e5m2"):
    for pow2, eps in ((False, 0.0), (True, 0.0), (False, 1e-3), (True, 1e-12)):
        got, want = tg.current_scales_grouped(amax, fmt, pow2, eps), \
            ref.current_scales_grouped(amax, fmt, pow2, eps)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (fmt, pow2, eps, a, b)
print("ok")
'''


def test_grouped_fp8_quantize_in_triton_interpreter():
    """The per-group kernels (kernels/triton_grouped.py): every group's amax
    equal to the reference's, the casts (rowwise, transposed into padded
    token groups, transposed per stacked group) as the reference's: zero-row
    groups, Inf and NaN, by row index and by stacked rows; the finite casts
    within 2x (the interpreter's conversion; bit equality is tests/gpu's);
    current scaling's scales and their reciprocals bit for bit."""
    _interpret(_GROUPED)


_CAST_MANY = r'''
import torch
from unittest import mock
from transformer_engine_compile.kernels import reference as ref, triton_launch
from transformer_engine_compile.kernels import triton_quant as tq, triton_cast_many as tm
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for fmt, pow2, eps in (("e4m3", False, 0.0), ("e5m2", True, 1e-3)):
        shapes = [(64, 128), (7, 300), (1, 1), (257, 33), (3, 5000)]
        xs = [(torch.randn(*s, generator=g) * 3).to(dtype) for s in shapes]
        xs[2].zero_()  # amax 0: scale 1
        amaxes = torch.stack([x.abs().max().float() for x in xs])
        amaxes[1] = amaxes[1] * 2  # a given amax above the tensor's own (another rank's)
        outs = tm.quantize_fp8_many(xs, amaxes, fmt, pow2, eps)
        for i, (x, (d, si)) in enumerate(zip(xs, outs)):
            one = tq.quantize_fp8_current(x, fmt, pow2, eps, True, False, amax=amaxes[i:i + 1].clone())
            assert d.shape == x.shape and si.shape == (1,), (d.shape, si.shape)
            # as a tensor of its own: the FP8 GEMMs refuse unaligned operands and scales
            assert d.data_ptr() % 16 == 0 and si.data_ptr() % 16 == 0, i
            assert torch.equal(d.view(torch.uint8), one["data"].view(torch.uint8)), (dtype, fmt, i)
            assert torch.equal(si, one["scale_inv"].reshape(1)), (si, one["scale_inv"])
            r = ref.quantize_fp8_many([x], amaxes[i:i + 1], fmt, pow2, eps)[0]
            assert torch.equal(r[1], si)
        # an empty tensor among them: the reference, the same results
        e = tm.quantize_fp8_many([xs[0], xs[0][:0]], amaxes[:2], fmt, pow2, eps)
        assert e[1][0].numel() == 0 and torch.equal(e[1][1], e[0][1] * 0 + e[1][1])
print("ok")
'''


def test_fp8_cast_many_equals_one_tensor_casts_in_triton_interpreter():
    """kernels/triton_cast_many.py (``te.fsdp.precompute_scales``' one launch
    for every FP8-current shard): each tensor's bytes and ``scale_inv``
    equal the one-tensor cast's with the same given amax (both cast by the
    interpreter), bf16 and fp32 sources, both formats, power-of-two scales
    with an epsilon, a zero tensor, sizes off the program's block, a
    given amax above the tensor's own; an empty tensor goes through the
    reference."""
    _interpret(_CAST_MANY)


_BLOCK_ROWS = r'''
import torch
from transformer_engine_compile.kernels import reference as ref, triton_block as tbk
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    t = (torch.randn(300, 384, generator=g) * 3).to(dtype)
    t[7] = 0  # a zero row: scale 1
    # a padded layout of 3 groups (130, 0 and 170 rows) rounded up to 128-row
    # tiles, an empty group a tile of padding, the tail padding too
    sources = torch.full((896,), -1, dtype=torch.int32)
    sources[:130] = torch.arange(130, dtype=torch.int32)
    sources[384:554] = torch.arange(130, 300, dtype=torch.int32)
    gathered = torch.where((sources >= 0).unsqueeze(1), t[sources.clamp_min(0).long()],
                           torch.zeros((), dtype=dtype))
    for fmt, pow2, eps in (("e4m3", False, 0.0), ("e5m2", True, 1e-3)):
        for rowwise, columnwise in ((True, False), (False, True), (True, True)):
            got = tbk.quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, rowwise, columnwise)
            want = tbk.quantize_fp8_blockwise(gathered, fmt, False, pow2, eps, rowwise, columnwise)
            assert sorted(got) == sorted(want), (sorted(got), sorted(want))
            for name in want:
                a, b = got[name], want[name]
                assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
                if a.dtype.itemsize == 1:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), (dtype, fmt, rowwise, columnwise, name)
            r = ref.quantize_fp8_blockwise_rows(t, sources, fmt, pow2, eps, rowwise, columnwise)
            assert torch.equal(r[next(iter(r))].float(), ref.quantize_fp8_blockwise(
                gathered, fmt, False, pow2, eps, rowwise, columnwise)[next(iter(r))].float())
print("ok")
'''


def test_blockwise_cast_of_gathered_rows_in_triton_interpreter():
    """kernels/triton_block.py's ``quantize_fp8_blockwise_rows`` (the MoE
    blockwise path's cast of tokens into groups padded to 128-row tiles,
    reading them through the row map): every buffer equals the 1x128 cast
    of the gathered, zero-padded matrix bit for bit (both cast by the
    interpreter), rowwise, columnwise and both, empty groups and padding
    included; the reference is that gather and cast."""
    _interpret(_BLOCK_ROWS)
