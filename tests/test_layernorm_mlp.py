"""te.LayerNormMLP: compiled against eager bit for bit, fakes against the
real layout, opcheck, a reference made of torch's norm, two te.Linear and
the activation, state (DelayedScaling, weight cache, main_grad), errors."""

import copy
import itertools

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.kernels.reference import ACTIVATIONS
from transformer_engine_compile.module.layernorm import mlp_ops as M

from test_linear import RECIPES, _reset
from test_linear_ops import _assert_parity, _describe, opcheck

OPS = M.LAYERNORM_MLP_OPS
# DelayedScaling keeps its state in the module's buffers (both GEMMs)
ALL_RECIPES = {**RECIPES, "delayed": recipe.DelayedScaling(amax_history_len=4)}
HIDDEN, FFN = 128, 256
# (normalization, activation): a non-gated and a gated activation, each norm
CONFIGS = [("LayerNorm", "gelu"), ("RMSNorm", "swiglu")]


def _mlp(normalization="LayerNorm", activation="gelu", **kw):
    torch.manual_seed(0)
    kw.setdefault("params_dtype", torch.bfloat16)
    m = te.LayerNormMLP(HIDDEN, FFN, normalization=normalization, activation=activation, **kw)
    with torch.no_grad():  # non-trivial norm parameters and biases
        for name, p in m.named_parameters():
            if "weight" not in name or name.startswith("layer_norm"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _step_fn(m, rec, **kw):
    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return m(x, **kw)
    return step


def _loss(y):
    return (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum()


def _run(m, step, x0, steps, seed=1):
    """Forward + backward + SGD, ``steps`` times: outputs, input and parameter
    gradients, and the module's buffers after each step."""
    results = []
    torch.manual_seed(seed)  # NVFP4 stochastic rounding
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.1 * i)).requires_grad_()
        m.zero_grad(set_to_none=True)
        out = step(x)
        outs = out if isinstance(out, tuple) else (out,)
        sum(_loss(o) for o in outs if o.requires_grad).backward()
        results.append([o.detach().clone() for o in outs] + [x.grad.clone()]
                       + [p.grad.clone() for p in m.parameters()]
                       + [b.clone() for b in m.buffers()])
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad.to(p.dtype)
    return results


def compare_compiled(rec, normalization, activation, backend="aot_eager", steps=3,
                     shape=(2, 64, HIDDEN), step_kw=None, device="cpu", mode=None, **kw):
    _reset()
    kw["device"] = device
    m = _mlp(normalization, activation, **kw)
    state = copy.deepcopy(m.state_dict())
    x0 = torch.randn(shape, dtype=torch.bfloat16, device=device)
    step = _step_fn(m, rec, **(step_kw or {}))
    eager = _run(m, step, x0, steps)
    fresh = _mlp(normalization, activation, **kw)  # no buffers yet, as the eager one began
    fresh.load_state_dict(state)
    compiled = _run(fresh, torch.compile(_step_fn(fresh, rec, **(step_kw or {})),
                                         fullgraph=True, backend=backend, mode=mode),
                        x0, steps)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        assert len(e) == len(c)
        for j, (a, b) in enumerate(zip(e, c)):
            assert a.dtype == b.dtype and a.shape == b.shape, (i, j)
            assert torch.equal(a, b), f"step {i}: result {j} differs"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    return eager


# -- compiled == eager ---------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_compiled_equals_eager_aot_eager(name, config):
    results = compare_compiled(ALL_RECIPES[name], *config)
    n_params = 6 if config[0] == "LayerNorm" else 5
    n_buffers = 8 if name == "delayed" else 0  # both GEMMs' histories and scales
    assert len(results[0]) == 2 + n_params + n_buffers
    if name == "delayed":  # the state moved: the scales are no longer their initial ones
        assert not torch.equal(results[-1][-1], torch.ones(2))


@pytest.mark.parametrize("name", ["bf16", "mxfp8"])
def test_compiled_equals_eager_inductor(name):
    compare_compiled(ALL_RECIPES[name], "RMSNorm", "swiglu", backend="inductor", steps=2)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation_compiled_equals_eager(activation):
    compare_compiled(RECIPES["fp8_current"], "LayerNorm", activation, steps=2)


@pytest.mark.parametrize("kw", [dict(bias=False), dict(return_bias=True),
                                dict(return_layernorm_output=True),
                                dict(zero_centered_gamma=True),
                                dict(return_bias=True, return_layernorm_output=True)],
                         ids=lambda kw: ",".join(kw))
def test_flags_compiled_equals_eager(kw):
    results = compare_compiled(RECIPES["mxfp8"], "LayerNorm", "geglu", steps=2, **kw)
    outs = 1 + kw.get("return_bias", False) + kw.get("return_layernorm_output", False)
    assert len(results[0]) == outs + 1 + (6 if kw.get("bias", True) else 4)


def test_ragged_token_count_compiled_equals_eager():
    """201 tokens: the block formats pad their columnwise copies."""
    compare_compiled(RECIPES["fp8_block"], "RMSNorm", "swiglu", shape=(3, 67, HIDDEN), steps=2)


def test_weight_caching_compiled_equals_eager():
    for first in (True, False):
        compare_compiled(RECIPES["mxfp8"], "LayerNorm", "gelu", steps=2,
                         step_kw={"is_first_microbatch": first} if first else None)
    _reset()
    m = _mlp()
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    step = torch.compile(lambda x, first: _step_fn(m, RECIPES["mxfp8"],
                                                    is_first_microbatch=first)(x),
                         fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        y_first = step(x, True)
        m.fc1_weight.mul_(2)
        m.fc2_weight.mul_(2)
        y_cached = step(x, False)  # the weights cached on the first microbatch
        y_fresh = step(x, None)
    assert torch.equal(y_first, y_cached) and not torch.equal(y_first, y_fresh)
    assert {n for n, _ in m.named_buffers()} >= {"fc1_fp8_weight_rowwise_data",
                                                  "fc2_fp8_weight_rowwise_data"}


def test_torch_autocast_compiled_equals_eager():
    _reset()
    m = _mlp("RMSNorm", "swiglu", params_dtype=torch.float32)
    x0 = torch.randn(64, HIDDEN)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)
    state = copy.deepcopy(m.state_dict())
    eager = _run(m, step, x0, 2)
    m.load_state_dict(state)
    compiled = _run(m, torch.compile(step, fullgraph=True, backend="aot_eager"), x0, 2)
    assert eager[0][0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for e, c in zip(eager, compiled) for a, b in zip(e, c))


# -- against a reference: torch's norm, two te.Linear, the activation ---------------------
def _reference(m, x, rec):
    """Norm (torch, fp32, rounded once), te.Linear fc1, the activation (torch's
    functions in fp32), te.Linear fc2, sharing m's parameters (as leaves)."""
    fc1 = te.Linear(HIDDEN, m.fc1_weight.shape[0], params_dtype=torch.bfloat16)
    fc2 = te.Linear(m.fc2_weight.shape[1], HIDDEN, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for lin, w, b in ((fc1, m.fc1_weight, m.fc1_bias), (fc2, m.fc2_weight, m.fc2_bias)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    gamma = m.layer_norm_weight.detach().clone().requires_grad_()
    beta = (None if m.layer_norm_bias is None
            else m.layer_norm_bias.detach().clone().requires_grad_())
    xf = x.float()
    if m.normalization == "LayerNorm":
        ln = torch.nn.functional.layer_norm(xf, (HIDDEN,), gamma.float(), beta.float(), m.eps)
    else:
        ln = torch.nn.functional.rms_norm(xf, (HIDDEN,), gamma.float(), m.eps)
    ln = ln.to(x.dtype)
    torch_act = {"gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                 "relu": torch.relu, "silu": torch.nn.functional.silu,
                 "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
                 "srelu": lambda t: torch.relu(t) ** 2}
    with te.autocast(enabled=rec is not None, recipe=rec):
        h = fc1(ln).float()
        act = m.activation
        if act in M.GATED:
            base = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu", "qgeglu": "qgelu",
                    "sreglu": "srelu"}[act]
            a, b = h.chunk(2, -1)
            h = torch_act[base](a) * b
        else:
            h = torch_act[act](h)
        y = fc2(h.to(x.dtype))
    params = [gamma] + ([beta] if beta is not None else []) + [
        fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    return y, params


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_bf16_equals_reference(normalization, activation):
    """Within bf16 rounding: the activation rounds once from fp32 in both, but
    its fp32 formulas differ from torch's in the last bits."""
    m = _mlp(normalization, activation)
    x = torch.randn(2, 32, HIDDEN, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = m(x1)
    y_ref, ref_params = _reference(m, x2, None)
    _loss(y).backward()
    _loss(y_ref).backward()
    torch.testing.assert_close(y, y_ref)
    assert _rel(y, y_ref) < 2e-3
    assert _rel(x1.grad, x2.grad) < 1e-2
    for p, r in zip(m.parameters(), ref_params):
        assert _rel(p.grad, r.grad) < 1e-2


@pytest.mark.parametrize("name,tol", [("fp8_current", 0.02), ("mxfp8", 0.02),
                                      ("fp8_block", 0.02), ("nvfp4", 0.2),
                                      ("delayed", 0.02)])
def test_quantized_close_to_reference(name, tol):
    """The same quantized GEMMs as two te.Linear: the forward agrees up to
    activation last-bit differences that may move a quantized value by one step."""
    rec = ALL_RECIPES[name]
    m = _mlp("RMSNorm", "swiglu")
    x = torch.randn(2, 64, HIDDEN, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    with te.autocast(recipe=rec):
        y = m(x1)
    _loss(y).backward()
    torch.manual_seed(3)
    y_ref, ref_params = _reference(m, x2, rec)
    _loss(y_ref).backward()
    assert _rel(y, y_ref) < tol
    assert _rel(x1.grad, x2.grad) < 2 * tol
    for p, r in zip(m.parameters(), ref_params):
        assert _rel(p.grad, r.grad) < 2 * tol


def test_gated_activation_applies_to_the_first_half():
    """Transformer Engine's convention: act(first half) * second half."""
    m = _mlp("RMSNorm", "reglu", bias=False)
    with torch.no_grad():
        m.fc1_weight[:FFN].copy_(torch.eye(FFN, HIDDEN) * -1)  # the first half negative
        m.fc1_weight[FFN:].copy_(torch.eye(FFN, HIDDEN))
        m.fc2_weight.copy_(torch.eye(HIDDEN, FFN))
        x = torch.rand(8, HIDDEN, dtype=torch.bfloat16) + 0.5  # positive: relu(-x) = 0
        assert torch.count_nonzero(m(x)) == 0
        m.fc1_weight[:FFN].neg_()
        assert torch.count_nonzero(m(x)) > 0


# -- the generated ops: layout parity of the fakes, opcheck --------------------------------
FLAGS = [dict(zip(("bias", "x_rg", "params_rg", "ln_out"), c))
         for c in itertools.product([True, False], repeat=4) if c[1] or c[2]]
STATE_FLAGS = [dict(main_grad=True), dict(first=True), dict(first=False)]


def _op_args(name, normalization, activation, *, bias=True, x_rg=True, params_rg=True,
             ln_out=False, main_grad=False, first=None, lead=(2, 64)):
    """The forward op's arguments as the module builds them (and the module)."""
    m = _mlp(normalization, activation, bias=bias, return_layernorm_output=ln_out,
             fuse_wgrad_accumulation=main_grad)
    for p in m.parameters():
        p.requires_grad_(params_rg)
    if main_grad:
        m.fc1_weight.main_grad = torch.zeros(m.fc1_weight.shape)
        m.fc2_weight.main_grad = torch.zeros(m.fc2_weight.shape)
    rec = ALL_RECIPES[name]
    x = torch.randn(*lead, HIDDEN, dtype=torch.bfloat16, requires_grad=x_rg)
    if first is False:  # fill the cache first
        with te.autocast(recipe=rec), torch.no_grad():
            m(x, is_first_microbatch=True)
    with te.autocast(enabled=rec is not None, recipe=rec):
        args = m._make_args(x, m._params(), first if rec is not None else None)
    return m, args


def _bwd_args(args, real, seed=1, detach=False):
    """The backward op's arguments; ``detach``: as the backward op gets them
    (grad mode off, no saved value requiring grad)."""
    torch.manual_seed(seed)
    out = real.outputs["out"]
    saved = real.saved
    if detach:
        saved = {k: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v
                 for k, v in saved.items()}
    grads = {"fc2_grad_output": torch.randn(out.shape, dtype=out.dtype),
             "grad_ln_out": None if real.outputs["ln_out"] is None
             else torch.randn_like(real.outputs["ln_out"])}
    return OPS.make_bwd_args(saved, M.layernorm_mlp_setup_context(args), grads)


@pytest.mark.parametrize("lead", [(2, 64), (3, 67)], ids=["tokens128", "tokens201"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_layout_parity_forward_and_backward(name, config, lead):
    combos = FLAGS + (STATE_FLAGS if name != "bf16" else STATE_FLAGS[:1])
    for flags in combos:
        _, args = _op_args(name, *config, **flags, lead=lead)
        protos = OPS.fwd_plan.to_protos(args)
        torch.manual_seed(0)
        real = M.layernorm_mlp_forward(args)
        fake = M.layernorm_mlp_forward_fake(protos)
        try:
            _assert_parity(real, fake, args, protos, OPS.fwd_plan.tensor_fields)
            bwd = _bwd_args(args, real)
            bwd_real = M.layernorm_mlp_backward(bwd)
            bwd_fake = M.layernorm_mlp_backward_fake(OPS.bwd_plan.to_protos(bwd))
            assert list(bwd_real) == list(bwd_fake)
            for k in bwd_real:
                assert _describe(bwd_real[k]) == _describe(bwd_fake[k]), k
        except AssertionError as e:
            raise AssertionError(f"{name} {flags}: {e}") from e


def test_parity_counts_what_the_flags_promise():
    """The layout is the intended one: each GEMM saves its columnwise input
    copy, the activation input is saved, nothing for GEMMs without gradients."""
    _, args = _op_args("mxfp8", "RMSNorm", "swiglu")
    saved = M.layernorm_mlp_forward(args).saved
    for p in ("fc1_", "fc2_"):
        assert saved[p + "inputmat"].get_usages() == {"rowwise": False, "columnwise": True}
    assert saved["act_inp"].shape[-1] == 2 * FFN
    _, args = _op_args("mxfp8", "RMSNorm", "swiglu", x_rg=False, params_rg=False)
    assert not (args.fc1_input_requires_grad or args.fc2_input_requires_grad)
    _, args = _op_args("bf16", "LayerNorm", "gelu", x_rg=False)
    assert args.fc2_input_requires_grad and args.fc1_input_requires_grad


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_opcheck_forward_and_backward_ops(name, config):
    main_grad = name in ("bf16", "delayed")
    _, args = _op_args(name, *config, main_grad=main_grad, ln_out=True, lead=(2, 32))
    if main_grad:  # their gradient goes to main_grad, not to the op's weight inputs
        args.fc1_weight, args.fc2_weight = args.fc1_weight.detach(), args.fc2_weight.detach()
    if name == "delayed":
        # the backward writes the live bwd scales, which opcheck's eager and compiled
        # runs share: run it once so that same data leave them where they are
        flat = OPS.fwd_plan.encode(args)
        outs = [o for o in OPS.fwd_op(*flat) if o.requires_grad]
        torch.autograd.backward([o.float().sum() for o in outs])
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), name != "bf16")
    real = M.layernorm_mlp_forward(args)
    bwd = _bwd_args(args, real, detach=True)
    opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), name != "bf16")


# -- state ---------------------------------------------------------------------------------
def test_delayed_state_round_trips_through_state_dict():
    rec = ALL_RECIPES["delayed"]
    m = _mlp()
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    step = _step_fn(m, rec)
    for _ in range(2):
        step(x.clone().requires_grad_()).float().sum().backward()
    extra = m.get_extra_state()
    assert extra.shape == (2 * (4 * 4 + 4),)
    sd = m.state_dict()
    resumed = _mlp()
    assert resumed.get_extra_state().numel() == 0
    resumed.load_state_dict(sd)
    for name in ("fc1_fp8_scale_fwd", "fc2_fp8_amax_history_bwd"):
        assert torch.equal(getattr(resumed, name), getattr(m, name))
    # both continue alike
    y, y_resumed = step(x), _step_fn(resumed, rec)(x)
    assert torch.equal(y, y_resumed)
    with pytest.raises(ValueError, match="extra state"):
        resumed.set_extra_state(torch.zeros(21))
    resumed.set_extra_state(torch.empty(0))
    assert "fc1_fp8_scale_fwd" not in dict(resumed.named_buffers())
    sd.pop("_extra_state")
    resumed.load_state_dict(sd)  # a checkpoint without extra state loads too


def test_deepcopy_has_its_own_state():
    rec = ALL_RECIPES["delayed"]
    m = _mlp()
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    _step_fn(m, rec)(x)
    c = copy.deepcopy(m)
    assert c._state_key != m._state_key
    assert c.fc1_fp8_scale_fwd.data_ptr() != m.fc1_fp8_scale_fwd.data_ptr()
    _reset()
    y = torch.compile(_step_fn(c, rec), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, _step_fn(m, rec)(x))
    assert torch.equal(c.fc2_fp8_amax_history_fwd, m.fc2_fp8_amax_history_fwd)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["bf16", "mxfp8"])
def test_fuse_wgrad_accumulation(name, compiled):
    """Weight gradients accumulate into main_grad (two backwards), equal to
    the sum of the unfused module's .grad; no .grad on the weights."""
    _reset()
    rec = ALL_RECIPES[name]
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    plain, fused = _mlp(), _mlp(fuse_wgrad_accumulation=True)
    for w in (fused.fc1_weight, fused.fc2_weight):
        w.main_grad = torch.zeros(w.shape)
    expect = {}
    for m in (plain, fused):
        step = _step_fn(m, rec)
        if compiled:
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        for i in range(2):
            torch.manual_seed(i)
            _loss(step(x * (1 + i))).backward()
            if m is plain:
                for n in ("fc1_weight", "fc2_weight"):
                    g = getattr(m, n).grad.float()
                    expect[n] = expect.get(n, 0) + g
                m.zero_grad(set_to_none=True)
    for n in ("fc1_weight", "fc2_weight"):
        assert getattr(fused, n).grad is None
        torch.testing.assert_close(getattr(fused, n).main_grad, expect[n], rtol=1e-2, atol=1e-2)
    assert fused.fc1_bias.grad is not None


def test_fuse_wgrad_accumulation_needs_main_grad():
    m = _mlp(fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="fc1_weight.main_grad"):
        m(torch.randn(8, HIDDEN, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", ["mxfp8", "delayed"])
def test_te_checkpoint_equals_plain(name):
    rec = ALL_RECIPES[name]
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    grads = []
    for ckpt in (False, True):
        m = _mlp("RMSNorm", "swiglu")
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=rec):
            y = te.checkpoint(m, xi) if ckpt else m(xi)
        _loss(y).backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()] + list(m.buffers()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(activation="tanh"), "activation must be one of"),
    (dict(normalization="BatchNorm"), "normalization must be one of"),
    (dict(sequence_parallel=True), "needs set_parallel_mode=True"),
    (dict(tp_size=2, set_parallel_mode=True), "needs tp_group"),
    (dict(eps=-1.0), "eps must be"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        te.LayerNormMLP(HIDDEN, FFN, **kw)
    with pytest.raises(ValueError, match="ffn_hidden_size must be a positive int"):
        te.LayerNormMLP(HIDDEN, 0)


def test_sizes_the_recipe_cannot_take_name_the_gemm():
    m = te.LayerNormMLP(HIDDEN, 48, params_dtype=torch.bfloat16)  # MXFP8: blocks of 32
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=RECIPES["mxfp8"]):
        with pytest.raises(ValueError, match=r"fc1 \(128 -> 48\): the grad_output as a 64 x 48"):
            m(x)
        with torch.no_grad(), pytest.raises(ValueError,
                                            match=r"fc2 \(48 -> 128\): the input as a 64 x 48"):
            m(x)
    m = _mlp()
    with pytest.raises(ValueError, match="must end in 128"):
        m(torch.randn(64, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="differs from fc1_weight"):
        m(torch.randn(64, HIDDEN))  # fp32 input, bf16 weights, no recipe


def test_parameters_and_shapes_as_transformer_engine():
    m = te.LayerNormMLP(HIDDEN, FFN, activation="swiglu", params_dtype=torch.bfloat16)
    assert [n for n, _ in m.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
        "fc2_bias"]
    assert m.fc1_weight.shape == (2 * FFN, HIDDEN) and m.fc2_weight.shape == (HIDDEN, FFN)
    m = te.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", bias=False)
    assert [n for n, _ in m.named_parameters()] == ["layer_norm_weight", "fc1_weight",
                                                   "fc2_weight"]
    assert torch.equal(m.layer_norm_weight, torch.ones(HIDDEN))
    m = te.LayerNormMLP(HIDDEN, FFN, return_bias=True, return_layernorm_output=True,
                        zero_centered_gamma=True)
    x = torch.randn(4, HIDDEN)
    out, bias, ln_out = m(x)
    assert bias is m.fc2_bias and ln_out.shape == x.shape
    assert torch.equal(m.layer_norm_weight, torch.zeros(HIDDEN))


# -- eager fallback ------------------------------------------------------------------------
def test_unregistered_quantizer_falls_back(monkeypatch):
    import warnings

    from test_linear_ops import _unregistered_input_quantizer

    _unregistered_input_quantizer(monkeypatch)
    _reset()
    m = _mlp("RMSNorm", "swiglu")
    x = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    step = torch.compile(_step_fn(m, RECIPES["fp8_current"]), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [step(x) for _ in range(2)]
    assert m.compile_fallbacks() == ("quantizer_not_value_opaque",)
    assert sum("falls back to eager" in str(w.message) for w in caught) == 1
    assert torch.equal(outs[0], _step_fn(m, RECIPES["fp8_current"])(x))
    assert te.fallback_report(torch.nn.Sequential(m)) == {"0": ("quantizer_not_value_opaque",)}


@pytest.mark.parametrize("qname", ["fp8", "mxfp8"])
def test_fp8_primary_weights_compiled_equals_eager(qname):
    """Both weights stored quantized (FP8 primary weights): no weight
    quantization in the ops, gradients in high precision."""
    _reset()
    m = _mlp("RMSNorm", "swiglu")
    q = {"fp8": te.Float8CurrentScalingQuantizer("e4m3"), "mxfp8": te.MXFP8Quantizer()}[qname]
    m.fc1_weight = torch.nn.Parameter(q(m.fc1_weight.detach()))
    m.fc2_weight = torch.nn.Parameter(q(m.fc2_weight.detach()))
    rec = RECIPES["fp8_current"] if qname == "fp8" else RECIPES["mxfp8"]
    x0 = torch.randn(64, HIDDEN, dtype=torch.bfloat16)
    results = []
    for step in (_step_fn(m, rec), torch.compile(_step_fn(m, rec), fullgraph=True,
                                                 backend="aot_eager")):
        x = x0.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = step(x)
        _loss(y).backward()
        results.append([y, x.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        assert type(a) is torch.Tensor and torch.equal(a, b)
    assert results[0][3].dtype == torch.bfloat16  # fc1_weight's gradient
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("name", ["mxfp8", "delayed"])
def test_te_export_round_trip(name, tmp_path):
    """te.export's program survives torch.export.save/load and equals eager."""
    from transformer_engine_compile import compat

    if not compat.export_keeps_opaque_constants():
        pytest.skip("this torch cannot save opaque constants")
    _reset()
    rec = ALL_RECIPES[name]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _mlp("RMSNorm", "swiglu")

        def forward(self, x):
            with te.autocast(recipe=rec):
                return self.mlp(x)

    model, x = Model(), torch.randn(32, HIDDEN, dtype=torch.bfloat16)
    model(x)  # delayed: some history
    eager = copy.deepcopy(model)
    torch.export.save(te.export(model, (x,)), tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    for i in range(2):
        xi = x * (i + 1)
        assert torch.equal(loaded(xi), eager(xi))
