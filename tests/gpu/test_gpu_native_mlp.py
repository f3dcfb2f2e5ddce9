"""The native eager path of ``te.LayerNormMLP`` (module/layernorm_mlp_native.py):
norm, fc1, activation and fc2 as native calls and nodes give the Python
path's bits, outputs and gradients, in the ways users train.  Skips
without CUDA."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native
    from transformer_engine_compile.module.layernorm_mlp_native import NativeLayerNormMLP

CURRENT = R.Float8CurrentScaling()
BLOCK = R.Float8BlockScaling()
MX = R.MXFP8BlockScaling()
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _mlp(hidden, ffn, normalization="RMSNorm", bias=False, activation="swiglu",
         dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    layer = te.LayerNormMLP(hidden, ffn, bias=bias, normalization=normalization,
                            activation=activation, params_dtype=dtype, device="cuda", **kw)
    with torch.no_grad():  # every parameter away from its initial value
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return layer


def _plans(layer):
    return [t.native for t in layer._args_memo[1].values()]


def _outputs(layer, out):
    """(y, ln_out) of a call's result, whatever it returns."""
    if not isinstance(out, tuple):
        return out, None
    return out[0], (out[-1] if layer.return_layernorm_output else None)


def _run(layer, x, dy, rec, native_on, steps=3, d_ln=None, optimizer=False, autocast=None):
    """Outputs and gradients of ``steps`` eager steps (the last step's), with
    the native path on or off; ``optimizer``: an AdamW step after each;
    ``autocast``: a torch.autocast dtype."""
    was, native.ENABLED = native.ENABLED, native_on
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2) if optimizer else None
    try:
        for _ in range(steps):
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(x.requires_grad)
            with te.autocast(recipe=rec), torch.autocast("cuda", dtype=autocast or torch.bfloat16,
                                                         enabled=autocast is not None):
                y, ln_out = _outputs(layer, layer(xx))
            loss = (y * dy).float().sum()
            if d_ln is not None:
                loss = loss + (ln_out * d_ln).float().sum()
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


def _chain(y) -> list:
    """The autograd node names from y back along first inputs."""
    names, fn = [], y.grad_fn
    while fn is not None:
        names.append(fn.name())
        fn = next((f for f, _ in fn.next_functions if f is not None
                   and f.name() != "torch::autograd::AccumulateGrad"), None)
    return names


NATIVE_CHAIN = ["TeLinearFp8Backward", "TeActivationBackward", "TeLinearFp8Backward",
                "TeNormBackward"]

CASES = [  # normalization, bias, activation, zero_centered_gamma, ln_out, return_bias, x, ffn
    ("RMSNorm", False, "swiglu", False, False, False, (2, 128, 512), 384),
    ("LayerNorm", True, "gelu", False, False, False, (256, 256), 512),
    ("LayerNorm", False, "geglu", True, True, False, (4, 64, 512), 256),
    ("RMSNorm", True, "srelu", False, True, True, (256, 1024), 256),
    ("RMSNorm", True, "qgeglu", True, False, True, (128, 256), 256),
]


@pytest.mark.parametrize("rec", [CURRENT, BLOCK, MX], ids=["fp8_current", "fp8_block", "mxfp8"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_native_layernorm_mlp_equals_python_bit_for_bit(ext, calls, rec, case):
    if rec is BLOCK and not _HOPPER:
        pytest.skip("the block-scaled GEMM is cuBLAS's on SM 9.0")
    normalization, bias, act, zcg, ret_ln, ret_bias, shape, ffn = case
    layer = _mlp(shape[-1], ffn, normalization, bias, act, zero_centered_gamma=zcg,
                 return_layernorm_output=ret_ln, return_bias=ret_bias)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    d_ln = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if ret_ln else None
    y, y_ref = _compare(layer, x, dy, rec, d_ln=d_ln)
    assert calls["native"] == 4  # two GEMMs in calls 2 and 3 (the first builds the memo)
    assert [type(p) for p in _plans(layer)] == [NativeLayerNormMLP]
    assert _chain(y) == NATIVE_CHAIN
    assert "TeLinearFp8Backward" not in _chain(y_ref)


@pytest.mark.parametrize("frozen", ["input", "norm", "fc1", "fc2", "input+norm+fc1"])
def test_native_layernorm_mlp_partial_gradients(ext, calls, frozen):
    """Frozen parts plan for the gradients still needed; AdamW over 3 steps.
    With the input, the norm and fc1 all frozen fc2's input needs no
    gradient, and the activation records no node."""
    layer = _mlp(512, 256, "LayerNorm", True)
    parts = frozen.split("+")
    for name, p in layer.named_parameters():
        if any(name.startswith({"norm": "layer_norm", "fc1": "fc1_", "fc2": "fc2_"}.get(q, "-"))
               for q in parts):
            p.requires_grad_(False)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_("input" not in parts)
    dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    y, _ = _compare(layer, x, dy, CURRENT, optimizer=True)
    assert calls["native"] == 4
    if frozen == "input+norm+fc1":
        assert _chain(y) == ["TeLinearFp8Backward"]


def test_native_layernorm_mlp_under_torch_autocast(ext, calls):
    """fp32 parameters under torch.autocast(bf16): the casts are new tensors
    every call, the memo and the plan still serve (the key holds the
    parameters' dtype), with the Python path's bits."""
    layer = _mlp(256, 256, "LayerNorm", True, "gelu", dtype=torch.float32)
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    y, _ = _compare(layer, x, dy, CURRENT, autocast=torch.bfloat16)
    assert calls["native"] == 4 and _chain(y)[:4] == NATIVE_CHAIN  # then x's cast


def test_native_layernorm_mlp_eval_and_train_alternate(ext, calls):
    layer = _mlp(512, 256)
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
        for p, q in zip(layer.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert [type(p) for p in _plans(layer)] == [NativeLayerNormMLP] * 2


def test_native_layernorm_mlp_declines_delayed_scaling(ext, calls):
    layer = _mlp(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=R.DelayedScaling()):
        for _ in range(3):
            layer(x).sum().backward()
    assert _plans(layer) == [False] and calls["native"] == 0


def test_native_layernorm_mlp_checkpointed(ext, calls):
    """Inside te.checkpoint the recomputation takes the forward's path."""
    layer = _mlp(512, 256, "LayerNorm", True, "gelu")
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
    assert calls["native"] >= 4


def test_native_layernorm_mlp_declines_before_its_norm_runs(ext, calls):
    """Where the linear calls may not run natively (forward-mode AD active),
    nothing runs natively: the Python path's result."""
    layer = _mlp(256, 256)
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
    assert type(_plans(layer)[0]) is NativeLayerNormMLP and calls["native"] == 2
    assert not set(_chain(y)) & set(NATIVE_CHAIN)
    assert torch.equal(y, want)


def test_native_activation_node_takes_other_gradients_the_python_way(ext):
    """A gradient the node's launch does not take (here a strided one) goes
    through the Python path's activation backward, as the op's would."""
    from transformer_engine_compile.module.layernorm_mlp_ops import activation_backward
    layer = _mlp(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CURRENT):
        for _ in range(2):
            layer(x)
    plan = _plans(layer)[0]
    h = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = ext.act(plan.act, h)
    assert a.grad_fn.name() == "TeActivationBackward" and a.shape == (128, 256)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16).t()
    a.backward(dy)
    with torch.no_grad():
        assert torch.equal(h.grad, activation_backward(dy, h.detach(), "swiglu"))
    assert ext.act(plan.act, h[:64]) is None  # another shape: the Python path's
