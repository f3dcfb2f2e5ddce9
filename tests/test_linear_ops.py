"""te.Linear's generated ops: layout parity of fakes, opcheck, eager fallback."""

import itertools
import warnings

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile import compat
from transformer_engine_compile.dynamo.custom_op import OpResult
from transformer_engine_compile.dynamo.tensor_proto import TensorProto
from transformer_engine_compile.module.linear import compute as L
from transformer_engine_compile.module.linear.args import LinearFwdArgs, _grad_output_quantizer
from transformer_engine_compile.module.linear.ops import LINEAR_OPS
from transformer_engine_compile.quantization import factory

from test_linear import RECIPES, _make_step, _reset

OPS = LINEAR_OPS
X = torch.randn(128, 128, dtype=torch.bfloat16)

# opcheck's test_schema (SchemaCheckMode compares the inputs of every aten op
# run inside the impl with allclose) and test_aot_dispatch_dynamic (sums every
# output for a loss) need float8 kernels that torch does not have on CPU.
# For ops that handle float8 buffers the same properties are checked by
# _check_schema_by_bytes and _check_aot_dispatch_dynamic below.
_FLOAT8_SAFE = ("test_autograd_registration", "test_faketensor")


def _tensors(flat):
    for a in flat:
        for t in (a if isinstance(a, list) else [a]):
            if isinstance(t, torch.Tensor):
                yield t


def _bits(t):
    return t.detach().view(torch.uint8) if t.element_size() == 1 else t.detach()


def _check_schema_by_bytes(op, flat):
    """No input mutated (compared as bytes), no output aliasing an input or another output."""
    inputs = [b for t in _tensors(flat) for b in (
        t.buffers().values() if isinstance(t, te.QuantizedTensor) else [t])]
    before = [t.detach().clone() for t in inputs]
    outs = op(*flat)
    for t, b in zip(inputs, before):
        assert torch.equal(_bits(t), _bits(b)), "input mutated"
    ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    out_ptrs = [o.untyped_storage().data_ptr() for o in outs]
    assert not set(out_ptrs) & ptrs, "an output aliases an input"
    assert len(set(out_ptrs)) == len(out_ptrs), "outputs alias each other"


def _check_aot_dispatch_dynamic(op, flat):
    """The op under AOTAutograd with dynamic shapes equals eager, outputs and
    gradients of the floating outputs w.r.t. the inputs that require grad."""
    _reset()
    inputs = [t for t in _tensors(flat) if t.requires_grad]

    def run(fn):
        torch.manual_seed(0)  # NVFP4 stochastic rounding
        outs = fn(*flat)
        loss = sum(o.float().sum() for o in outs if o.dtype.is_floating_point and o.requires_grad)
        grads = torch.autograd.grad(loss, inputs) if inputs else ()
        return [_bits(o) for o in outs], grads

    eager = run(op)
    compiled = run(torch.compile(lambda *a: op(*a), backend="aot_eager", dynamic=True,
                                 fullgraph=True))
    for a, b in zip(eager[0] + list(eager[1]), compiled[0] + list(compiled[1])):
        assert torch.equal(a, b)


def opcheck(op, flat, quantized):
    if quantized:
        torch.library.opcheck(op, tuple(flat), test_utils=_FLOAT8_SAFE)
        _check_schema_by_bytes(op, flat)
        _check_aot_dispatch_dynamic(op, flat)
    else:
        torch.library.opcheck(op, tuple(flat))


def _fwd_args(rec, *, bias=True, input_rg=True, weight_rg=True, save_original_input=False,
              save_original_weight=False, cache_weight=False, fp8_output=False, fp8_weight=False, workspace=False,
              main_grad=False, fp8_grad=False, lead=(2, 64)):
    torch.manual_seed(0)
    x = torch.randn(*lead, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 128, dtype=torch.bfloat16)
    q = (lambda role, **kw: te.quantizer_for(rec, role, **kw)) if rec is not None else None
    args = LinearFwdArgs(
        inp=x, weight=w, bias=torch.randn(128, dtype=torch.bfloat16) if bias else None,
        input_requires_grad=input_rg, weight_requires_grad=weight_rg, bias_requires_grad=bias,
        save_original_input=save_original_input, save_original_weight=save_original_weight,
        cache_weight=cache_weight and rec is not None)
    if rec is not None:
        args.input_quantizer = q("input", internal=True)
        args.weight_quantizer = q("weight", internal=True)
        args.grad_output_quantizer = q("grad_output", internal=True)
        if fp8_output:
            args.output_quantizer = q("output")
        if fp8_grad and input_rg:
            args.grad_input_quantizer = q("grad_input")

        def quantized_weight(**kw):
            wq = q("weight", **kw)
            return wq.quantize_with_scale(w, torch.ones(1)) if rec.delayed() else wq(w)

        if fp8_weight:
            args.weight = quantized_weight()
        elif workspace:
            args.weight_workspace = quantized_weight(internal=True)
        if rec.delayed():  # the layer's buffers, with a history and scales in use
            args.amax_history_fwd = torch.rand(4, 2)
            args.scale_fwd = torch.tensor([2.0, 4.0])
            args.amax_history_bwd, args.scale_bwd = torch.rand(4, 2), torch.tensor([0.5, 0.25])
    if main_grad:
        args.main_grad = torch.zeros(128, 128)
    return args


def _describe(value):
    """[(inner name, shape, stride, dtype), ...] of a real value or a proto."""
    if value is None:
        return None
    if isinstance(value, TensorProto):
        proto, value = value, value.create_tensor()
        assert type(value).__name__ == proto.create_metadata().cls_name.rsplit(".", 1)[-1] \
            if proto.is_quantized else True
    if isinstance(value, te.QuantizedTensorStorage):
        names, _ = type(value).__tensor_flatten__(value)
        return [type(value).__name__] + [
            (n, tuple(getattr(value, n).shape), getattr(value, n).stride(), getattr(value, n).dtype)
            for n in names]
    return [("tensor", tuple(value.shape), value.stride(), value.dtype)]


def _alias_map(result: OpResult, args, fields):
    ids = {id(getattr(args, f)): f"arg:{f}" for f in fields if getattr(args, f) is not None}
    ids.update({id(v): f"out:{k}" for k, v in result.outputs.items() if v is not None})
    return {k: ids.get(id(v)) for k, v in result.saved.items() if v is not None}


def _assert_parity(real: OpResult, fake: OpResult, args, protos, fields):
    assert list(real.outputs) == list(fake.outputs) and list(real.saved) == list(fake.saved)
    for kind in ("outputs", "saved"):
        for name in getattr(real, kind):
            r, f = getattr(real, kind)[name], getattr(fake, kind)[name]
            assert _describe(r) == _describe(f), f"{kind}[{name!r}]"
    assert _alias_map(real, args, fields) == _alias_map(fake, protos, fields)


FLAG_COMBOS = [dict(zip(("bias", "input_rg", "weight_rg", "save_original_input", "cache_weight"), c))
               for c in itertools.product([True, False], repeat=5) if c[1] or c[2]]
EXTRA_COMBOS = [dict(fp8_output=True, input_rg=False, weight_rg=False),
                dict(fp8_weight=True), dict(fp8_weight=True, input_rg=False),
                dict(workspace=True), dict(workspace=True, weight_rg=False),
                dict(workspace=True, cache_weight=True),
                # W saved as it is for the backward to quantize (DelayedScaling,
                # a cache or a workspace keep the forward's copy instead)
                dict(save_original_weight=True), dict(save_original_weight=True, bias=False),
                dict(save_original_weight=True, weight_rg=False),
                dict(save_original_weight=True, input_rg=False),
                dict(save_original_weight=True, save_original_input=True),
                dict(save_original_weight=True, cache_weight=True),
                dict(save_original_weight=True, workspace=True),
                dict(save_original_weight=True, fp8_weight=True)]
STATE_COMBOS = [dict(main_grad=True), dict(main_grad=True, input_rg=False)]
# fp8_grad (quantized dgrad) and quantized incoming dy: the FP8 recipes only
FP8_GRAD_RECIPES = ("fp8_current", "fp8_block", "mxfp8", "delayed")
FP8_GRAD_COMBOS = [dict(fp8_grad=True), dict(fp8_grad=True, weight_rg=False),
                   dict(fp8_grad=True, bias=False, main_grad=True)]


def _grad_outputs(name, lead=(2, 64)):
    """dy plain, and for the FP8 recipes quantized as another layer's
    fp8_grad makes it (both copies, read as is) and rowwise only (dequantized)."""
    torch.manual_seed(1)
    dy = torch.randn(*lead, 128, dtype=torch.bfloat16)
    if name not in FP8_GRAD_RECIPES:
        return [dy]
    q = factory.quantizer_for(OP_RECIPES[name], "grad_input")
    if name == "delayed":  # made with the producer's grad-input scale
        return [dy] + [q.with_usage(columnwise=c).quantize_with_scale(dy, torch.tensor(0.125))
                       for c in (True, False)]
    return [dy, q(dy), q.with_usage(columnwise=False)(dy)]
# DelayedScaling is a recipe of the ops (its state comes from te.Linear's buffers)
OP_RECIPES = {**RECIPES, "delayed": recipe.DelayedScaling(amax_history_len=4)}


@pytest.mark.parametrize("lead", [(2, 64), (3, 67)], ids=["tokens128", "tokens201"])
@pytest.mark.parametrize("name", OP_RECIPES)
def test_layout_parity_forward_and_backward(name, lead):
    """Fake against real for every recipe and flag combination: outputs and
    saved tensors (count, shapes, strides, dtypes, inner-buffer names, aliases),
    at a token count every block divides and at a ragged one (201 rows:
    the block formats pad their columnwise copies)."""
    rec = OP_RECIPES[name]
    combos = FLAG_COMBOS + STATE_COMBOS + (EXTRA_COMBOS if rec is not None else [])
    if name in FP8_GRAD_RECIPES:
        combos = combos + FP8_GRAD_COMBOS
    if name == "delayed":  # te.Linear refuses these two with DelayedScaling
        combos = [c for c in combos if not (c.get("save_original_input") or c.get("fp8_output"))]
    if name in FP8_GRAD_RECIPES:
        combos = combos + [dict(fp8_grad=True, save_original_weight=True)]
    for flags in combos:
        args = _fwd_args(rec, **flags, lead=lead)
        protos = OPS.fwd_plan.to_protos(args)
        real = L.linear_forward(args)
        fake = L.linear_forward_fake(protos)
        try:
            _assert_parity(real, fake, args, protos, OPS.fwd_plan.tensor_fields)
            if flags.get("fp8_output"):
                continue
            for dy in _grad_outputs(name, lead):
                bwd = OPS.make_bwd_args(real.saved, L.linear_setup_context(args),
                                        {"grad_output": dy})
                bwd_real = L.linear_backward(bwd)
                bwd_fake = L.linear_backward_fake(OPS.bwd_plan.to_protos(bwd))
                assert list(bwd_real) == list(bwd_fake), type(dy).__name__
                for k in bwd_real:
                    assert _describe(bwd_real[k]) == _describe(bwd_fake[k]), (
                        k, type(dy).__name__)
        except AssertionError as e:
            raise AssertionError(f"{name} {flags}: {e}") from e


def test_parity_counts_what_the_flags_promise():
    """The layout the parity test compares is the intended one, not just a
    self-consistent one: quantized saved input keeps only its columnwise copy,
    and so does a weight the call quantized; a weight the layer keeps (the
    cached workspace, written or reused, or an FP8 weight) is saved whole
    and left as it is."""
    args = _fwd_args(RECIPES["mxfp8"])
    saved = L.linear_forward(args).saved
    assert saved["inputmat"].get_usages() == {"rowwise": False, "columnwise": True}
    assert saved["weightmat"].get_usages() == {"rowwise": False, "columnwise": True}
    both = {"rowwise": True, "columnwise": True}
    for kept in (dict(fp8_weight=True), dict(workspace=True), dict(cache_weight=True)):
        args = _fwd_args(RECIPES["fp8_current"], **kept)
        if kept.get("cache_weight"):  # the layer's buffer the call writes
            args.weight_workspace = args.weight_quantizer.quantize(args.weight)
        result = L.linear_forward(args)
        saved_w = result.saved["weightmat"]
        kept_w = (result.outputs["weight_workspace"] if kept.get("cache_weight")
                  else args.weight if kept.get("fp8_weight") else args.weight_workspace)
        assert saved_w is kept_w, kept
        assert saved_w.get_usages() == both, kept
    args = _fwd_args(RECIPES["mxfp8"], save_original_input=True)
    assert L.linear_forward(args).saved["inputmat"] is args.inp


@pytest.mark.parametrize("name", [n for n in OP_RECIPES if n != "bf16"])
def test_saved_original_weight_is_requantized_bit_for_bit(name):
    """``save_original_weight``: the forward saves W itself and quantizes
    only its rowwise copy, the backward quantizes the columnwise copy from
    it, and every output and gradient equals the saved-copy run bit for bit.
    Not under DelayedScaling (the forward moves its scale): there the
    forward's copy is saved as before.  A weight the layer caches or holds
    quantized is saved as before too."""
    rec = OP_RECIPES[name]
    runs = []
    for sow in (False, True):
        args = _fwd_args(rec, save_original_weight=sow)
        real = L.linear_forward(args)
        ctx = L.linear_setup_context(args)
        saved_w = real.saved["weightmat"]
        if sow and name != "delayed":
            assert saved_w is args.weight and ctx["weight_quantizer"] is args.weight_quantizer
        else:
            assert isinstance(saved_w, te.QuantizedTensorStorage)
            assert saved_w.get_usages() == {"rowwise": False, "columnwise": True}
            assert ctx["weight_quantizer"] is None
        dy = _grad_outputs(name)[0]
        bwd = L.linear_backward(OPS.make_bwd_args(real.saved, ctx, {"grad_output": dy}))
        runs.append([real.outputs["out"], bwd["inp"], bwd["weight"], bwd["bias"]])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    for kept in (dict(cache_weight=True), dict(workspace=True), dict(fp8_weight=True)):
        args = _fwd_args(rec, save_original_weight=True, **kept)
        if kept.get("cache_weight"):
            q = args.weight_quantizer
            args.weight_workspace = (q.quantize_with_scale(args.weight, torch.ones(1))
                                     if rec.delayed() else q.quantize(args.weight))
        saved_w = L.linear_forward(args).saved["weightmat"]
        assert isinstance(saved_w, te.QuantizedTensorStorage), kept
        assert L.linear_setup_context(args)["weight_quantizer"] is None, kept
    args = _fwd_args(None)
    result = L.linear_forward(args)
    assert result.saved["inputmat"] is args.inp and result.saved["weightmat"] is args.weight


@pytest.mark.parametrize("lead", [(2, 64), (7,)], ids=["tokens128", "tokens7"])
@pytest.mark.parametrize("name", OP_RECIPES)
def test_opcheck_forward_and_backward_ops(name, lead):
    rec = OP_RECIPES[name]
    for sow in (False, True):  # the backward quantizing the saved W
        args = _fwd_args(rec, main_grad=name in ("bf16", "delayed"), lead=lead,
                         save_original_weight=sow)
        args.inp.requires_grad_()
        opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), rec is not None)
        real = L.linear_forward(args)
        args.inp.requires_grad_(False)  # the backward op runs with grad mode off
        dy = torch.randn(*lead, 128, dtype=torch.bfloat16)
        bwd = OPS.make_bwd_args(real.saved, L.linear_setup_context(args), {"grad_output": dy})
        opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), rec is not None)


@pytest.mark.parametrize("name", FP8_GRAD_RECIPES)
def test_opcheck_with_fp8_grad_and_quantized_grad_output(name):
    """fp8_grad's quantized dgrad output, and a quantized dy read as is."""
    rec = OP_RECIPES[name]
    args = _fwd_args(rec, fp8_grad=True)
    real = L.linear_forward(args)
    dy = _grad_outputs(name)[1]
    bwd = OPS.make_bwd_args(real.saved, L.linear_setup_context(args), {"grad_output": dy})
    assert L._uses_quantized_grad(bwd, _grad_output_quantizer(bwd))
    assert isinstance(L.linear_backward(bwd)["inp"], te.QuantizedTensor)
    opcheck(OPS.bwd_op, OPS.bwd_plan.encode(bwd), True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_double_backward_is_refused(compiled):
    """Never a silently wrong second derivative.  Compiled: our backward op
    refuses (torch 2.13), or AOTAutograd returns a grad without grad_fn (2.11)."""
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    step = _make_step(layer, RECIPES["fp8_current"])
    if compiled:
        step = torch.compile(step, backend="aot_eager")
    y = step(x)
    (gx,) = torch.autograd.grad(y.float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|does not require grad|"
                                            "once_differentiable"):
        gx.float().sum().backward()


def test_opcheck_with_fp8_primary_weight_and_fp8_output():
    args = _fwd_args(RECIPES["fp8_current"], fp8_weight=True)
    args.weight.requires_grad_()
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), True)
    args = _fwd_args(RECIPES["nvfp4"], fp8_output=True, input_rg=False, weight_rg=False,
                     bias=False)
    opcheck(OPS.fwd_op, OPS.fwd_plan.encode(args), True)


# -- eager fallback ------------------------------------------------------------------------
def _compiled_twice(layer, rec, fullgraph=False, **kw):
    step = torch.compile(_make_step(layer, rec, **kw), fullgraph=fullgraph, backend="aot_eager")
    x = X.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [step(x) for _ in range(2)]
    return outs, [str(w.message) for w in caught if "falls back to eager" in str(w.message)]


class _UnregisteredQuantizer(te.Float8CurrentScalingQuantizer):
    pass


def _unregistered_input_quantizer(monkeypatch):
    real = factory.quantizer_for

    def patched(recipe, role, **kw):
        q = real(recipe, role, **kw)
        return _UnregisteredQuantizer(internal=q.internal) if role == "input" else q

    monkeypatch.setattr(factory, "quantizer_for", patched)


def test_unregistered_quantizer_falls_back(monkeypatch):
    _unregistered_input_quantizer(monkeypatch)
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    outs, warned = _compiled_twice(layer, RECIPES["fp8_current"])
    assert layer.compile_fallbacks() == ("quantizer_not_value_opaque",) and len(warned) == 1
    with te.autocast(recipe=RECIPES["fp8_current"]):
        assert torch.equal(outs[0], layer(X))


def test_torch_without_opaque_api_falls_back(monkeypatch):
    monkeypatch.setattr(compat, "OPAQUE_UNAVAILABLE_REASON", "simulated")
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    outs, warned = _compiled_twice(layer, RECIPES["mxfp8"])
    assert layer.compile_fallbacks() == ("no_opaque_api",) and len(warned) == 1
    with te.autocast(recipe=RECIPES["mxfp8"]):
        assert torch.equal(outs[0], layer(X)) and torch.equal(outs[1], outs[0])


def test_fallback_under_fullgraph_is_a_graph_break_error(monkeypatch):
    _unregistered_input_quantizer(monkeypatch)
    _reset()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        _compiled_twice(layer, RECIPES["fp8_current"], fullgraph=True)


class _TwoLayers(torch.nn.Sequential):
    def forward(self, x, **kw):
        return self[1](self[0](x, **kw), **kw)


def test_supported_configurations_never_fall_back(monkeypatch):
    _reset()
    model = _TwoLayers(te.Linear(128, 128, params_dtype=torch.bfloat16),
                       te.Linear(128, 128, params_dtype=torch.bfloat16))
    model[1].fuse_wgrad_accumulation = True  # main_grad, weight caching, delayed: all compiled
    model[1].weight.main_grad = torch.zeros(128, 128)
    for rec in list(RECIPES.values()) + [recipe.DelayedScaling()]:
        for first in (None, True, False):
            _compiled_twice(model, rec, **({} if first is None or rec is None
                                           else {"is_first_microbatch": first}))
    assert te.fallback_report(model) == {}
    _unregistered_input_quantizer(monkeypatch)
    _reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _compiled_twice(model, RECIPES["fp8_current"])
    assert te.fallback_report(model) == {"0": ("quantizer_not_value_opaque",),
                                         "1": ("quantizer_not_value_opaque",)}


def test_every_fallback_reason_is_documented():
    from transformer_engine_compile.dynamo.fallback import REASONS
    import pathlib
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "fallback.md").read_text()
    for reason in REASONS:
        assert f"`{reason}`" in doc


def _train_two_microbatches(rec, case, x_shape, out_features):
    """Outputs, input grads and the weight grad of two micro-batches of a
    fresh te.Linear under ``rec``; ``case`` "no_input_grad" (x needs no
    gradient) or "cache_weight" (the FP8 weight cached, then reused)."""
    torch.manual_seed(0)
    layer = te.Linear(x_shape[-1], out_features, params_dtype=torch.bfloat16)
    out = []
    for micro in range(2):
        x = torch.randn(x_shape, dtype=torch.bfloat16, requires_grad=case != "no_input_grad")
        first = (micro == 0) if case == "cache_weight" else None
        with te.autocast(recipe=rec):
            y = layer(x, is_first_microbatch=first)
        y.float().square().sum().backward()
        out += [y, x.grad]
    return out + [layer.weight.grad]


@pytest.mark.parametrize("rows", [256, 200])
@pytest.mark.parametrize("case", ["plain", "no_input_grad", "cache_weight"])
@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "nvfp4"])
def test_block_formats_quantize_input_and_weight_as_one_pair(monkeypatch, name, case, rows):
    """Float8BlockScaling (x 1x128, W 128x128), MXFP8BlockScaling and
    NVFP4BlockScaling (x 1x16 with the RHT on its columnwise copy, W 16x16)
    forwards: x and W go through one pair kernel call (one launch on the
    GPU) with the usages each needs, and training equals the path that
    quantizes them one at a time; x with rows that are not whole blocks
    (its columnwise copy padded first) and a reused weight cache never pair."""
    from transformer_engine_compile.kernels import reference as ref
    from transformer_engine_compile.quantization import (Float8BlockQuantizer, MXFP8Quantizer,
                                                         NVFP4Quantizer)

    kernel, usages = {
        "fp8_block": ("quantize_fp8_blockwise_pair", lambda a: a[5:]),
        "mxfp8": ("quantize_mxfp8_pair", lambda a: a[3:]),
        "nvfp4": ("quantize_nvfp4_pair", lambda a: (a[2][3:], a[3][3:]))}[name]
    calls = []
    real = getattr(ref, kernel)
    monkeypatch.setattr(ref, kernel, lambda *a: calls.append(usages(a)) or real(*a))
    rec = {"fp8_block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling,
           "nvfp4": recipe.NVFP4BlockScaling}[name]()
    paired = _train_two_microbatches(rec, case, (rows, 256), 128)
    calls_per_step = {"plain": 2, "no_input_grad": 2, "cache_weight": 1}[case]
    w_usage = (True, case != "no_input_grad")
    pair = (((False, True, True), (True, *w_usage)) if name == "fp8_block"
            else ((True, True), w_usage))
    block = 128 if name == "fp8_block" else 32 if name == "mxfp8" else 16
    assert calls == ([] if rows % block else [pair] * calls_per_step)
    calls.clear()
    quantizer = {"fp8_block": Float8BlockQuantizer, "mxfp8": MXFP8Quantizer,
                 "nvfp4": NVFP4Quantizer}[name]
    monkeypatch.setattr(quantizer, "pairs_with", lambda self, other: False)
    single = _train_two_microbatches(rec, case, (rows, 256), 128)
    assert calls == []
    for a, b in zip(paired, single):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("case", ["plain", "no_input_grad", "cache_weight", "delayed"])
def test_current_scaling_quantizes_input_and_weight_as_one_pair(monkeypatch, case):
    """Float8CurrentScaling forward: x and W go through one
    ``quantize_fp8_current_pair`` call (one amax and one cast launch on
    the GPU) with the usages each needs, and training equals the path that
    quantizes them one at a time; DelayedScaling and a reused weight cache
    never pair."""
    from transformer_engine_compile.kernels import reference as ref
    from transformer_engine_compile.quantization.float8 import Float8CurrentScalingQuantizer

    calls = []
    real = ref.quantize_fp8_current_pair
    monkeypatch.setattr(ref, "quantize_fp8_current_pair",
                        lambda *a: calls.append(a[5:]) or real(*a))
    rec = recipe.DelayedScaling() if case == "delayed" else recipe.Float8CurrentScaling()
    paired = _train_two_microbatches(rec, case, (2, 16, 64), 32)
    expected = {"plain": [((True, True), (True, True))] * 2,
                "no_input_grad": [((True, True), (True, False))] * 2,
                "cache_weight": [((True, True), (True, True))],  # the second reuses the cache
                "delayed": []}[case]
    assert calls == expected
    calls.clear()
    monkeypatch.setattr(Float8CurrentScalingQuantizer, "pairs_with", lambda self, other: False)
    single = _train_two_microbatches(rec, case, (2, 16, 64), 32)
    assert calls == []
    for a, b in zip(paired, single):
        assert (a is None and b is None) or torch.equal(a, b)
