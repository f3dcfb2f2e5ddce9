"""The CUDA grouped GEMMs of te.GroupedLinear's FP8 current scaling
(module/grouped/fp8_gemm.py), run on CPU against an emulation of
``torch._scaled_grouped_mm`` that enforces the CUDA kernel's rules (E4M3,
row-major left and column-major right operands, the rowwise scale layouts,
and the 2-D x 2-D case's device asserts: non-empty groups, all but the last
a multiple of 16 long).  A layout or padding mistake fails here; the kernel
itself is checked on a GPU (tests/gpu/test_gpu_grouped_linear.py)."""

import pytest
import torch

from transformer_engine_compile.module.grouped import fp8_gemm
from transformer_engine_compile.module.grouped.compute import group_ids
from transformer_engine_compile.module.grouped.padding import padded_offsets, padded_sources
from transformer_engine_compile.module.grouped.quantize import (dequantize_experts,
                                                                dequantize_rows,
                                                                quantize_experts, quantize_tokens)

E, IN, OUT = 4, 48, 32


def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None,
                                use_fast_accum=False):
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert a.stride(-1) == 1, "mat_a must be row-major"
    assert b.stride(-2) == 1, "mat_b must be column-major"
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    assert offs.dtype == torch.int32 and out_dtype == torch.bfloat16
    assert scale_a.dtype == scale_b.dtype == torch.float32
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    ends = offs.tolist()
    if b.dim() == 3:  # 2-D x 3-D: groups of rows
        assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous()
        assert scale_b.shape == (b.shape[0], b.shape[2]) and scale_b.stride(1) == 1
        out = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            acc = a[s:e].float() @ b[g].float()
            out[s:e] = acc * scale_a[s:e, None] * scale_b[g][None, :]
        return out.to(out_dtype)
    groups, m, n = offs.shape[0], a.shape[0], b.shape[1]  # 2-D x 2-D: groups along K
    assert scale_a.shape == (m * groups,) and scale_b.shape == (n * groups,)
    deltas = [e - s for s, e in zip(starts, ends)]
    assert all(d > 0 for d in deltas), "the kernel asserts non-empty groups"
    assert all(d % 16 == 0 for d in deltas[:-1]), "the kernel asserts 16-aligned groups"
    assert ends[-1] <= a.shape[1]
    out = torch.zeros(groups, m, n)
    for g, (s, e) in enumerate(zip(starts, ends)):
        acc = a[:, s:e].float() @ b[s:e].float()
        out[g] = acc * scale_a[g * m:(g + 1) * m, None] * scale_b[g * n:(g + 1) * n][None, :]
    return out.to(out_dtype)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm)


class _Q:
    def __init__(self, fmt):
        self.fp8_format, self.force_pow_2_scales, self.amax_epsilon = fmt, False, 0.0


def _operands(sizes, grad_format="e4m3", seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows = group_ids(offs, tokens)
    x = (torch.randn(tokens, IN, generator=g) * (rows + 1).unsqueeze(1)).to(torch.bfloat16)
    w = torch.randn(E, OUT, IN, generator=g).to(torch.bfloat16)
    dy = torch.randn(tokens, OUT, generator=g).to(torch.bfloat16)
    sources, _, pad_offs = padded_sources(offs, rows, fp8_gemm.ALIGN)
    xq = quantize_tokens(x, rows, E, _Q("e4m3"), columns_from=sources)
    wq = quantize_experts(w, _Q("e4m3"), transposed=True)
    dyq = quantize_tokens(dy, rows, E, _Q(grad_format), columns_from=sources)
    return offs, pad_offs, rows, xq, wq, dyq


def _close(actual, expected):
    """The same products summed in fp32, the scales applied before or after
    the sum: equal up to one bf16 rounding of the result."""
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=1e-5)


SIZES = [(5, 0, 11, 16), (0, 0, 0, 40), (16, 16, 16, 16), (1, 17, 33, 0)]


@pytest.mark.parametrize("sizes", SIZES, ids=["ragged", "one-expert", "aligned", "odd"])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_grouped_fp8_gemms_match_the_dequantized_reference(emulated, sizes, grad_format):
    offs, pad_offs, rows, xq, wq, dyq = _operands(sizes, grad_format)
    x, w = dequantize_rows(xq.data, xq.scale_inv, rows), dequantize_experts(wq.data, wq.scale_inv)
    dy = dequantize_rows(dyq.data, dyq.scale_inv, rows)
    _close(fp8_gemm.fprop(xq.data, xq.scale_inv, wq.data, wq.scale_inv, rows, offs),
           torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    _close(fp8_gemm.dgrad(dyq.data, dyq.scale_inv, wq.transposed, wq.scale_inv, rows, offs),
           torch._grouped_mm(dy, w, offs=offs))
    dw = fp8_gemm.wgrad(dyq.transposed, dyq.scale_inv, xq.transposed, xq.scale_inv, pad_offs)
    _close(dw, torch._grouped_mm(dy.t(), x, offs=offs))
    for g, n in enumerate(sizes):  # an expert without tokens gets a zero gradient
        assert torch.count_nonzero(dw[g]) == 0 if n == 0 else torch.count_nonzero(dw[g]) > 0


def test_padded_offsets_meet_the_kernel_rules():
    for sizes in SIZES + [(15, 1, 0, 32)]:
        tokens = sum(sizes)
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        pad = padded_offsets(offs, tokens, 16)
        lengths = torch.diff(pad, prepend=pad.new_zeros(1))
        assert pad.dtype == torch.int32 and int(pad[-1]) == -(-tokens // 16) * 16 + 16 * E
        assert (lengths >= torch.tensor(sizes)).all() and (lengths >= 16).all()
        assert (lengths[:-1] % 16 == 0).all()


def test_e5m2_never_reaches_the_fp8_kernel(monkeypatch):
    """HYBRID's E5M2 gradients take the bf16 GEMM on their FP8 values."""
    def refuse(*args, **kwargs):
        raise AssertionError("E5M2 sent to the E4M3-only kernel")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", refuse)
    offs, pad_offs, rows, xq, wq, dyq = _operands((5, 0, 11, 16), "e5m2")
    assert dyq.data.dtype == torch.float8_e5m2
    assert fp8_gemm.dgrad(dyq.data, dyq.scale_inv, wq.transposed, wq.scale_inv, rows,
                          offs).shape == (32, IN)
    assert fp8_gemm.wgrad(dyq.transposed, dyq.scale_inv, xq.transposed, xq.scale_inv,
                          pad_offs).shape == (E, OUT, IN)


def test_transposed_copies_are_the_rowwise_ones():
    """The casts' transposed copies (what the backward GEMMs read): x's
    tokens in 16-aligned groups with zeros between, W per expert."""
    offs, pad_offs, rows, xq, wq, _ = _operands((5, 0, 11, 16))
    _, dest, _ = padded_sources(offs, rows, fp8_gemm.ALIGN)
    xt = xq.transposed.view(torch.uint8)
    assert xt.shape == (IN, int(pad_offs[-1]))
    assert torch.equal(xt[:, dest].t(), xq.data.view(torch.uint8))
    pad = torch.ones(xt.shape[1], dtype=torch.bool)
    pad[dest] = False
    assert pad.sum() > 0 and xt[:, pad].count_nonzero() == 0
    assert torch.equal(wq.transposed.view(torch.uint8),
                       wq.data.view(torch.uint8).transpose(1, 2))


def test_fp8_values_are_exact_in_bfloat16():
    """The bf16 fallback's premise: every E4M3 and E5M2 value is a bf16 value."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = values[torch.isfinite(values)]
        assert torch.equal(finite.to(torch.bfloat16).float(), finite)
