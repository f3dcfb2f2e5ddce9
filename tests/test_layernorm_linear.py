"""te.LayerNormLinear: compiled equals eager bit for bit, equals torch's norm
followed by te.Linear, fakes mirror the real layout, opcheck, TP/SP (gloo),
and the training patterns te.Linear supports."""

import contextlib
import copy
import io
import itertools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import kernels, recipe
from transformer_engine_compile.module.layernorm import linear_ops as LN

from test_linear import RECIPES, _reset
from test_linear_ops import OP_RECIPES, _assert_parity, _describe, opcheck

OPS = LN.LAYERNORM_LINEAR_OPS
NORMS = ("LayerNorm", "RMSNorm")


def _layer(norm="LayerNorm", dtype=torch.bfloat16, seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    layer = te.LayerNormLinear(128, 128, normalization=norm, params_dtype=dtype, device=device,
                               **kw)
    with torch.no_grad():  # a gamma (and beta) away from their initial values
        layer.layer_norm_weight.normal_(0.0 if layer.zero_centered_gamma else 1.0, 0.5)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.normal_(0, 0.5)
    return layer


def _outputs(y):
    return list(y) if isinstance(y, tuple) else [y]


def _run(layer, step, x0, steps=3):
    """Forward, a loss on every output, backward, SGD; everything per step."""
    results = []
    torch.manual_seed(1)  # NVFP4 stochastic rounding
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.1 * i)).requires_grad_()
        layer.zero_grad(set_to_none=True)
        outs = _outputs(step(x))
        loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum()
                   for o in outs if o.requires_grad)
        loss.backward()
        results.append([o.detach().clone() for o in outs] + [x.grad.clone()]
                       + [p.grad.clone() for p in layer.parameters()])
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.01 * p.grad.to(p.dtype)
    return results


def _step(layer, rec, **kw):
    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x, **kw)
    return step


def compare_compiled(layer, rec, x0, backend="aot_eager", steps=3, mode=None, **kw):
    _reset()
    state = copy.deepcopy(layer.state_dict())
    step = _step(layer, rec, **kw)
    eager = _run(layer, step, x0, steps)
    layer.load_state_dict(state)
    compiled = _run(layer, torch.compile(step, fullgraph=True, backend=backend, mode=mode),
                    x0, steps)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        assert len(e) == len(c)
        for j, (a, b) in enumerate(zip(e, c)):
            assert a.dtype == b.dtype and a.shape == b.shape, (i, j)
            assert torch.equal(a, b), f"step {i}: result {j} differs"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    return eager


FLAGS = [dict(), dict(bias=False, return_layernorm_output=True),
         dict(zero_centered_gamma=True, return_bias=True, return_layernorm_output=True)]


@pytest.mark.parametrize("flags", range(len(FLAGS)))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_equals_eager(name, norm, flags):
    layer = _layer(norm, **FLAGS[flags])
    results = compare_compiled(layer, RECIPES[name], torch.randn(2, 64, 128, dtype=torch.bfloat16))
    n_out = 1 + FLAGS[flags].get("return_bias", 0) + FLAGS[flags].get("return_layernorm_output", 0)
    n_params = len(list(layer.parameters()))
    assert len(results[0]) == n_out + 1 + n_params


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_compiled_equals_eager_inductor(name):
    compare_compiled(_layer("RMSNorm", return_layernorm_output=True), RECIPES[name],
                     torch.randn(3, 64, 128, dtype=torch.bfloat16), backend="inductor", steps=2)


def test_delayed_scaling_compiled_equals_eager_with_state():
    layer = _layer("LayerNorm")
    compare_compiled(layer, recipe.DelayedScaling(amax_history_len=4),
                     torch.randn(128, 128, dtype=torch.bfloat16))
    assert layer.fp8_amax_history_fwd.shape == (4, 2) and layer.fp8_scale_bwd.shape == (2,)


# -- delayed scaling: the norm writes FP8 itself ----------------------------------------
DELAYED_FUSION_CASES = [  # (module, options)
    ("LayerNormLinear", {"normalization": "LayerNorm"}),
    ("LayerNormLinear", {"normalization": "RMSNorm", "return_layernorm_output": True}),
    ("LayerNormLinear", {"normalization": "LayerNorm", "zero_centered_gamma": True}),
    ("LayerNormMLP", {"normalization": "RMSNorm", "activation": "swiglu"}),
]


def _delayed_fusion_module(module, options, device):
    torch.manual_seed(0)
    cls = getattr(te, module)
    n = 128
    layer = cls(n, 192, params_dtype=torch.bfloat16, device=device, **options)
    with torch.no_grad():
        layer.layer_norm_weight.normal_(0.0 if layer.zero_centered_gamma else 1.0, 0.5)
    return layer


@contextlib.contextmanager
def _kernel_calls():
    """Records (kernel op, shape of its first argument) of each kernel run."""
    calls, real_get = [], kernels.get

    def get(name, x):
        fn = real_get(name, x)

        def run(*args, **kw):
            calls.append((name, tuple(args[0].shape)))
            return fn(*args, **kw)
        return run
    with mock.patch.object(kernels, "get", get):
        yield calls


def delayed_norm_fusion_runs(module, options, device="cpu", compiled=False, steps=3):
    """Train under DelayedScaling with the norm writing FP8 itself and with that
    turned off (the norm's output quantized by ``te.Linear``'s path): both
    runs' outputs, gradients, delayed-scaling buffers and the kernel ops
    they ran."""
    rec = recipe.DelayedScaling(amax_history_len=4)
    x0 = torch.randn(2, 64, 128, dtype=torch.bfloat16, device=device)
    runs = []
    for fused in (True, False):
        _reset()
        layer = _delayed_fusion_module(module, options, device)
        step = _step(layer, rec)
        if compiled:
            step = torch.compile(step, backend="inductor" if device == "cuda" else "aot_eager",
                                 fullgraph=True)
        with contextlib.ExitStack() as stack:
            # both runs compile one graph: no compile cache may serve the first's code
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
            if not fused:
                stack.enter_context(mock.patch.object(LN, "_fp8_writing_quantizer",
                                                      lambda args: None))
            # compiled: recorded while traced (an op lowered into inductor runs
            # its kernels from the generated code)
            calls = stack.enter_context(_kernel_calls())
            results = _run(layer, step, x0, steps)
        buffers = [b.clone() for b in layer.buffers()]
        runs.append((results, buffers, calls))
    return runs


def assert_delayed_norm_fusion_exact(module, options, runs):
    (fused, fused_state, calls), (plain, plain_state, plain_calls) = runs
    ln_shape = (128, 128)  # the norm's output, (tokens, in_features)
    assert ("norm_forward_fp8", ln_shape) in calls and ("norm_forward", ln_shape) in plain_calls
    assert not any(name == "norm_forward" for name, _ in calls)
    assert not any(name == "norm_forward_fp8" for name, _ in plain_calls)
    # te.Linear's path quantizes the norm's output (with W, in one kernel op), the
    # fused one leaves nothing to quantize (LayerNormMLP's fc2 quantizes a
    # gradient of that shape too)
    assert ("quantize_fp8_delayed", ln_shape) in plain_calls
    if module == "LayerNormLinear":
        assert not any(name.startswith("quantize_fp8") and shape == ln_shape
                       for name, shape in calls)
    assert len(fused) == len(plain) and len(fused_state) == len(plain_state) > 0
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert len(a) == len(b)
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"{module} {options}: step {step}, result {i} differs"
    for u, v in zip(fused_state, plain_state):
        assert torch.equal(u, v), f"{module} {options}: delayed-scaling state differs"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("module, options", DELAYED_FUSION_CASES)
def test_delayed_scaling_norm_writes_fp8_itself(module, options, compiled):
    """Under DelayedScaling the scale is known before the norm runs, so the
    norm's kernel op writes its output's FP8 copy and records its amax: no
    quantize of the norm's output follows, and outputs, gradients, amax histories and scales equal the unfused path's bit for bit
    over several steps (the returned norm output included)."""
    assert_delayed_norm_fusion_exact(module, options,
                                     delayed_norm_fusion_runs(module, options, compiled=compiled))


def test_linear_forward_checks_a_prequantized_input_against_delayed_scaling():
    """linear_forward's callers under delayed scaling hand over the recorded
    amaxes with the quantized input, and only then."""
    from transformer_engine_compile.module.linear import (args as linear_args, compute as
                                                          linear_compute)
    args = _fwd_args("delayed")
    q = linear_args._input_quantizer(args)
    xq = q.quantize_with_scale(args.inp.detach(), args.scale_fwd[0])
    with pytest.raises(ValueError, match="amaxes"):
        linear_compute.linear_forward(args, xq)
    with pytest.raises(ValueError, match="amaxes"):
        linear_compute.linear_forward(args, None, amaxes=torch.zeros(2))
    bf16 = _fwd_args("bf16")
    with pytest.raises(ValueError, match="amaxes"):
        linear_compute.linear_forward(bf16, bf16.inp, amaxes=torch.zeros(2))


# -- against torch's normalisation followed by te.Linear ---------------------------------
def _reference(layer):
    """torch's norm (fp32 math, one rounding) feeding a te.Linear with the
    same weights: what LayerNormLinear promises to equal."""
    lin = te.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                    params_dtype=layer.weight.dtype)
    lin.load_state_dict({k: v for k, v in layer.state_dict().items()
                         if k in ("weight", "bias")}, strict=False)
    gamma = torch.nn.Parameter(layer.layer_norm_weight.detach().clone())
    beta = (None if layer.layer_norm_bias is None
            else torch.nn.Parameter(layer.layer_norm_bias.detach().clone()))

    def forward(x):
        g = gamma.float() + 1 if layer.zero_centered_gamma else gamma.float()
        if layer.normalization == "LayerNorm":
            h = F.layer_norm(x.float(), [x.shape[-1]], g, beta.float(), layer.eps)
        else:
            h = F.rms_norm(x.float(), [x.shape[-1]], g, layer.eps)
        return lin(h.to(x.dtype))
    return forward, [lin.weight, lin.bias, gamma, beta]


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("name", RECIPES)
def test_layernorm_equals_torch_norm_then_linear_bit_for_bit(name, zero_centered):
    """LayerNorm runs torch's own fp32 kernels, so the whole layer, its input
    gradient and every parameter gradient equal the composed reference exactly,
    for every recipe (the quantized GEMMs see the same bytes)."""
    layer = _layer("LayerNorm", zero_centered_gamma=zero_centered)
    ref, ref_params = _reference(layer)
    rec = RECIPES[name]
    x0 = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    got = []
    for fn, params in ((layer, [layer.weight, layer.bias, layer.layer_norm_weight,
                                layer.layer_norm_bias]), (ref, ref_params)):
        torch.manual_seed(1)
        x = x0.clone().requires_grad_()
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = fn(x)
        (y.float() * torch.linspace(-1, 1, 128)).sum().backward()
        got.append([y, x.grad] + [p.grad for p in params])
    for i, (a, b) in enumerate(zip(*got)):
        assert torch.equal(a, b), f"result {i} differs"


@pytest.mark.parametrize("name", ["bf16", "fp8_current"])
def test_rmsnorm_close_to_torch_rms_norm_then_linear(name):
    """RMSNorm's fp32 formula is ours (torch's rms_norm kernels differ by
    version): equal to the reference within fp32 rounding before the GEMM."""
    layer = _layer("RMSNorm", dtype=torch.float32)
    ref, ref_params = _reference(layer)
    rec = RECIPES[name]
    x0 = torch.randn(2, 64, 128)
    got = []
    for fn, params in ((layer, [layer.weight, layer.bias, layer.layer_norm_weight]),
                       (ref, ref_params[:3])):
        x = x0.clone().requires_grad_()
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = fn(x)
        (y.float() * torch.linspace(-1, 1, 128)).sum().backward()
        got.append([y, x.grad] + [p.grad for p in params])
    tol = 1e-5 if rec is None else 0.02  # quantization may flip a rounding
    for i, (a, b) in enumerate(zip(*got)):
        err = ((a - b).norm() / b.norm()).item()
        assert err < tol, f"result {i}: relative error {err}"


def test_return_layernorm_output_is_the_normalised_input_and_gets_its_gradient():
    layer = _layer("LayerNorm", return_layernorm_output=True, return_bias=True)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=RECIPES["fp8_current"]):
        out, bias, ln_out = layer(x)
    assert bias is layer.bias
    expected = F.layer_norm(x.float(), [128], layer.layer_norm_weight.float(),
                            layer.layer_norm_bias.float()).to(torch.bfloat16)
    assert torch.equal(ln_out, expected)
    # a loss on ln_out alone: x's gradient is the norm's backward of it
    (gx,) = torch.autograd.grad(ln_out.float().sum(), x, retain_graph=True)
    (gx_ref,) = torch.autograd.grad(expected.float().sum(), x)
    assert torch.equal(gx, gx_ref)


def test_frozen_input_still_trains_the_norm():
    """x without grad but gamma/beta trainable: the linear's dgrad still runs."""
    layer = _layer("LayerNorm")
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with te.autocast(recipe=RECIPES["mxfp8"]):
        layer(x).float().sum().backward()
    assert layer.layer_norm_weight.grad is not None and layer.layer_norm_bias.grad is not None
    assert layer.layer_norm_weight.grad.abs().sum() > 0


# -- fakes and opcheck ------------------------------------------------------------------
def _fwd_args(name, norm="LayerNorm", lead=(2, 64), x_rg=True, w_rg=True, gamma_rg=True,
              return_ln=False, zero_centered=False, main_grad=False, cache=None):
    """Forward arguments as the module builds them (so the flags combine as in use)."""
    layer = _layer(norm, zero_centered_gamma=zero_centered, return_layernorm_output=return_ln,
                   fuse_wgrad_accumulation=main_grad)
    layer.weight.requires_grad_(w_rg)
    layer.layer_norm_weight.requires_grad_(gamma_rg)
    if layer.layer_norm_bias is not None:
        layer.layer_norm_bias.requires_grad_(gamma_rg)
    if main_grad:
        layer.weight.main_grad = torch.zeros(128, 128)
    x = torch.randn(*lead, 128, dtype=torch.bfloat16, requires_grad=x_rg)
    rec = OP_RECIPES[name]
    with te.autocast(enabled=rec is not None, recipe=rec):
        return layer._make_args(x, cache, False, False)


COMBOS = [dict(zip(("x_rg", "w_rg", "gamma_rg", "return_ln"), c))
          for c in itertools.product([True, False], repeat=4) if any(c[:3])]
COMBOS += [dict(norm="RMSNorm", zero_centered=True), dict(main_grad=True),
           dict(cache=True), dict(cache=True, x_rg=False, gamma_rg=False)]


def _check_parity(args):
    protos = OPS.fwd_plan.to_protos(args)
    real = LN.layernorm_linear_forward(args)
    fake = LN.layernorm_linear_forward_fake(protos)
    _assert_parity(real, fake, args, protos, OPS.fwd_plan.tensor_fields)
    grads = {"grad_output": torch.randn(*args.inp.shape[:-1], 128, dtype=torch.bfloat16)}
    if args.return_layernorm_output:
        grads["grad_ln_out"] = torch.randn_like(args.inp)
    bwd = OPS.make_bwd_args(real.saved, LN.layernorm_linear_setup_context(args), grads)
    bwd_real = LN.layernorm_linear_backward(bwd)
    bwd_fake = LN.layernorm_linear_backward_fake(OPS.bwd_plan.to_protos(bwd))
    assert list(bwd_real) == list(bwd_fake)
    for k in bwd_real:
        assert _describe(bwd_real[k]) == _describe(bwd_fake[k]), k
    return real, bwd


@pytest.mark.parametrize("lead", [(2, 64), (3, 67)], ids=["tokens128", "tokens201"])
@pytest.mark.parametrize("name", OP_RECIPES)
def test_layout_parity_forward_and_backward(name, lead):
    for flags in COMBOS:
        try:
            _check_parity(_fwd_args(name, lead=lead, **flags))
        except AssertionError as e:
            raise AssertionError(f"{name} {flags}: {e}") from e


def test_parity_saves_what_the_norm_backward_needs():
    real, _ = _check_parity(_fwd_args("fp8_current"))
    assert real.saved["ln_mean"].dtype == torch.float32 and real.saved["ln_mean"].shape == (128,)
    real, _ = _check_parity(_fwd_args("fp8_current", norm="RMSNorm"))
    assert real.saved["ln_mean"] is None and real.saved["ln_rstd"].shape == (128,)
    real, _ = _check_parity(_fwd_args("bf16", x_rg=False, gamma_rg=False))
    assert real.saved["ln_inp"] is None  # nothing before the norm needs a gradient


@pytest.mark.parametrize("lead", [(2, 64), (7,)], ids=["tokens128", "tokens7"])
@pytest.mark.parametrize("name", OP_RECIPES)
def test_opcheck(name, lead):
    args = _fwd_args(name, lead=lead, return_ln=True, main_grad=name in ("bf16", "delayed"))
    rec = OP_RECIPES[name]
    if args.main_grad is not None:  # its gradient goes to main_grad, none to the weight
        args.weight = args.weight.detach()
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), rec is not None)
    real, bwd = _check_parity(args)
    for f in OPS.bwd_plan.tensor_fields:  # the backward op runs with grad mode off
        value = getattr(bwd, f)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            setattr(bwd, f, value.detach())
    opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), rec is not None)


# -- arguments --------------------------------------------------------------------------
def test_parameters_and_initialisation():
    layer = te.LayerNormLinear(64, 32, normalization="RMSNorm", params_dtype=torch.bfloat16)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias", "layer_norm_weight"]
    assert torch.equal(layer.layer_norm_weight, torch.ones(64, dtype=torch.bfloat16))
    layer = te.LayerNormLinear(64, 32, zero_centered_gamma=True, bias=False)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "layer_norm_weight",
                                                         "layer_norm_bias"]
    assert not layer.layer_norm_weight.any() and not layer.layer_norm_bias.any()
    meta = te.LayerNormLinear(64, 32, device="meta")
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert torch.equal(meta.layer_norm_weight, torch.ones(64))
    assert torch.isfinite(meta.weight).all() and meta.weight.abs().sum() > 0


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="normalization must be one of"):
        te.LayerNormLinear(64, 32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="eps"):
        te.LayerNormLinear(64, 32, eps=-1.0)
    with pytest.raises(ValueError, match="parallel_mode must be None or 'column'"):
        te.LayerNormLinear(64, 32, parallel_mode="row")
    layer = te.LayerNormLinear(64, 32)
    with pytest.raises(ValueError, match="must end in 64"):
        layer(torch.randn(4, 32))
    with pytest.raises(NotImplementedError, match="fp8_grad"):
        with te.autocast(recipe=RECIPES["fp8_current"]):
            layer(torch.randn(32, 64, requires_grad=True), fp8_grad=True)


# -- training patterns --------------------------------------------------------------------
def _train(model, rec, xs, first_microbatch=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, x in enumerate(xs):
        with te.autocast(enabled=rec is not None, recipe=rec):
            kw = {} if first_microbatch is None else {"is_first_microbatch": i % 2 == 0}
            loss = model(x, **kw).float().square().mean()
        loss.backward()
        if first_microbatch is None or i % 2 == 1:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_state_dict_resume_continues_bit_identically_under_delayed_scaling():
    rec = recipe.DelayedScaling(amax_history_len=4)
    xs = [torch.randn(64, 128) for _ in range(6)]
    layer = _layer("LayerNorm", dtype=torch.float32)
    start = copy.deepcopy(layer.state_dict())
    full = _train(layer, rec, xs)
    layer = _layer("LayerNorm", dtype=torch.float32)
    layer.load_state_dict(start)
    _train(layer, rec, xs[:3])
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    resumed = _layer("LayerNorm", dtype=torch.float32, seed=5)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf), strict=True)
    assert torch.equal(_train(resumed, rec, xs[3:]), full[3:])


def test_deepcopy_and_compiled_copy_train_like_the_original():
    rec = RECIPES["fp8_current"]
    layer = _layer("RMSNorm", dtype=torch.float32)
    twin = copy.deepcopy(layer)
    xs = [torch.randn(64, 128) for _ in range(3)]
    _reset()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    assert torch.equal(_train(layer, rec, xs), _train(compiled, rec, xs))
    assert torch.equal(layer.layer_norm_weight, twin.layer_norm_weight)


def test_weight_caching_and_fuse_wgrad_accumulation():
    rec = RECIPES["fp8_current"]
    xs = [torch.randn(64, 128, dtype=torch.bfloat16) for _ in range(4)]
    a = _layer("LayerNorm", fuse_wgrad_accumulation=True)
    b = copy.deepcopy(a)
    for m in (a, b):
        m.weight.main_grad = torch.zeros(128, 128)
    _reset()
    step_b = torch.compile(b, fullgraph=True, backend="aot_eager")
    for i, x in enumerate(xs):
        for m, fn in ((a, a), (b, step_b)):
            with te.autocast(recipe=rec):
                fn(x.clone().requires_grad_(), is_first_microbatch=i == 0).float().sum().backward()
    assert a.weight.grad is None and a.weight.main_grad.abs().sum() > 0
    assert torch.equal(a.weight.main_grad, b.weight.main_grad)
    assert torch.equal(a.layer_norm_weight.grad, b.layer_norm_weight.grad)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_equals_no_checkpointing(compiled):
    rec = recipe.DelayedScaling(amax_history_len=4)
    x0 = torch.randn(64, 128)
    results = []
    for ckpt in (False, True):
        _reset()
        layer = _layer("LayerNorm", dtype=torch.float32)

        def fn(x):
            with te.autocast(recipe=rec):
                return te.checkpoint(layer, x) if ckpt else layer(x)
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()
        results.append([x.grad, layer.layer_norm_weight.grad, layer.weight.grad,
                        layer.fp8_scale_bwd.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_torch_autocast_output_dtype_and_compiled_equals_eager():
    layer = _layer("LayerNorm", dtype=torch.float32)
    x = torch.randn(64, 128)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)
    eager = step(x)
    _reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert eager.dtype == torch.bfloat16 and torch.equal(eager, compiled)


# -- tensor / sequence parallel (gloo, 2 processes) ------------------------------------------
def _tp_worker(group, sp, names, device="cpu", backend="aot_eager"):
    """Column-parallel LayerNormLinear (with or without SP) on this rank:
    compiled equals eager bit for bit, and equals the single-device layer."""
    import tp_harness as H

    rank, tp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    sl = H.Slicer("column", sp, rank, tp)
    for name in names:
        rec = RECIPES[name]
        x_full, w_full, b_full, dy_full = H.full_tensors(rec, device)
        gamma = 1 + 0.25 * torch.randn(H.IN, generator=torch.Generator().manual_seed(3))
        ref = te.LayerNormLinear(H.IN, H.OUT, params_dtype=torch.bfloat16, device=device)
        layer = te.LayerNormLinear(H.IN, H.OUT, params_dtype=torch.bfloat16, device=device,
                                   parallel_mode="column", sequence_parallel=sp, tp_group=group)
        for m in (ref, layer):
            m.load_full_weight_(w_full, b_full)
            with torch.no_grad():
                m.layer_norm_weight.copy_(gamma)

        def run(m, fn, x, dy, steps):
            out = []
            torch.manual_seed(1)
            for i in range(steps):
                xi = (x * (1 + 0.125 * i)).requires_grad_()
                m.zero_grad(set_to_none=True)
                y = fn(xi)
                y.backward(dy)
                out.append([y.detach().clone(), xi.grad.clone()]
                           + [p.grad.clone() for p in m.parameters()])
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.01 * p.grad.to(p.dtype)
            return out

        expected = run(ref, _step(ref, rec), x_full, dy_full, 1)[0]
        state = copy.deepcopy(layer.state_dict())
        x0, dy0 = sl.inp(x_full), sl.out(dy_full)
        eager = run(layer, _step(layer, rec), x0, dy0, 2)
        _reset()
        layer.load_state_dict(state)
        compiled = run(layer, torch.compile(_step(layer, rec), fullgraph=True,
                                            backend=backend), x0, dy0, 2)
        for e, c in zip(eager, compiled):
            for a, b in zip(e, c):
                assert torch.equal(a, b), f"{name} sp={sp}: compiled != eager"
        assert counters["stats"]["unique_graphs"] == 1
        # out, dx, dW, db, dgamma, dbeta against the single-device layer
        want = [sl.out(expected[0]), sl.inp(expected[1]), sl.weight(expected[2]),
                sl.bias(expected[3]), expected[4], expected[5]]
        tol = 0.02 if rec is None else H.REL_TOL[name]
        for i, (got, w) in enumerate(zip(eager[0], want)):
            assert got.shape == w.shape, (name, i)
            err = H.rel_err(got, w)
            assert err <= tol, f"{name} sp={sp}: result {i} rel. error {err:.4f}"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("sp", [False, True], ids=["column", "column_sp"])
def test_tp_column_and_sequence_parallel_equal_single_device(sp):
    import tp_harness as H
    H.spawn(_tp_worker, sp, ["bf16", "fp8_current", "mxfp8"])


if __name__ == "__main__":  # 2 GPUs, NCCL: qa/L1_distributed/test.sh runs it under torchrun
    import os

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    import tp_harness

    tp_harness.fit_sizes(torch.distributed.get_world_size())
    world = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    for sequence_parallel in (False, True):
        _tp_worker(world, sequence_parallel, list(RECIPES), device="cuda", backend="inductor")
        print(f"rank {torch.distributed.get_rank()}: LayerNormLinear column "
              f"sp={sequence_parallel}: every recipe ok", flush=True)
    torch._dynamo.reset()
    torch.distributed.destroy_process_group()
