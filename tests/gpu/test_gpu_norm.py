"""Triton LayerNorm / RMSNorm kernels (kernels/triton_norm.py) against the
reference (kernels.reference.norm_forward / norm_backward) on the same GPU,
and te.LayerNormLinear's FP8-current-scaling forward that quantizes the
norm's output with the amax the norm kernel produced.  Skips without CUDA.

Bounds asserted, all of which held on an H200 (torch 2.11, Triton 3.6;
the maxima themselves were not recorded): the normalised output within
one unit in the last place of its dtype of the reference's (bf16: 2^-7
relative; fp32: 2^-22 relative, plus 1e-6 absolute); mean and rstd within
5e-7 relative (about 4 fp32 ulps: summation order, the kernel's rstd is
the correctly rounded 1 / sqrt); dx within one rounding to x's dtype plus
1e-5 of its largest magnitude (the kernel writes x's dtype, the reference
fp32); dgamma / dbeta within 1e-5 of the largest column sum (fp32 sums
over the rows in another order).  The amax partials and the FP8 bytes
quantized with them are exact.
"""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import kernels, recipe
from transformer_engine_compile.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import triton_norm as tn
    from transformer_engine_compile.kernels import triton_quant as tq

HIDDEN = [128, 200, 1000, 2048, 4000, 4096, 5632, 8192]
ROWS = [1, 7, 300]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -22}  # rel. spacing bound, with margin


def _inputs(m, k, dtype, gamma_dtype=None):
    x = (torch.randn(m, k, device="cuda") * 2 + 0.5).to(dtype)
    w = (torch.randn(k, device="cuda") * 0.3 + 1).to(gamma_dtype or dtype)
    b = (torch.randn(k, device="cuda") * 0.2).to(dtype)
    return x, w, b


def _rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def test_registered_for_cuda():
    x = torch.zeros(2, 8, device="cuda")
    assert kernels.get("norm_forward", x) is tn.norm_forward
    assert kernels.get("norm_backward", x) is tn.norm_backward


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
def test_forward_equals_reference(rms, dtype, k, rows):
    x, w, b = _inputs(rows, k, dtype)
    y, mean, rstd, parts = tn.norm_forward(x, w, b, 1e-5, rms, True)
    y_r, mean_r, rstd_r = ref.norm_forward(x, w, b, 1e-5, rms)
    assert y.dtype == dtype and y.shape == x.shape and rstd.shape == (rows,)
    # one rounding of the output apart at most
    diff = (y.float() - y_r.float()).abs()
    assert (diff <= ULP[dtype] * y_r.float().abs() + 1e-6).all(), diff.max()
    torch.testing.assert_close(rstd, rstd_r, rtol=5e-7, atol=0)
    if rms:
        assert mean is None
    else:
        torch.testing.assert_close(mean, mean_r, rtol=5e-7, atol=1e-7)
    # the partial maxima: their max is exactly amax(y) of this y
    assert parts.dim() == 1 and parts.shape[0] <= tq._MAX_GIVEN_PARTS
    assert torch.equal(parts.max(), ref.amax(y))
    # without the amax: the same outputs
    y2, _, rstd2 = tn.norm_forward(x, w, b, 1e-5, rms)
    assert torch.equal(y2, y) and torch.equal(rstd2, rstd)


@pytest.mark.parametrize("k", [256, 4000])
def test_forward_fp32_gamma_and_no_bias(k):
    """Zero-centred gamma arrives as fp32 (1 + gamma) with a bf16 input;
    LayerNorm without bias."""
    x, w, _ = _inputs(64, k, torch.bfloat16, torch.float32)
    for bias in (None,):
        y = tn.norm_forward(x, w, bias, 1e-6, False)[0]
        y_r = ref.norm_forward(x, w, bias, 1e-6, False)[0]
        assert ((y.float() - y_r.float()).abs() <= ULP[torch.bfloat16] * y_r.float().abs()
                + 1e-6).all()


@pytest.mark.parametrize("rows", ROWS + [4096])
@pytest.mark.parametrize("k", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
def test_backward_equals_reference(rms, dtype, k, rows):
    x, w, b = _inputs(rows, k, dtype)
    _, mean, rstd = ref.norm_forward(x, w, b, 1e-5, rms)
    dy = torch.randn(rows, k, device="cuda").to(dtype)
    dx, dw, db = tn.norm_backward(dy, x, mean, rstd, w, rms, True, True, True)
    dx_r, dw_r, db_r = ref.norm_backward(dy, x, mean, rstd, w, rms, True, True, True)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    # dx: the kernel rounds once to x's dtype
    diff = (dx.float() - dx_r).abs()
    scale = dx_r.abs().max()
    assert (diff <= ULP[dtype] * dx_r.abs() + 1e-5 * scale).all(), diff.max()
    assert _rel_max(dw, dw_r) < 1e-5
    if rms:
        assert db is None
    else:
        assert _rel_max(db, db_r) < 1e-5


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True), (False, True, True),
                                   (True, True, False)], ids=str)
def test_backward_partial_needs(needs):
    x, w, b = _inputs(100, 640, torch.bfloat16)
    _, mean, rstd = ref.norm_forward(x, w, b, 1e-5, False)
    dy = torch.randn_like(x)
    fast = tn.norm_backward(dy, x, mean, rstd, w, False, *needs)
    slow = ref.norm_backward(dy, x, mean, rstd, w, False, *needs)
    for f, s, need in zip(fast, slow, needs):
        assert (f is None) == (not need)
        if need:
            torch.testing.assert_close(f.float(), s, rtol=1e-2, atol=1e-2)


def test_backward_is_deterministic():
    x, w, b = _inputs(8192, 1024, torch.bfloat16)
    _, mean, rstd = ref.norm_forward(x, w, b, 1e-5, False)
    dy = torch.randn_like(x)
    first = tn.norm_backward(dy, x, mean, rstd, w, False, True, True, True)
    for _ in range(3):
        again = tn.norm_backward(dy, x, mean, rstd, w, False, True, True, True)
        for a, b_ in zip(first, again):
            assert torch.equal(a, b_)
    # dgamma / dbeta in the parameters' dtype: the fp32 sums rounded once
    _, dw16, db16 = tn.norm_backward(dy, x, mean, rstd, w, False, False, True, True,
                                     torch.bfloat16)
    assert dw16.dtype == db16.dtype == torch.bfloat16
    assert torch.equal(dw16, first[1].to(torch.bfloat16))
    assert torch.equal(db16, first[2].to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 300, 8192])
@pytest.mark.parametrize("fmt,pow2,eps", [("e4m3", False, 0.0), ("e5m2", False, 0.0),
                                          ("e4m3", True, 1e-3)], ids=str)
def test_quantize_with_norm_amax_equals_own_amax(fmt, pow2, eps, rows):
    """FP8 current scaling of y with the norm's partial maxima: the same
    bytes as quantizing y with its own amax pass."""
    x, w, b = _inputs(rows, 1536, torch.bfloat16)
    x[0, :7] = 300.0  # an outlier row
    y, _, _, parts = tn.norm_forward(x, w, b, 1e-5, False, True)
    given = tq.quantize_fp8_current(y, fmt, pow2, eps, True, True, parts)
    own = tq.quantize_fp8_current(y, fmt, pow2, eps, True, True)
    slow = ref.quantize_fp8_current(y, fmt, pow2, eps, True, True)
    for name in own:
        assert torch.equal(given[name].view(torch.uint8) if given[name].element_size() == 1
                           else given[name],
                           own[name].view(torch.uint8) if own[name].element_size() == 1
                           else own[name]), name
        assert torch.equal(given[name].float(), slow[name].float()), name


def test_nan_in_input_propagates_to_amax():
    x, w, b = _inputs(64, 512, torch.bfloat16)
    x[5, 3] = float("nan")
    y, _, _, parts = tn.norm_forward(x, w, b, 1e-5, True, True)
    assert torch.isnan(parts.max()) and torch.isnan(ref.amax(y))


def _layer(normalization, zero_centered_gamma=False):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(1024, 768, normalization=normalization, device="cuda",
                               zero_centered_gamma=zero_centered_gamma,
                               params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.layer_norm_weight.copy_(torch.randn(1024) * 0.2 + (0 if zero_centered_gamma
                                                                  else 1))
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.copy_(torch.randn(1024) * 0.2)
    return layer


@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zcgamma"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_norm_amax_equals_separate_quantization(normalization,
                                                                  zero_centered_gamma,
                                                                  monkeypatch):
    """te.LayerNormLinear under FP8 current scaling on CUDA: quantizing the
    norm's output with the norm kernel's amax gives the same bytes, output
    and gradients as quantizing it separately, bit for bit."""
    from transformer_engine_compile.module.layernorm import linear_ops as LO
    layer = _layer(normalization, zero_centered_gamma)
    x = torch.randn(4, 300, 1024, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(4, 300, 768, device="cuda", dtype=torch.bfloat16)
    seen = []
    real = LO._amax_fused_quantizer
    results = []
    for fused in (True, False):
        monkeypatch.setattr(LO, "_amax_fused_quantizer",
                            (lambda a: seen.append(real(a)) or seen[-1]) if fused
                            else (lambda a: None))
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            y = layer(xi)
        y.backward(dy)
        results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    assert seen and seen[0] is not None
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rec", [None, "fp8_current", "fp8_delayed", "mxfp8"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_compiled_equals_eager_cuda(normalization, rec):
    """Inductor, one graph: the op impls (Triton norm kernels inside) give
    the same bytes as eager over 2 steps."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    layer = _layer(normalization)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    r = None if rec is None else (recipe.DelayedScaling() if rec == "fp8_delayed"
                                  else recipe.by_name(rec))

    def step(x):
        with te.autocast(enabled=r is not None, recipe=r):
            return layer(x)

    x0 = torch.randn(2, 128, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.linspace(-1, 1, 768, device="cuda")
    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="inductor")):
        layer.load_state_dict(state)
        out = []
        for i in range(2):
            layer.zero_grad(set_to_none=True)
            x = (x0 * (1 + 0.1 * i)).requires_grad_()
            y = fn(x)
            (y.float() * w).sum().backward()
            out.append([y.detach().clone(), x.grad] + [p.grad.clone() for p in layer.parameters()])
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.01 * p.grad.to(p.dtype)
        runs.append(out)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    for e, c in zip(*runs):
        for a, b in zip(e, c):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_norm_modules_on_cuda_close_to_kernel(name):
    """te.LayerNorm / te.RMSNorm (plain torch, compiled by inductor) against
    the Triton kernel: the same function within one rounding."""
    mod = getattr(te, name)(4096, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.compile(mod, fullgraph=True)(x)
    y_k = tn.norm_forward(x, mod.weight, mod.bias, mod.eps, name == "RMSNorm")[0]
    assert ((y.float() - y_k.float()).abs() <= ULP[torch.bfloat16] * y_k.float().abs()
            + 1e-6).all()
