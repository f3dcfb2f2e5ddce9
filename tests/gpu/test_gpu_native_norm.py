"""The native eager path of ``te.LayerNormLinear`` (module/layernorm_linear_native.py):
its normalisation as a native call and node, then the layer's native linear
call, gives the Python path's bits, outputs and gradients, in the ways
users train.  Skips without CUDA."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native
    from transformer_engine_compile.module.layernorm_linear_native import NativeLayerNormLinear

CURRENT = R.Float8CurrentScaling()
BLOCK = R.Float8BlockScaling()
MX = R.MXFP8BlockScaling()
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _layer(k, n, normalization="RMSNorm", bias=False, **kw):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(k, n, bias=bias, normalization=normalization,
                               params_dtype=torch.bfloat16, device="cuda", **kw)
    with torch.no_grad():  # gamma (and beta) away from their initial values
        layer.layer_norm_weight.add_(torch.randn_like(layer.layer_norm_weight) * 0.1)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.add_(torch.randn_like(layer.layer_norm_bias) * 0.1)
    return layer


def _plans(layer):
    return [t.native for t in layer._args_memo[1].values()]


def _run(layer, x, dy, rec, native_on, steps=3, d_ln=None, optimizer=False):
    """Outputs and gradients of ``steps`` eager steps (the last step's), with
    the native path on or off; ``optimizer``: an AdamW step after each."""
    was, native.ENABLED = native.ENABLED, native_on
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2) if optimizer else None
    try:
        for _ in range(steps):
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(x.requires_grad)
            with te.autocast(recipe=rec):
                out = layer(xx)
            y, ln_out = (out if isinstance(out, tuple) else (out, None))
            loss = (y * dy).sum()
            if d_ln is not None:
                loss = loss + (ln_out * d_ln).sum()
            loss.backward()
            if opt is not None:
                opt.step()
        grads = [xx.grad] + [p.grad for p in layer.parameters()]
        return [y.detach(), None if ln_out is None else ln_out.detach(), *grads], y
    finally:
        native.ENABLED = was


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        assert g is None or torch.equal(g, w), i


def _compare(layer, x, dy, rec, **kw):
    ref = copy.deepcopy(layer)
    got, y = _run(layer, x, dy, rec, True, **kw)
    want, y_ref = _run(ref, x, dy, rec, False, **kw)
    _assert_same(got, want)
    return y, y_ref


CASES = [  # (normalization, bias, zero_centered_gamma, return_layernorm_output, shape, n)
    ("RMSNorm", False, False, False, (2, 128, 512), 384),
    ("LayerNorm", True, False, False, (256, 256), 512),
    ("LayerNorm", False, True, True, (4, 64, 512), 256),
    ("RMSNorm", True, True, True, (256, 1024), 256),
]


@pytest.mark.parametrize("rec", [CURRENT, BLOCK, MX], ids=["fp8_current", "fp8_block", "mxfp8"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_native_layernorm_linear_equals_python_bit_for_bit(ext, calls, rec, case):
    if rec is BLOCK and not _HOPPER:
        pytest.skip("the block-scaled GEMM is cuBLAS's on SM 9.0")
    normalization, bias, zcg, ret_ln, shape, n = case
    layer = _layer(shape[-1], n, normalization, bias, zero_centered_gamma=zcg,
                   return_layernorm_output=ret_ln)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    dy = torch.randn((*shape[:-1], n), device="cuda", dtype=torch.bfloat16)
    d_ln = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if ret_ln else None
    y, y_ref = _compare(layer, x, dy, rec, d_ln=d_ln)
    assert calls["native"] == 2  # calls 2 and 3 (the first builds the memo)
    assert [type(p) for p in _plans(layer)] == [NativeLayerNormLinear]
    assert y.grad_fn.name() == "TeLinearFp8Backward"
    assert y.grad_fn.next_functions[0][0].name() == "TeNormBackward"
    assert type(y_ref.grad_fn).__name__ != "TeLinearFp8Backward"


@pytest.mark.parametrize("frozen", ["input", "norm", "linear"])
def test_native_layernorm_linear_partial_gradients(ext, calls, frozen):
    """Frozen parts (an input without grad, a frozen norm, a frozen linear
    weight) plan for the gradients still needed; AdamW over 3 steps."""
    layer = _layer(512, 256, "LayerNorm", True)
    if frozen == "norm":
        layer.layer_norm_weight.requires_grad_(False)
        layer.layer_norm_bias.requires_grad_(False)
    if frozen == "linear":
        layer.weight.requires_grad_(False)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(frozen != "input")
    dy = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    _compare(layer, x, dy, CURRENT, optimizer=True)
    assert calls["native"] == 2


def test_native_layernorm_linear_eval_and_train_alternate(ext, calls):
    layer = _layer(512, 256)
    ref = copy.deepcopy(layer)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x_train = x.clone().requires_grad_()
    for _ in range(3):
        evals = []
        for lay, on in ((layer, True), (ref, False)):
            was, native.ENABLED = native.ENABLED, on
            try:
                with te.autocast(recipe=CURRENT):
                    with torch.no_grad():
                        evals.append(lay(x))
                    lay(x_train).sum().backward()
            finally:
                native.ENABLED = was
        assert torch.equal(*evals)
        assert torch.equal(layer.weight.grad, ref.weight.grad)
        assert torch.equal(layer.layer_norm_weight.grad, ref.layer_norm_weight.grad)
    assert len(_plans(layer)) == 2 and all(type(p) is NativeLayerNormLinear for p in _plans(layer))


def test_native_layernorm_linear_replaced_norm_weight_is_read(ext):
    """A replaced norm parameter drops the memo: the new one is used."""
    layer = _layer(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CURRENT):
        for _ in range(3):
            layer(x)
        layer.layer_norm_weight = torch.nn.Parameter(layer.layer_norm_weight.detach() * 2)
        got = layer(x)
        layer.__dict__["_args_memo"] = None
        was, native.ENABLED = native.ENABLED, False
        try:
            want = layer(x)
        finally:
            native.ENABLED = was
    assert torch.equal(got, want)


def test_native_layernorm_linear_declines_delayed_scaling(ext, calls):
    layer = _layer(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=R.DelayedScaling()):
        for _ in range(3):
            layer(x).sum().backward()
    assert _plans(layer) == [False] and calls["native"] == 0


def test_native_layernorm_linear_checkpointed(ext, calls):
    """Inside te.checkpoint the recomputation takes the forward's path."""
    layer = _layer(512, 256)
    ref = copy.deepcopy(layer)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for lay, on in ((layer, True), (ref, False)):
        was, native.ENABLED = native.ENABLED, on
        try:
            for _ in range(3):
                lay.zero_grad(set_to_none=True)
                with te.autocast(recipe=CURRENT):
                    y = te.checkpoint(lay, x)
                y.float().square().sum().backward()
            outs.append([y.detach(), *[p.grad for p in lay.parameters()]])
        finally:
            native.ENABLED = was
    _assert_same(*outs)
    assert calls["native"] >= 2


def test_native_layernorm_linear_declines_before_its_norm_runs(ext, calls):
    """Where the linear call may not run natively (here forward-mode AD is
    active), the norm does not run natively either: the whole layer takes
    the Python path, with the Python path's result."""
    layer = _layer(256, 256)
    ref = copy.deepcopy(layer)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=CURRENT):
        for _ in range(2):
            layer(x)  # the plan exists after the second call
        with torch.autograd.forward_ad.dual_level():
            y = layer(x)
        was, native.ENABLED = native.ENABLED, False
        try:
            want = ref(x)
        finally:
            native.ENABLED = was
    assert type(_plans(layer)[0]) is NativeLayerNormLinear and calls["native"] == 1
    assert "TeNormBackward" not in {f.name() for f, _ in y.grad_fn.next_functions if f}
    assert torch.equal(y, want)
