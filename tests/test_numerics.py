"""Quantize/dequantize error of every format against bounds derived here,
independently of the kernels: from the format definitions in DESIGN.md s.4."""

import math

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.kernels import reference as ref

from conftest import ALL

FP8 = {"e4m3": (448.0, 3, -9), "e5m2": (57344.0, 2, -16)}  # max, mantissa bits, min subnormal exp


def _inputs():
    """Named (M, K) fp32 tensors that stress scaling: outliers, zeros, extremes."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(256, 256, generator=g)
    out = {"normal": base.clone()}
    x = base.clone()
    x[torch.rand(x.shape, generator=g) < 0.002] *= 1000.0
    out["outliers"] = x
    x = base.clone()
    x[:128] = 0.0
    x[200:, 40:90] = 0.0
    out["zeros"] = x
    out["all_zero"] = torch.zeros(256, 256)
    out["tiny"] = base * 1e-30
    out["huge"] = base * 1e30
    rows = torch.logspace(-20, 20, 256).unsqueeze(1)
    out["row_magnitudes"] = base * rows
    out["col_magnitudes"] = base * rows.t()
    out["uniform_pos"] = torch.rand(256, 256, generator=g) * 3.0
    return out


INPUTS = _inputs()


def _block_amax(x, bm, bk):
    m, k = x.shape
    return x.abs().reshape(m // bm, bm, k // bk, bk).amax(dim=(1, 3)) \
        .repeat_interleave(bm, 0).repeat_interleave(bk, 1)


def _fp8_bound(x, dec_scale, fmt):
    """Rounding of one FP8 value: half an ulp relative, or half the smallest
    subnormal times the decode scale, whichever is larger."""
    _, mbits, min_sub = FP8[fmt]
    return x.abs() * 2.0 ** -(mbits + 1) + dec_scale * 2.0 ** (min_sub - 1)


def _check_fp8_like(q, x, dec_scale, fmt):
    d = q.dequantize(dtype=torch.float32)
    err = (d - x).abs()
    bound = _fp8_bound(x, dec_scale, fmt) * (1 + 1e-6)
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("usage", [(True, False), (False, True)], ids=["row", "col"])
def test_fp8_current_scaling_error_bound(name, fmt, usage):
    x = INPUTS[name]
    q = te.Float8CurrentScalingQuantizer(fmt, rowwise_usage=usage[0], columnwise_usage=usage[1])
    t = q.quantize(x)
    amax = x.abs().max().item()
    fmax = FP8[fmt][0]
    expected = 1.0 if amax == 0 else min(fmax / amax, torch.finfo(torch.float32).max)
    assert t._scale_inv.item() == pytest.approx(1.0 / expected, rel=1e-6)
    _check_fp8_like(t, x, torch.full_like(x, amax / fmax), fmt)


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["row", "col"])
def test_mxfp8_error_bound_and_scale_choice(name, fmt, rowwise):
    x = INPUTS[name]
    q = te.MXFP8Quantizer(fmt, rowwise_usage=rowwise, columnwise_usage=not rowwise)
    t = q.quantize(x)
    bm, bk = (1, 32) if rowwise else (32, 1)
    bamax = _block_amax(x, bm, bk)
    # the columnwise scales (one per 32 rows) are stored flat: (M/32, K)
    biased = t._rowwise_scale_inv if rowwise else t._columnwise_scale_inv.view(-1, x.shape[-1])
    exps = biased.to(torch.int64) - 127
    exps = exps.repeat_interleave(bk, 1) if rowwise else exps.repeat_interleave(bm, 0)
    fmax = FP8[fmt][0]
    # the scale is the smallest power of two that brings the block amax into range
    for a, e in zip(bamax.flatten()[::97].tolist(), exps.flatten()[::97].tolist()):
        if a == 0:
            assert e == -127
        else:
            assert a / 2.0 ** e <= fmax and (e == -127 or a / 2.0 ** (e - 1) > fmax)
    _check_fp8_like(t, x, torch.ldexp(torch.ones_like(x), exps), fmt)


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("rowwise", [True, False], ids=["row", "col"])
def test_fp8_blockwise_error_bound(name, dim, pow2, rowwise):
    x = INPUTS[name]
    q = te.Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=pow2,
                                rowwise_usage=rowwise, columnwise_usage=not rowwise)
    t = q.quantize(x)
    bm, bk = (128, 128) if dim == 2 else ((1, 128) if rowwise else (128, 1))
    bamax = _block_amax(x, bm, bk)
    dec = bamax / 448.0 * (2.0 if pow2 else 1.0 + 1e-6)  # pow2 rounds the scale down
    _check_fp8_like(t, x, dec, "e4m3")
    scales = t._rowwise_scale_inv if rowwise else t._columnwise_scale_inv
    if dim == 2:  # 256 x 256: two blocks a row, padded to four with zeros
        assert scales.shape == (2, 4) and torch.all(scales[:, 2:] == 0)
        scales = scales[:, :2]
    if pow2:  # every scale is an exact power of two
        mant, _ = torch.frexp(scales)
        assert torch.all(mant == 0.5)


@pytest.mark.parametrize("rows", [256, 200])
def test_fp8_blockwise_1d_scales_are_stored_as_the_gemm_reads_them(rows):
    """1x128 scales are stored blocks outer (rowwise (K/128, M), columnwise
    (Mp/128, K) flat), so the (rows, blocks) operand view the block-scaled
    GEMM takes has stride (1, rows) and ``_outer_major`` passes it on
    without a copy.  Values: the reciprocal scale of each row's block."""
    from transformer_engine_compile.quantization.cuda_gemm import _outer_major

    x = INPUTS["row_magnitudes"][:rows] * INPUTS["col_magnitudes"][:rows].sign()
    t = te.Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    k, mp = x.shape[1], -(-rows // 128) * 128

    def expected(mat):  # (R, C) -> (R, C/128) scale_inv
        r, c = mat.shape
        bamax = mat.abs().reshape(r, c // 128, 128).amax(-1)
        return torch.reciprocal(ref.compute_scale(bamax, 448.0, pow2=True))

    assert t._rowwise_scale_inv.shape == (k // 128, rows)
    assert torch.equal(t._rowwise_scale_inv, expected(x).t())
    xt = torch.nn.functional.pad(x, (0, 0, 0, mp - rows)).t()
    assert t._columnwise_scale_inv.shape == (mp // 128 * k,)
    assert torch.equal(t._columnwise_scale_inv.view(mp // 128, k), expected(xt).t())
    for usage, n in (("rowwise", rows), ("columnwise", k)):
        data, scale = t.fp8_operand(usage)
        assert scale.shape == (n, data.shape[1] // 128) and scale.stride() == (1, n)
        assert _outer_major(scale).data_ptr() == scale.data_ptr()


@pytest.mark.parametrize("shape", [(256, 384), (640, 512), (384, 1024)])
def test_fp8_blockwise_2d_scales_are_stored_padded_as_the_gemm_reads_them(shape):
    """128x128 scales keep their last dim (blocks along the reduced dim)
    padded with zeros to a multiple of 4, the layout cuBLAS reads (and
    Transformer Engine stores): rowwise (M/128, K/128), columnwise
    (K/128, M/128), each padded; the GEMM operand is the stored buffer."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]
    t = te.Float8BlockQuantizer(block_scaling_dim=2).quantize(x)
    m, k = shape[0] // 128, shape[1] // 128
    bamax = x.abs().reshape(m, 128, k, 128).amax(dim=(1, 3))
    want = torch.reciprocal(ref.compute_scale(bamax, 448.0, pow2=True))
    for scales, real in ((t._rowwise_scale_inv, want), (t._columnwise_scale_inv, want.t())):
        rows, blocks = real.shape
        assert scales.shape == (rows, -(-blocks // 4) * 4) and scales.is_contiguous()
        assert torch.equal(scales[:, :blocks], real)
        assert torch.all(scales[:, blocks:] == 0)
    for usage in ("rowwise", "columnwise"):
        data, scale = t.fp8_operand(usage)
        stored = t._rowwise_scale_inv if usage == "rowwise" else t._columnwise_scale_inv
        assert scale.data_ptr() == stored.data_ptr() and scale.shape == stored.shape
    # dequantization reads past the padding, not into it
    assert torch.equal(t.dequantize(), ref.dequantize_fp8_blockwise(t._rowwise_data, want, True))


def _nvfp4_bound(x, bm, bk):
    amax_t = x.abs().max().item()
    g = 1.0 if amax_t == 0 else min(6 * 448 / amax_t, torch.finfo(torch.float32).max)
    dec = _block_amax(x, bm, bk) / 6.0 * (1 + 2 ** -4) + 2 ** -10 / g
    return 0.25 * torch.maximum(dec, x.abs()) + 0.375 * dec + 6 * 2 ** -10 / g


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("rowwise", [True, False], ids=["row", "col"])
def test_nvfp4_error_bound(name, two_d, rowwise):
    x = INPUTS[name]
    if name in ("tiny",):  # product of fp32 scales underflows: covered separately below
        x = x * 1e20
    q = te.NVFP4Quantizer(with_2d_quantization=two_d, rowwise_usage=rowwise,
                          columnwise_usage=not rowwise)
    t = q.quantize(x)
    bm, bk = (16, 16) if two_d else ((1, 16) if rowwise else (16, 1))
    err = (t.dequantize(dtype=torch.float32) - x).abs()
    bound = _nvfp4_bound(x, bm, bk) * (1 + 1e-5)
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"


def test_nvfp4_rht_error_is_bounded_in_transformed_domain():
    x = INPUTS["outliers"]
    t = te.NVFP4Quantizer(with_rht=True, rowwise_usage=False).quantize(x)
    xt = ref.apply_rht(x.t())  # what the columnwise copy encodes
    stored = ref.dequantize_nvfp4(t._columnwise_data, t._columnwise_scale_inv.view(x.shape[-1], -1),
                                  t._columnwise_amax)
    err = (stored - xt).abs()
    assert torch.all(err <= _nvfp4_bound(xt, 1, 16) * (1 + 1e-5))
    # dequantize() undoes the transform: same accuracy as without RHT, in L2
    rel = ((t.dequantize() - x).norm() / x.norm()).item()
    assert rel < 0.12
    assert t._columnwise_amax.item() == pytest.approx(xt.abs().max().item())


def test_rht_is_orthonormal_and_keeps_wgrad_products():
    h = ref.rht_matrix()
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    assert set(h.abs().flatten().tolist()) == {0.25}
    dy, x = torch.randn(64, 32), torch.randn(64, 48)
    # columnwise copies transform along M (tokens); dW = dy^T x is unchanged
    dw = ref.apply_rht(dy.t()) @ ref.apply_rht(x.t()).t()
    assert torch.allclose(dw, dy.t() @ x, atol=1e-4)
    assert torch.allclose(ref.apply_rht(ref.apply_rht(dy.t()), inverse=True), dy.t(), atol=1e-5)


def test_e2m1_rounding_table_ties_to_even():
    v = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0, -0.75, -5.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -4.0]
    assert ref.e2m1_to_float(ref.round_to_e2m1(v)).tolist() == want


def test_fp4_pack_roundtrip_and_nibble_order():
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    packed = ref.pack_fp4(codes)
    assert packed.shape == (8, 16)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(ref.unpack_fp4(packed), codes)


def test_nvfp4_stochastic_rounding_is_unbiased_between_neighbours():
    x = torch.full((64, 4096), 2.6)  # between grid points 2 and 3
    x[:, ::16] = 6.0  # pins every block's amax to 6: decode scale exactly 1
    body = torch.ones_like(x, dtype=torch.bool)
    body[:, ::16] = False
    q = te.NVFP4Quantizer(stochastic_rounding=True, columnwise_usage=False)
    vals = torch.stack([q.quantize(x).dequantize(dtype=torch.float32)[body] for _ in range(8)])
    assert set(torch.unique(vals).tolist()) == {2.0, 3.0}
    assert vals.mean().item() == pytest.approx(2.6, abs=0.01)
    nearest = te.NVFP4Quantizer(columnwise_usage=False).quantize(x).dequantize(dtype=torch.float32)
    assert torch.all(nearest[body] == 3.0)


@pytest.mark.parametrize("name", sorted(ALL))
def test_non_finite_policy(name):
    """NaN/Inf never become finite; MX/NVFP4 poison their block, the others
    keep finite elements finite."""
    from conftest import ALL as factories
    x = torch.randn(256, 256)
    x[3, 5] = float("nan")
    x[130, 200] = float("inf")
    x[140, 10] = float("-inf")
    for r, c in ((True, False), (False, True)):
        q = factories[name](r, c)
        d = q.quantize(x).dequantize(dtype=torch.float32)
        bad = ~torch.isfinite(x)
        assert torch.all(torch.isnan(d[bad]))
        if name.startswith(("mxfp8", "nvfp4")):
            if r and name.startswith("mxfp8"):
                assert torch.all(torch.isnan(d[3, 0:32])) and torch.all(torch.isfinite(d[4]))
            assert torch.isfinite(d[~bad]).float().mean() > 0.9
        else:
            assert torch.all(torch.isfinite(d[~bad]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_and_dequantize_dtype(stateless_name, dtype):
    from conftest import STATELESS
    x = torch.randn(128, 256).to(dtype)
    t = STATELESS[stateless_name](True, True).quantize(x)
    assert t.dtype == dtype and t.dequantize().dtype == dtype
    assert t.dequantize(dtype=torch.float32).dtype == torch.float32
    rel = ((t.dequantize(dtype=torch.float32) - x.float()).norm() / x.float().norm()).item()
    limit = 0.15 if "nvfp4" in stateless_name else (0.06 if "e5m2" in stateless_name else 0.035)
    assert rel < limit


def test_leading_dims_are_flattened_consistently(stateless_name):
    from conftest import STATELESS
    x = torch.randn(4, 32, 256)
    q = STATELESS[stateless_name](True, True)
    t3 = q.quantize(x)
    assert t3.shape == x.shape
    if "rht" not in stateless_name:  # RHT columnwise is checked above
        t2 = q.quantize(x.reshape(128, 256))
        assert torch.equal(t3.dequantize().reshape(128, 256), t2.dequantize())


def test_delayed_scaling_records_amax_and_updates_scale():
    hist = torch.zeros(3, 1)
    scale = torch.ones(1)
    q = te.Float8Quantizer(scale, hist[0], "e4m3")
    x1 = torch.randn(64, 64) * 3
    t = q.quantize(x1)
    assert hist[0].item() == x1.abs().max().item()  # recorded ...
    assert t._scale_inv.item() == 1.0  # ... not used this step
    q.quantize(x1 * 0.5)
    assert hist[0].item() == x1.abs().max().item()  # running max within a step
    te.update_delayed_scaling(hist, scale, fp8_format="e4m3", margin=1)
    assert scale.item() == pytest.approx(448.0 / x1.abs().max().item() / 2)
    assert hist[0].item() == 0.0 and hist[1].item() == x1.abs().max().item()
    # most_recent uses row 0 only (here zero -> scale 1 by the zero-amax rule)
    te.update_delayed_scaling(hist, scale, amax_compute_algo="most_recent")
    assert scale.item() == 1.0
    with pytest.raises(ValueError, match="amax_compute_algo"):
        te.update_delayed_scaling(hist, scale, amax_compute_algo="mean")


@pytest.mark.parametrize("name,shape,match", [
    ("mxfp8_e4m3", (64, 48), "MXFP8 needs the last dim divisible by 32"),
    ("block_1d", (128, 100), r"FP8 blockwise \(1x128\) needs the last dim divisible by 128"),
    ("block_2d", (64, 128), r"FP8 blockwise \(128x128\) needs the flattened leading dims"),
    ("nvfp4", (32, 24), "NVFP4 needs the last dim divisible by 16"),
    ("nvfp4_2d", (8, 32), r"NVFP4 \(16x16\) needs the flattened leading dims divisible by 16"),
    ("fp8_current_e4m3", (), "cannot quantize a 0-dim tensor"),
])
def test_sizes_a_format_cannot_take(name, shape, match):
    q = ALL[name](True, True)
    with pytest.raises(ValueError, match=match):
        q.quantize(torch.randn(shape))


def test_rowwise_only_relaxes_leading_dim_requirement():
    t = te.MXFP8Quantizer(columnwise_usage=False).quantize(torch.randn(5, 64))
    assert t.shape == (5, 64)


@pytest.mark.parametrize("bad", [torch.arange(12).reshape(3, 4), torch.ones(2, 4, dtype=torch.bool),
                                 torch.ones(2, 4, dtype=torch.float64)])
def test_non_floating_or_unsupported_dtype_is_rejected(bad):
    with pytest.raises(TypeError, match="input dtype must be one of"):
        te.Float8CurrentScalingQuantizer().quantize(bad)


def test_quantizing_a_quantized_tensor_is_rejected():
    t = te.Float8CurrentScalingQuantizer().quantize(torch.randn(4, 4))
    with pytest.raises(TypeError, match="high-precision"):
        te.MXFP8Quantizer().quantize(t)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown FP8 format"):
        te.Float8CurrentScalingQuantizer("e3m4")
    with pytest.raises(ValueError, match="block_scaling_dim"):
        te.Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        te.NVFP4Quantizer(with_rht=True, with_2d_quantization=True)
    with pytest.raises(ValueError, match="neither rowwise nor columnwise"):
        te.MXFP8Quantizer(rowwise_usage=False, columnwise_usage=False).quantize(torch.randn(32, 32))


def test_empty_tensor_quantizes():
    t = te.Float8CurrentScalingQuantizer().quantize(torch.randn(0, 64))
    assert t.shape == (0, 64) and t.dequantize().shape == (0, 64)
    assert math.isclose(t._scale_inv.item(), 1.0)
