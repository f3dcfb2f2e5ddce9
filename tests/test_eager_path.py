"""The eager path's shortcuts: te.Linear's argument memo and
non-view outputs.  Each shortcut must give what the full path gives."""

import copy
import io
import pickle
import weakref
from unittest import mock

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.module.linear import plain as linear_plain_ops
from transformer_engine_compile.module.linear import Linear


def _layer(bias=False, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return te.Linear(128, 128, bias=bias, params_dtype=dtype)


def _run(layer, x, rec, grad=True):
    """Output and gradients of one eager call (x's, then the parameters')."""
    x = x.detach().requires_grad_(x.requires_grad)
    layer.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad), te.autocast(enabled=rec is not None, recipe=rec):
        y = layer(x)
    if isinstance(y, tuple):  # return_bias: the output, then the bias
        y = y[0]
    if grad and y.requires_grad:
        y.float().square().sum().backward()
    return [y.detach()] + [t.grad for t in (x, *layer.parameters())]


def _counting_builds(calls: list, cls=Linear, layer=None):
    """Appends to ``calls`` for every full argument build (``cls._checked_args``):
    True, or with ``layer`` whether it was that layer's."""
    full = cls._checked_args

    def counted(self, *args):
        calls.append(layer is None or self is layer)
        return full(self, *args)

    return mock.patch.object(cls, "_checked_args", counted)


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype and torch.equal(u, v)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8", "bf16"])
def test_args_memo_is_reused_and_gives_the_full_paths_results(name, monkeypatch):
    """A repeated configuration skips the checks (one ``_checked_args`` for
    two calls), and every new configuration builds its arguments: grad
    mode, requires_grad, input shape or dtype, recipe, a replaced or
    converted parameter; the memo keeps the last four (``args_memo.MEMO_ENTRIES``).
    Each call equals a copy of the layer (which starts without memo)
    running the same call."""
    rec = recipe.by_name(name)
    # bf16 without a bias runs F.linear, with one eagerly PlainLinear; the bf16
    # calls that still build arguments (tensor parallelism, fused wgrad
    # accumulation) are stood in for by a bias layer with PlainLinear off
    layer = _layer(bias=name == "bf16")
    monkeypatch.setattr(linear_plain_ops, "runs", lambda inp, bias: False)
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []

    def check(layer, x, rec, grad=True, built=True):
        before = len(calls)
        got = _run(layer, x, rec, grad)
        assert len(calls) - before == int(built)
        _same(got, _run(copy.deepcopy(layer), x, rec, grad))

    with _counting_builds(calls):
        check(layer, x, rec)
        check(layer, x, rec, built=False)  # the memo
        check(layer, x, rec, grad=False)
        check(layer, x.detach(), rec)
        check(layer, torch.randn(2, 4, 128, dtype=torch.bfloat16, requires_grad=True), rec)
        check(layer, x, rec, built=False)  # still one of the memo's four entries
        layer.weight.requires_grad_(False)
        check(layer, x, rec)
        layer.weight.requires_grad_(True)
        other = recipe.by_name("fp8_current" if name != "fp8_current" else "mxfp8")
        check(layer, x, other)
        check(layer, x, rec)
        layer.weight = torch.nn.Parameter(layer.weight.detach() * 2)
        check(layer, x, rec)
        check(layer, x, rec, built=False)
        layer.to(torch.float32)  # parameters converted in place: same objects, new dtype
        check(layer, x.float(), rec)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block"])
def test_args_memo_serves_torch_autocast_casts(name):
    """Under torch.autocast the layer runs on new casts of its fp32
    parameters every call: the memo still serves the repeated call (keyed by
    the parameters' objects and dtype), the results and the fp32 gradients
    equal a memo-less copy's, and converting the parameters rebuilds it."""
    rec = recipe.by_name(name)
    layer = _layer(bias=True, dtype=torch.float32)
    x = torch.randn(4, 128, requires_grad=True)
    calls = []

    def run(layer, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _run(layer, x, rec)

    with _counting_builds(calls):
        for built in (1, 0, 0):
            before = len(calls)
            got = run(layer, x)
            assert len(calls) - before == built
            assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
            _same(got, run(copy.deepcopy(layer), x))
        layer.to(torch.float16)  # the same objects in another dtype: a new entry
        before = len(calls)
        _same(run(layer, x), run(copy.deepcopy(layer), x))
        assert len(calls) - before == 2  # the layer's call and its copy's


def _state(module):
    """The module's DelayedScaling buffers, by name."""
    return [b.clone() for n, b in sorted(module.named_buffers()) if "fp8_" in n]


def test_memo_under_delayed_scaling_follows_the_state_buffers():
    """DelayedScaling binds the layer's state buffers: the memo serves while
    they are the layer's, and rebuilds when they are replaced (here as
    ``module.to()`` or a reset would); the state each call leaves equals a
    memo-less copy's."""
    rec = recipe.DelayedScaling()
    layer = _layer()
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []
    state = _state

    with _counting_builds(calls):
        for built in (1, 0, 0):
            before = len(calls)
            ref = copy.deepcopy(layer)
            _same(_run(layer, x, rec), _run(ref, x, rec))
            assert len(calls) - before == built + 1  # the copy starts without memo
            _same(state(layer), state(ref))
        layer.register_buffer("fp8_scale_fwd", layer.fp8_scale_fwd.clone(), persistent=False)
        before = len(calls)
        _run(layer, x, rec)
        assert len(calls) - before == 1
        assert [t.fields["scale_fwd"] for t in layer._args_memo[1].values()] == [
            layer.fp8_scale_fwd]


def test_memo_never_skips_a_check():
    """After calls the memo serves, a call it does not serve still meets
    every check: a wrong width, a dtype the layer does not take, a dtype
    other than the weight's without a recipe."""
    layer = _layer()
    rec = recipe.Float8CurrentScaling()
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    _run(layer, x, rec)
    _run(layer, x, rec)
    with pytest.raises(ValueError, match="must end in 128"):
        _run(layer, torch.randn(32, 96, dtype=torch.bfloat16, requires_grad=True), rec)
    with pytest.raises(TypeError, match="must be float32, bfloat16 or float16"):
        _run(layer, torch.randn(32, 128, dtype=torch.float64, requires_grad=True), rec)
    _run(layer, x, None)
    with pytest.raises(TypeError, match="differs from the weight"):
        _run(layer, x.float(), None)


def test_memo_keeps_no_activation_and_is_not_saved():
    """The memo holds no input (the activation is freed with the graph), and
    copies, pickles and ``torch.save`` leave it behind."""
    layer = _layer()
    rec = recipe.Float8CurrentScaling()
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    _run(layer, x, rec)
    with te.autocast(recipe=rec):
        h = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
        y = layer(h)
    y.sum().backward()
    ref = weakref.ref(h)
    del h, y
    assert ref() is None
    assert "_args_memo" in layer.__dict__
    assert "_args_memo" not in copy.deepcopy(layer).__dict__
    assert "_args_memo" not in pickle.loads(pickle.dumps(layer)).__dict__
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    assert "_args_memo" not in torch.load(buf, weights_only=False).__dict__


@pytest.mark.parametrize("name", ["fp8_current", "bf16"])
def test_eager_output_is_no_view(name):
    """A 3-D input's output is no view (the GEMM's 2-D result reshaped), so
    an in-place op on it is allowed, and the gradient it passes back is
    the one of the op's result."""
    rec = recipe.by_name(name)
    layer = _layer(bias=True)
    x = torch.randn(2, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=rec is not None, recipe=rec):
        y = layer(x)
    assert y._base is None and not y._is_view()
    y.mul_(3)
    y.float().sum().backward()
    want = _layer(bias=True)
    x2 = x.detach().requires_grad_()
    with te.autocast(enabled=rec is not None, recipe=rec):
        y2 = want(x2) * 3
    y2.float().sum().backward()
    assert torch.equal(y.detach(), y2.detach())
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(layer.weight.grad, want.weight.grad)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4"])
def test_every_saved_buffer_passes_the_saved_tensor_hooks(name):
    """A quantized value saved for backward goes through
    ``saved_tensors_hooks`` buffer by buffer, and the backward uses what
    the hooks give back: zeros there give zero gradients (a buffer kept
    aside, not through the hooks, would give the true ones)."""
    rec = recipe.by_name(name)
    layer = _layer()
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, torch.zeros_like), \
            te.autocast(recipe=rec):
        y = layer(x)
    y.float().sum().backward()
    assert len(packed) >= 4  # x's and W's copies, each with its scales
    assert not x.grad.any() and not layer.weight.grad.any()
    x.grad = layer.weight.grad = None
    with te.autocast(recipe=rec):
        layer(x).float().sum().backward()
    assert x.grad.any() and layer.weight.grad.any()


@pytest.mark.parametrize("name", ["fp8_current", "bf16"])
def test_args_memo_serves_layernorm_linear(name):
    """te.LayerNormLinear keeps a memo too: a repeated call skips the checks,
    and the norm's state is part of it (a frozen or replaced norm parameter,
    zero-centred gamma switched on, builds again).  Each call equals a
    memo-less copy's, the norm parameters' gradients included."""
    rec = recipe.by_name(name)
    torch.manual_seed(0)
    layer = te.LayerNormLinear(128, 128, bias=True, normalization="LayerNorm",
                               params_dtype=torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []

    def check(built):
        before = len(calls)
        got = _run(layer, x, rec)
        assert len(calls) - before == int(built)
        _same(got, _run(copy.deepcopy(layer), x, rec))

    with _counting_builds(calls):
        check(True)
        check(False)
        layer.layer_norm_weight.requires_grad_(False)
        check(True)
        check(False)
        layer.layer_norm_bias = torch.nn.Parameter(layer.layer_norm_bias.detach() + 1)
        check(True)
        layer.zero_centered_gamma = True
        check(True)
        check(False)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "delayed", "bf16"])
def test_args_memo_serves_layernorm_mlp(name):
    """te.LayerNormMLP keeps a memo as te.Linear does: a repeated call skips
    the checks (one ``_checked_args`` for two calls), and anything its
    arguments depend on builds them again: a frozen or replaced parameter of
    the norm or either GEMM, the activation, ``return_bias``, no-grad mode,
    another input shape.  Each call equals a memo-less copy's, every
    gradient included; under DelayedScaling the copy runs on the same state."""
    from transformer_engine_compile.module.layernorm.mlp import LayerNormMLP
    rec = recipe.DelayedScaling() if name == "delayed" else recipe.by_name(name)
    torch.manual_seed(0)
    layer = te.LayerNormMLP(128, 256, normalization="RMSNorm", activation="swiglu",
                            params_dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []

    def check(built, inp=x, grad=True):
        before = len(calls)
        twin = copy.deepcopy(layer)
        got = _run(layer, inp, rec, grad)
        assert len(calls) - before == int(built)
        assert "_args_memo" not in twin.__dict__  # the copy builds its own
        _same(got, _run(twin, inp, rec, grad))
        _same(_state(layer), _state(twin))

    with _counting_builds(calls, LayerNormMLP):
        check(True)
        check(False)
        layer.fc2_weight.requires_grad_(False)
        check(True)
        check(False)
        layer.layer_norm_weight.requires_grad_(False)
        check(True)
        layer.fc1_bias = torch.nn.Parameter(layer.fc1_bias.detach() + 1)
        check(True)
        check(False)
        layer.activation = "geglu"
        check(True)
        layer.return_bias = True
        check(True)
        layer.return_bias = False
        check(False)
        check(True, grad=False)
        check(False, grad=False)
        check(True, inp=x[:16])
        if name == "delayed":  # a replaced state buffer: the entry is not served
            layer.register_buffer("fc2_fp8_scale_fwd", layer.fc2_fp8_scale_fwd.clone(),
                                  persistent=False)
            check(True, inp=x[:16])
            check(False, inp=x[:16])


@pytest.mark.parametrize("module,name", [
    ("linear", "fp8_current"), ("linear", "fp8_block"), ("linear", "mxfp8"),
    ("linear", "nvfp4"), ("linear", "delayed"), ("layernorm_mlp", "fp8_current")])
def test_args_memo_serves_weight_caching(module, name):
    """``is_first_microbatch`` (gradient accumulation with the FP8 weight
    cache) keeps one memo entry per flag: over two accumulation steps with
    an optimizer step between, True and False each build their arguments
    once, and every microbatch equals a memo-less copy's, the cache it
    leaves included.  A re-registered cache buffer rebuilds."""
    from transformer_engine_compile.module.layernorm.mlp import LayerNormMLP
    rec = {"delayed": recipe.DelayedScaling(),  # deterministic: the twin draws no other bits
           "nvfp4": recipe.NVFP4BlockScaling(disable_stochastic_rounding=True)}.get(
               name) or recipe.by_name(name)
    torch.manual_seed(0)
    if module == "linear":
        layer, cls = _layer(bias=True), Linear
    else:
        layer = te.LayerNormMLP(128, 128, normalization="RMSNorm", activation="swiglu",
                                params_dtype=torch.bfloat16)
        cls = LayerNormMLP
    twin = copy.deepcopy(layer)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []
    def cache(m):
        return [b.clone() for n, b in sorted(m.named_buffers()) if "fp8_weight" in n]

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, twin)]
    with _counting_builds(calls, cls, layer):
        for step in range(2):
            for first in (True, False, False):
                got = []
                for m in (layer, twin):
                    with te.autocast(recipe=rec):
                        y = m(x, is_first_microbatch=first)
                    y.float().square().sum().backward()
                    got.append([y.detach(), *cache(m)])
                    twin.__dict__.pop("_args_memo", None)  # the copy never keeps one
                _same(*got)
            _same([p.grad for p in layer.parameters()], [p.grad for p in twin.parameters()])
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert calls.count(True) == 2  # the True entry and the False entry
        name = next(n for n, _ in layer.named_buffers() if "fp8_weight" in n)
        layer.register_buffer(name, getattr(layer, name).clone(), persistent=False)
        with te.autocast(recipe=rec):
            layer(x, is_first_microbatch=False)
        assert calls.count(True) == 3


@pytest.mark.parametrize("module", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_args_memo_serves_fused_wgrad_accumulation(module):
    """``fuse_wgrad_accumulation`` keeps a memo entry too: a repeated call
    skips the checks, each call adds the same into ``main_grad`` as a
    memo-less copy (``weight.grad`` stays None), and the entry serves only
    while each weight's ``main_grad`` is the one it bound: a new
    ``main_grad`` builds again, a deleted one meets the full path's error."""
    from transformer_engine_compile.module.layernorm.linear import LayerNormLinear
    from transformer_engine_compile.module.layernorm.mlp import LayerNormMLP
    rec = recipe.Float8CurrentScaling()
    torch.manual_seed(0)
    if module == "linear":
        layer, cls = te.Linear(128, 128, fuse_wgrad_accumulation=True,
                               params_dtype=torch.bfloat16), Linear
    elif module == "layernorm_linear":
        layer, cls = te.LayerNormLinear(128, 128, normalization="RMSNorm",
                                        fuse_wgrad_accumulation=True,
                                        params_dtype=torch.bfloat16), LayerNormLinear
    else:
        layer, cls = te.LayerNormMLP(128, 128, normalization="RMSNorm", activation="swiglu",
                                     fuse_wgrad_accumulation=True,
                                     params_dtype=torch.bfloat16), LayerNormMLP
    weights = [n for n, _ in layer.named_parameters() if n.endswith("weight")
               and "layer_norm" not in n]
    twin = copy.deepcopy(layer)
    for m in (layer, twin):
        for n in weights:
            m.get_parameter(n).main_grad = torch.zeros(m.get_parameter(n).shape)
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    calls = []
    def step(m):
        with te.autocast(recipe=rec):
            y = m(x)
        y.float().square().sum().backward()
        return [y.detach()] + [m.get_parameter(n).main_grad.clone() for n in weights]

    with _counting_builds(calls, cls, layer):
        for built in (1, 0, 0):
            before = calls.count(True)
            got = step(layer)
            twin.__dict__.pop("_args_memo", None)  # the copy never keeps one
            _same(got, step(twin))
            assert calls.count(True) - before == built
            assert all(layer.get_parameter(n).grad is None for n in weights)
        assert got[1].abs().sum() > 0
        for m in (layer, twin):  # a new main_grad (as a training loop's bucket swap)
            m.get_parameter(weights[-1]).main_grad = torch.ones(layer.get_parameter(
                weights[-1]).shape)
        got = step(layer)
        twin.__dict__.pop("_args_memo", None)
        _same(got, step(twin))
        assert calls.count(True) == 2
        del layer.get_parameter(weights[0]).main_grad
        with pytest.raises(RuntimeError, match="main_grad"):
            step(layer)
