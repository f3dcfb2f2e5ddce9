"""The native eager path of the fused modules: ``te.LayerNormLinear``
(module/layernorm/linear_native.py: its norm as a native call and node,
then the layer's native linear call) and ``te.LayerNormMLP``
(module/layernorm/mlp_native.py: norm, fc1, activation, fc2) give the
Python path's bits, outputs and gradients, in the ways users train.
Skips without CUDA."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R

from native_steps import (assert_same, chain, compare, microbatch_steps, native_path, plans,
                          recipe_on, train_steps)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.module.layernorm.linear_native import NativeLayerNormLinear
    from transformer_engine_compile.module.layernorm.mlp_native import NativeLayerNormMLP

CURRENT = R.Float8CurrentScaling()
BLOCK = R.Float8BlockScaling()
MX = R.MXFP8BlockScaling()
# a short history and "max": the scales move within a few steps
DELAYED = R.DelayedScaling(amax_history_len=16, amax_compute_algo="max", margin=1)
# NVFP4 without stochastic rounding: the two paths' steps draw nothing
NVFP4_PLAIN = R.NVFP4BlockScaling(disable_stochastic_rounding=True)
# every recipe and none (bf16: the GEMMs on the plain plan, with or without a bias)
ALL_AND_BF16 = pytest.mark.parametrize("rec", [None, CURRENT, BLOCK, MX, DELAYED, NVFP4_PLAIN],
                                       ids=["bf16", "fp8_current", "fp8_block", "mxfp8",
                                            "fp8_delayed", "nvfp4"])
CURRENT_DELAYED = pytest.mark.parametrize("rec", [CURRENT, DELAYED],
                                          ids=["fp8_current", "fp8_delayed"])
# ... and no recipe (bf16: the plain plan for the GEMMs)
PLAIN_CURRENT_DELAYED = pytest.mark.parametrize("rec", [None, CURRENT, DELAYED],
                                                ids=["bf16", "fp8_current", "fp8_delayed"])
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
LINEAR_CHAIN = ["TeLinearFp8Backward", "TeNormBackward"]
MLP_CHAIN = ["TeLinearFp8Backward", "TeActivationBackward", "TeLinearFp8Backward",
             "TeNormBackward"]


def _native_chain(chain_names, rec):
    """The native nodes' names under ``rec`` (no recipe: the plain node)."""
    return [n.replace("Fp8", "") if rec is None else n for n in chain_names]


def _perturbed(module):
    with torch.no_grad():  # every parameter away from its initial value
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return module


def _lnlinear(k, n, normalization="RMSNorm", bias=False, **kw):
    torch.manual_seed(0)
    return _perturbed(te.LayerNormLinear(k, n, bias=bias, normalization=normalization,
                                         params_dtype=torch.bfloat16, device="cuda", **kw))


def _mlp(hidden, ffn, normalization="RMSNorm", bias=False, activation="swiglu",
         dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    return _perturbed(te.LayerNormMLP(hidden, ffn, bias=bias, normalization=normalization,
                                      activation=activation, params_dtype=dtype,
                                      device="cuda", **kw))


# a fused module of each kind, its plan class, native linear calls per module call
MODULES = {
    "layernorm_linear": (lambda: _lnlinear(512, 256, "LayerNorm", True),
                         "NativeLayerNormLinear", 1),
    "layernorm_mlp": (lambda: _mlp(512, 256, "LayerNorm", True, "gelu"),
                      "NativeLayerNormMLP", 2),
}
BOTH = pytest.mark.parametrize("kind", sorted(MODULES))


def _inputs(kind):
    """x (128 x 512, requiring grad) and an output gradient for MODULES[kind]."""
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 512 if kind == "layernorm_mlp" else 256, device="cuda",
                     dtype=torch.bfloat16)
    return x, dy


def _skip_block(rec):
    if rec is BLOCK and not _HOPPER:
        pytest.skip("the block-scaled GEMM is cuBLAS's on SM 9.0")


# -- te.LayerNormLinear -----------------------------------------------------------
LINEAR_CASES = [  # (normalization, bias, zero_centered_gamma, return_layernorm_output, shape, n)
    ("RMSNorm", False, False, False, (2, 128, 512), 384),
    ("LayerNorm", True, False, False, (256, 256), 512),
    ("LayerNorm", False, True, True, (4, 64, 512), 256),
    ("RMSNorm", True, True, True, (256, 1024), 256),
]


@ALL_AND_BF16
@pytest.mark.parametrize("case", LINEAR_CASES, ids=str)
def test_native_layernorm_linear_equals_python_bit_for_bit(ext, calls, rec, case):
    _skip_block(rec)
    normalization, bias, zcg, ret_ln, shape, n = case
    layer = _lnlinear(shape[-1], n, normalization, bias, zero_centered_gamma=zcg,
                      return_layernorm_output=ret_ln)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    dy = torch.randn((*shape[:-1], n), device="cuda", dtype=torch.bfloat16)
    d_ln = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if ret_ln else None
    y, y_ref = compare(layer, x, dy, rec, d_ln=d_ln)
    assert calls["native"] == 2  # calls 2 and 3 (the first builds the memo)
    assert [type(p) for p in plans(layer)] == [NativeLayerNormLinear]
    assert chain(y)[:2] == _native_chain(LINEAR_CHAIN, rec)
    assert not set(chain(y_ref)) & set(_native_chain(LINEAR_CHAIN, rec))


@CURRENT_DELAYED
@pytest.mark.parametrize("frozen", ["input", "norm", "linear", "input_and_norm"])
def test_native_layernorm_linear_partial_gradients(ext, calls, rec, frozen):
    """Frozen parts (an input without grad, a frozen norm, a frozen linear
    weight, both an input without grad and a frozen norm: then the norm
    records nothing and the GEMM no dgrad) plan for the gradients still
    needed; AdamW over 3 steps."""
    layer = _lnlinear(512, 256, "LayerNorm", True)
    if frozen in ("norm", "input_and_norm"):
        layer.layer_norm_weight.requires_grad_(False)
        layer.layer_norm_bias.requires_grad_(False)
    if frozen == "linear":
        layer.weight.requires_grad_(False)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(frozen not in ("input", "input_and_norm"))
    dy = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    y, _ = compare(layer, x, dy, rec, optimizer=True)
    assert calls["native"] == 2
    assert chain(y) == (["TeLinearFp8Backward"] if frozen == "input_and_norm" else LINEAR_CHAIN)


def test_native_layernorm_linear_replaced_norm_weight_is_read(ext):
    """A replaced norm parameter drops the memo: the new one is used."""
    layer = _lnlinear(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CURRENT):
        for _ in range(3):
            layer(x)
        layer.layer_norm_weight = torch.nn.Parameter(layer.layer_norm_weight.detach() * 2)
        got = layer(x)
        layer.__dict__["_args_memo"] = None
        with native_path(False):
            want = layer(x)
    assert torch.equal(got, want)


# -- te.LayerNormMLP ----------------------------------------------------------------
MLP_CASES = [  # normalization, bias, activation, zero_centered_gamma, ln_out, return_bias, x, ffn
    ("RMSNorm", False, "swiglu", False, False, False, (2, 128, 512), 384),
    ("LayerNorm", True, "gelu", False, False, False, (256, 256), 512),
    ("LayerNorm", False, "geglu", True, True, False, (4, 64, 512), 256),
    ("RMSNorm", True, "srelu", False, True, True, (256, 1024), 256),
    ("RMSNorm", True, "qgeglu", True, False, True, (128, 256), 256),
]


@ALL_AND_BF16
@pytest.mark.parametrize("case", MLP_CASES, ids=str)
def test_native_layernorm_mlp_equals_python_bit_for_bit(ext, calls, rec, case):
    _skip_block(rec)
    normalization, bias, act, zcg, ret_ln, ret_bias, shape, ffn = case
    layer = _mlp(shape[-1], ffn, normalization, bias, act, zero_centered_gamma=zcg,
                 return_layernorm_output=ret_ln, return_bias=ret_bias)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    d_ln = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if ret_ln else None
    y, y_ref = compare(layer, x, dy, rec, d_ln=d_ln)
    assert calls["native"] == 4  # two GEMMs in calls 2 and 3 (the first builds the memo)
    assert [type(p) for p in plans(layer)] == [NativeLayerNormMLP]
    assert chain(y) == _native_chain(MLP_CHAIN, rec)
    assert not set(chain(y_ref)) & set(_native_chain(MLP_CHAIN, rec))


@pytest.mark.parametrize("frozen", ["input", "norm", "fc1", "fc2", "input+norm+fc1"])
def test_native_layernorm_mlp_partial_gradients(ext, calls, frozen):
    """Frozen parts plan for the gradients still needed; AdamW over 3 steps.
    With the input, the norm and fc1 all frozen fc2's input needs no
    gradient, and the activation records no node."""
    layer = _mlp(512, 256, "LayerNorm", True)
    parts = frozen.split("+")
    prefixes = tuple({"norm": "layer_norm", "fc1": "fc1_", "fc2": "fc2_"}[q]
                     for q in parts if q != "input")
    for name, p in layer.named_parameters():
        if prefixes and name.startswith(prefixes):
            p.requires_grad_(False)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_("input" not in parts)
    dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    y, _ = compare(layer, x, dy, CURRENT, optimizer=True)
    assert calls["native"] == 4
    if frozen == "input+norm+fc1":
        assert chain(y) == ["TeLinearFp8Backward"]


def test_native_layernorm_mlp_under_torch_autocast(ext, calls):
    """fp32 parameters under torch.autocast(bf16): the casts are new tensors
    every call, the memo and the plan still serve (the key holds the
    parameters' dtype), with the Python path's bits."""
    layer = _mlp(256, 256, "LayerNorm", True, "gelu", dtype=torch.float32)
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    y, _ = compare(layer, x, dy, CURRENT, autocast=torch.bfloat16)
    assert calls["native"] == 4 and chain(y)[:4] == MLP_CHAIN  # then x's cast


def test_native_activation_node_takes_other_gradients_the_python_way(ext):
    """A gradient the node's launch does not take (here a strided one) goes
    through the Python path's activation backward, as the op's would."""
    from transformer_engine_compile.module.layernorm.mlp_ops import activation_backward
    layer = _mlp(256, 256)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CURRENT):
        for _ in range(2):
            layer(x)
    plan = plans(layer)[0]
    h = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = ext.act(plan.act, h)
    assert a.grad_fn.name() == "TeActivationBackward" and a.shape == (128, 256)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16).t()
    a.backward(dy)
    with torch.no_grad():
        assert torch.equal(h.grad, activation_backward(dy, h.detach(), "swiglu"))
    assert ext.act(plan.act, h[:64]) is None  # another shape: the Python path's


# -- no recipe (bf16 / fp16; the equality tests above take bf16 too) ---------------
@BOTH
@pytest.mark.parametrize("how", ["fp16", "autocast"])
def test_native_fused_without_recipe_fp16_and_under_torch_autocast(ext, calls, kind, how):
    """fp16 parameters, and fp32 parameters under torch.autocast(bf16)
    (their casts are new tensors every call): the plain plans serve, with
    the Python path's bits."""
    make, plan_class, per_call = MODULES[kind]
    torch.manual_seed(2)
    layer = make().to(torch.float16 if how == "fp16" else torch.float32)
    dtype = torch.float16 if how == "fp16" else torch.float32
    x = torch.randn(128, 512, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(128, 512 if kind == "layernorm_mlp" else 256, device="cuda",
                     dtype=torch.float16 if how == "fp16" else torch.bfloat16)
    # AdamW only over fp32 parameters (its eps underflows in fp16)
    y, _ = compare(layer, x, dy, None, optimizer=how == "autocast",
                   autocast=torch.bfloat16 if how == "autocast" else None)
    assert calls["native"] == 2 * per_call
    assert [type(p).__name__ for p in plans(layer)] == [plan_class]
    assert chain(y)[0] == "TeLinearBackward"


# -- both -------------------------------------------------------------------------
@PLAIN_CURRENT_DELAYED
@BOTH
def test_native_fused_eval_and_train_alternate(ext, calls, kind, rec):
    make, plan_class, _ = MODULES[kind]
    layer = make()
    ref = copy.deepcopy(layer)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x_train = x.clone().requires_grad_()
    for _ in range(3):
        evals = []
        for lay, on in ((layer, True), (ref, False)):
            with native_path(on), recipe_on(rec):
                with torch.no_grad():
                    evals.append(lay(x))
                lay(x_train).float().square().sum().backward()
        assert torch.equal(*evals)
        for p, q in zip(layer.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert_same(_state(layer), _state(ref))
    assert [type(p).__name__ for p in plans(layer)] == [plan_class] * 2


def _state(module) -> list:
    """The module's FP8 buffers (DelayedScaling's histories and scales, a
    weight cache), by name."""
    return [b.clone() for n, b in sorted(module.named_buffers()) if "fp8_" in n]


@BOTH
@pytest.mark.parametrize("ret_ln", [False, True], ids=["ln_out_kept", "ln_out_returned"])
def test_native_fused_delayed_scaling_with_its_state(ext, calls, kind, ret_ln):
    """DelayedScaling: the norm kernel writes the first GEMM's FP8 input
    with the layer's scale (one native call with that GEMM: norm_linear),
    and the high-precision norm output only where it is returned.  Each
    step's outputs, gradients and state buffers equal the Python path's bit
    for bit (AdamW between steps)."""
    torch.manual_seed(3)
    make = _lnlinear if kind == "layernorm_linear" else _mlp
    layer = make(512, 256, "LayerNorm", True, return_layernorm_output=ret_ln)
    ref = copy.deepcopy(layer)
    x, dy = _inputs(kind)
    x = x.detach().mul(3).requires_grad_()
    d_ln = torch.randn_like(x) if ret_ln else None
    for step in range(4):
        got, y = train_steps(layer, x, dy, DELAYED, True, steps=1, d_ln=d_ln, optimizer=True)
        want, y_ref = train_steps(ref, x, dy, DELAYED, False, steps=1, d_ln=d_ln,
                                  optimizer=True)
        assert_same(got, want)
        state = _state(layer)
        assert len(state) == 4 * MODULES[kind][2]
        assert_same(state, _state(ref))
    assert (got[1] is not None) == ret_ln
    want_chain = LINEAR_CHAIN if kind == "layernorm_linear" else MLP_CHAIN
    assert chain(y)[:len(want_chain)] == want_chain and "TeNormBackward" not in chain(y_ref)
    assert calls["native"] == 3 * MODULES[kind][2]
    assert [type(p).__name__ for p in plans(layer)] == [MODULES[kind][1]]
    assert plans(layer)[0].fp8_norm


def test_native_fused_delayed_plans_run_only_together(ext):
    """A DelayedScaling plan's norm writes FP8 for its GEMM, whose plan
    takes that copy: neither runs alone, and a call one of them does not
    fit runs neither (the layer's state untouched)."""
    layer = _lnlinear(512, 256)
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=DELAYED):
        for _ in range(2):
            layer(x)
    plan = plans(layer)[0]
    lin, w, ln_w = plan.linear, layer.weight, layer.layer_norm_weight
    before = _state(layer)
    assert ext.norm(plan.norm, x, ln_w, None) is None
    assert ext.linear(lin.plan, x, w, None, *lin.slot, lin.state) is None
    assert ext.norm_linear(lin.plan, plan.norm, x, ln_w, None, w, None, *lin.slot,
                           lin.state[:3]) == []
    assert ext.norm_linear(lin.plan, plan.norm, x[:64], ln_w, None, w, None, *lin.slot,
                           lin.state) == []
    assert_same(_state(layer), before)
    y, ln_out = ext.norm_linear(lin.plan, plan.norm, x, ln_w, None, w, None, *lin.slot,
                                lin.state)
    assert y.shape == (128, 256) and ln_out is None


@PLAIN_CURRENT_DELAYED
@BOTH
def test_native_fused_checkpointed(ext, calls, kind, rec):
    """Inside te.checkpoint the recomputation takes the forward's path
    (under DelayedScaling on the forward's recorded scales, its own update
    discarded): outputs, gradients and state equal the Python path's."""
    make, _, per_call = MODULES[kind]
    layer = make()
    ref = copy.deepcopy(layer)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for lay, on in ((layer, True), (ref, False)):
        with native_path(on):
            for _ in range(3):
                lay.zero_grad(set_to_none=True)
                with recipe_on(rec):
                    y = te.checkpoint(lay, x)
                y.float().square().sum().backward()
        outs.append([y.detach(), *[p.grad for p in lay.parameters()], *_state(lay)])
    assert_same(*outs)
    assert calls["native"] >= 2 * per_call


@BOTH
def test_native_fused_declines_before_its_norm_runs(ext, calls, kind):
    """Where the linear calls may not run natively (here forward-mode AD is
    active), the norm does not run natively either: the whole module takes
    the Python path, with the Python path's result."""
    make, plan_class, per_call = MODULES[kind]
    layer = make()
    ref = copy.deepcopy(layer)
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=CURRENT):
        for _ in range(2):
            layer(x)  # the plan exists after the second call
        with torch.autograd.forward_ad.dual_level():
            y = layer(x)
        with native_path(False):
            want = ref(x)
    assert type(plans(layer)[0]).__name__ == plan_class and calls["native"] == per_call
    assert not set(chain(y)) & set(MLP_CHAIN)
    assert torch.equal(y, want)


@pytest.mark.parametrize("rec", [CURRENT, DELAYED, BLOCK],
                         ids=["fp8_current", "fp8_delayed", "fp8_block"])
@BOTH
def test_native_fused_weight_caching(ext, calls, kind, rec):
    """Gradient accumulation with the FP8 weight cache (is_first_microbatch)
    natively: every microbatch's output, input gradient and cache, and each
    step's gradients, equal the Python path's."""
    _skip_block(rec)
    make, plan_class, per_call = MODULES[kind]
    layer = make()
    ref = copy.deepcopy(layer)
    x, dy = _inputs(kind)
    got, _ = microbatch_steps(layer, x, dy, rec, True)
    want, _ = microbatch_steps(ref, x, dy, rec, False)
    assert_same(got, want)
    assert calls["native"] == 4 * per_call
    assert [type(p).__name__ for p in plans(layer)] == [plan_class] * 2


@CURRENT_DELAYED
@BOTH
def test_native_fused_weight_caching_checkpointed(ext, calls, kind, rec):
    """The FP8 weight cache inside te.checkpoint natively (the recomputation
    repeats its forward's use of the cache): every microbatch's output,
    input gradient, cache and state, and each step's gradients, equal the
    Python path's."""
    make, plan_class, per_call = MODULES[kind]
    layer = make()
    ref = copy.deepcopy(layer)
    x, dy = _inputs(kind)
    got, _ = microbatch_steps(layer, x, dy, rec, True, ckpt=te.checkpoint)
    want, _ = microbatch_steps(ref, x, dy, rec, False, ckpt=te.checkpoint)
    assert_same(got, want)
    # the four forwards after step 1's memo-building ones (recomputations,
    # stopped early inside the module by torch, may add more)
    assert calls["native"] >= 4 * per_call
    assert [type(p).__name__ for p in plans(layer)] == [plan_class] * 2


@pytest.mark.parametrize("rec", [CURRENT, DELAYED, NVFP4_PLAIN],
                         ids=["fp8_current", "fp8_delayed", "nvfp4"])
@BOTH
def test_native_fused_wgrad_accumulation(ext, calls, kind, rec):
    """``fuse_wgrad_accumulation``: each GEMM's native node adds its weight
    gradient into that weight's ``main_grad`` (fp32) and gives the weight
    none; over three steps outputs, the other gradients and every main_grad
    equal the Python path's bit for bit."""
    make, plan_class, per_call = MODULES[kind]
    layer = make()
    layer.fuse_wgrad_accumulation = True
    ref = copy.deepcopy(layer)
    weights = [n for n, _ in layer.named_parameters()
               if n.endswith("weight") and not n.startswith("layer_norm")]
    for m in (layer, ref):
        for n in weights:
            m.get_parameter(n).main_grad = torch.zeros(m.get_parameter(n).shape, device="cuda")
    x, dy = _inputs(kind)
    got, y = train_steps(layer, x, dy, rec, True)
    want, _ = train_steps(ref, x, dy, rec, False)
    assert_same(got, want)
    assert_same([layer.get_parameter(n).main_grad for n in weights],
                [ref.get_parameter(n).main_grad for n in weights])
    assert all(layer.get_parameter(n).grad is None for n in weights)
    assert all(layer.get_parameter(n).main_grad.abs().sum() > 0 for n in weights)
    assert calls["native"] == 2 * per_call and chain(y)[0] == "TeLinearFp8Backward"
    assert [type(p).__name__ for p in plans(layer)] == [plan_class]


def test_native_norm_takes_only_its_planned_shape(ext):
    """The norm node's plan runs on the shape it was made for, not merely the
    same element count (another shape is the Python path's)."""
    layer = _lnlinear(512, 256)
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CURRENT):
        for _ in range(2):
            layer(x)
    plan = plans(layer)[0]
    w = layer.layer_norm_weight
    assert ext.norm(plan.norm, x, w, None).shape == x.shape
    assert ext.norm(plan.norm, x.view(64, 2, 512), w, None) is None
