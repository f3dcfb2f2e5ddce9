"""The custom-op generator on its own (it knows nothing about Linear)."""

import dataclasses
import enum
import math
import os
import tempfile
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile.dynamo.buckets import (QuantizerSlot, SimpleValues,
                                                       TensorOrQuantized, bucket_for)
from transformer_engine_compile.dynamo.arg_plan import ArgPlan
from transformer_engine_compile.dynamo.custom_op import OpResult, register_custom_op


class Mode(enum.Enum):
    SCALE = 1
    SHIFT = 2


@dataclasses.dataclass
class ToyFwd:
    x: torch.Tensor
    other: TensorOrQuantized = None          # plain, quantized or None; added to y
    offset: Optional[torch.Tensor] = None
    quantizer: Optional[te.Quantizer] = None  # quantizes y when set (no grad)
    factor: float = 1.0
    mode: Mode = Mode.SCALE
    out_dtype: torch.dtype = torch.float32
    size: torch.Size = torch.Size([])
    pair: Tuple[int, str] = (0, "")
    many: Tuple[int, ...] = ()
    flag: Optional[bool] = None
    group: Optional[dist.ProcessGroup] = None
    note: Optional[dict] = None               # no bucket: must be None


@dataclasses.dataclass
class ToyBwd:
    grad_y: torch.Tensor
    y: torch.Tensor = None       # saved: an output alias
    x: torch.Tensor = None       # saved: an argument alias
    factor: float = 1.0
    world: int = 1


def _world(args):
    return 1 if args.group is None else args.group.size()


def toy_forward(args: ToyFwd) -> OpResult:
    """y = exp(x) * factor * world (+ other + offset); saves y (output) and x (argument)."""
    y = torch.exp(args.x) * (args.factor * _world(args))
    if args.other is not None:
        y = y + (args.other.dequantize() if isinstance(args.other, te.QuantizedTensorStorage)
                 else args.other)
    if args.offset is not None:
        y = y + args.offset
    y = y.to(args.out_dtype)
    if args.quantizer is not None:
        y = args.quantizer(y)
    return OpResult({"y": y}, {"y": y, "x": args.x})


def toy_forward_fake(args: ToyFwd) -> OpResult:
    y = te.TensorProto(args.x.shape, args.out_dtype, args.quantizer, device=args.x.device)
    return OpResult({"y": y}, {"y": y, "x": args.x})


def toy_setup(args: ToyFwd) -> dict:
    return {"factor": args.factor, "world": _world(args)}


def toy_backward(args: ToyBwd) -> dict:
    # dy/dx = exp(x) * factor * world; checks both aliases arrive
    assert torch.equal(args.y.float(), args.y.float())
    return {"x": args.grad_y * torch.exp(args.x) * (args.factor * args.world),
            "other": args.grad_y.clone(), "offset": args.grad_y.clone()}


def toy_backward_fake(args: ToyBwd) -> dict:
    dy = args.grad_y
    return {k: te.TensorProto(dy.shape, dy.dtype, device=dy.device) for k in ("x", "other", "offset")}


TOY = register_custom_op("toy_exp", fwd_args=ToyFwd, bwd_args=ToyBwd, forward=toy_forward,
                         forward_fake=toy_forward_fake, backward=toy_backward,
                         backward_fake=toy_backward_fake, setup_context=toy_setup,
                         grad_fields={"grad_y": "y"})


def test_every_field_lands_in_its_bucket():
    assert ArgPlan(ToyFwd).buckets() == {
        "x": "tensor", "other": "tensor_or_quantized", "offset": "optional_tensor",
        "quantizer": "quantizer", "factor": "simple", "mode": "simple", "out_dtype": "simple",
        "size": "simple", "pair": "simple", "many": "simple", "flag": "simple",
        "group": "process_group", "note": "unsupported"}
    schema = TOY.fwd_schema
    for piece in ("Tensor x", "Tensor[] other", "SymInt[] other__shape", "Tensor? offset",
                  "QuantizerSlot? quantizer", "str? group", "SimpleValues simple_values"):
        assert piece in schema, piece
    assert "note" not in schema and "factor" not in schema


def test_simple_values_round_trip_through_one_opaque_object():
    plan = ArgPlan(ToyFwd)
    args = ToyFwd(torch.ones(2), factor=2.5, mode=Mode.SHIFT, out_dtype=torch.bfloat16,
                  size=torch.Size([3, 4]), pair=(7, "a"), many=(1, 2, 3), flag=True)
    flat = plan.encode(args)
    simple = flat[-1]
    assert isinstance(simple, SimpleValues)
    assert all(isinstance(v, (type(None), bool, int, float, str, tuple))
               for _, v in simple.items)
    assert simple == plan.encode(dataclasses.replace(args, x=torch.zeros(2)))[-1]  # by value
    back = plan.decode(flat)
    assert back.mode is Mode.SHIFT and back.out_dtype is torch.bfloat16
    assert back.size == torch.Size([3, 4]) and isinstance(back.size, torch.Size)
    assert (back.factor, back.pair, back.many, back.flag) == (2.5, (7, "a"), (1, 2, 3), True)


def test_quantized_field_crosses_as_buffers_and_comes_back():
    plan = ArgPlan(ToyFwd)
    q = te.MXFP8Quantizer(internal=True)
    other = q(torch.randn(64, 32))
    flat = plan.encode(ToyFwd(torch.ones(64, 32), other=other, quantizer=te.NVFP4Quantizer()))
    assert flat[1] == list(other.buffers().values()) and flat[2] == [64, 32]
    assert isinstance(flat[3], QuantizerSlot) and flat[3].quantizer == q
    back = plan.decode(flat).other
    assert type(back) is type(other) and torch.equal(back.dequantize(), other.dequantize())


def test_bad_field_values_raise_type_errors_naming_the_field():
    plan = ArgPlan(ToyFwd)
    with pytest.raises(TypeError, match="'note'.*must be None"):
        plan.encode(ToyFwd(torch.ones(1), note={}))
    with pytest.raises(TypeError, match="'factor' must be float"):
        plan.encode(ToyFwd(torch.ones(1), factor="big"))
    with pytest.raises(TypeError, match="'pair' must have 2 elements"):
        plan.encode(ToyFwd(torch.ones(1), pair=(1, "a", 2)))
    with pytest.raises(TypeError, match="'x' must be a plain torch.Tensor"):
        plan.encode(ToyFwd(None))
    with pytest.raises(TypeError, match="'quantizer'.*not a value-opaque"):
        plan.encode(ToyFwd(torch.ones(1), quantizer=te.Float8Quantizer(torch.ones(1),
                                                                       torch.zeros(1))))


def test_clashing_schema_names_and_bad_grad_fields_are_refused():
    @dataclasses.dataclass
    class Clash:
        w: TensorOrQuantized
        w__shape: Optional[torch.Tensor] = None

    with pytest.raises(TypeError, match="clash"):
        ArgPlan(Clash).schema_args()
    with pytest.raises(TypeError, match="grad_fields"):
        register_custom_op("toy_bad", fwd_args=ToyFwd, bwd_args=ToyBwd, forward=toy_forward,
                           forward_fake=toy_forward_fake, backward=toy_backward,
                           backward_fake=toy_backward_fake, setup_context=toy_setup,
                           grad_fields={"nope": "y"})
    with pytest.raises(RuntimeError, match="already registered"):
        register_custom_op("toy_exp", fwd_args=ToyFwd, bwd_args=ToyBwd, forward=toy_forward,
                           forward_fake=toy_forward_fake, backward=toy_backward,
                           backward_fake=toy_backward_fake, setup_context=toy_setup,
                           grad_fields={"grad_y": "y"})


def test_bucket_of_unknown_annotation_is_unsupported():
    assert bucket_for(Optional[list]).kind == "unsupported"
    assert bucket_for(Tuple[int, object]).kind == "unsupported"


def _toy_step(x, other, offset, factor):
    return TOY(ToyFwd(x, other=other, offset=offset, factor=factor))["y"]


def _toy_eager(x, other, offset, factor):
    return TOY.eager(ToyFwd(x, other=other, offset=offset, factor=factor))["y"]


def test_generated_ops_compiled_equal_eager_with_grads_through_every_tensor_bucket():
    torch._dynamo.reset()
    counters.clear()
    results = []
    for fn in (_toy_eager, torch.compile(_toy_step, fullgraph=True, backend="aot_eager")):
        x = torch.linspace(-1, 1, 12).reshape(3, 4).requires_grad_()
        other = torch.ones(3, 4, requires_grad=True)
        offset = torch.full((3, 4), 0.5, requires_grad=True)
        y = fn(x, other, offset, 3.0)
        y.backward(torch.full_like(y, 2.0))
        results.append((y, x.grad, other.grad, offset.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    torch.testing.assert_close(results[0][1], 2.0 * 3.0 * torch.exp(x))
    assert torch.equal(results[0][2], torch.full((3, 4), 2.0))
    assert counters["stats"]["unique_graphs"] == 1


def test_toy_ops_pass_opcheck():
    x = torch.randn(3, 4, requires_grad=True)
    args = ToyFwd(x, other=torch.randn(3, 4), offset=torch.randn(3, 4), factor=2.0)
    torch.library.opcheck(TOY.fwd_op, tuple(TOY.fwd_plan.encode(args)))
    bwd = ToyBwd(torch.randn(3, 4), y=torch.randn(3, 4), x=torch.randn(3, 4), factor=2.0)
    torch.library.opcheck(TOY.bwd_op, tuple(TOY.bwd_plan.encode(bwd)))


def test_autograd_kernel_calls_the_impl_directly_only_without_grad_or_tracing(monkeypatch):
    """Without grad mode on plain CPU tensors (how a compiled graph's runtime
    and the autograd engine call the ops) the Autograd kernel runs the impl
    itself; with grad mode, under a fake mode or on meta tensors it
    redispatches as torch.library's kernel does, and results agree."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    redispatches = []
    orig = torch._ops.OpOverload.redispatch

    def counting(self, *a, **k):
        redispatches.append(self)
        return orig(self, *a, **k)

    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", counting)
    x = torch.randn(3, 4, requires_grad=True)
    parts = dict(other=torch.ones(3, 4), offset=torch.ones(3, 4), factor=2.0)
    flat = TOY.fwd_plan.encode(ToyFwd(x, **parts))
    with torch.no_grad():
        direct = TOY.fwd_op(*flat)
    assert redispatches == []
    with_grad = TOY.fwd_op(*flat)  # through torch.library's autograd.Function
    assert redispatches == [TOY.fwd_op]
    assert all(torch.equal(a, b) for a, b in zip(direct, with_grad))
    (gx,) = torch.autograd.grad(with_grad[0], x, torch.ones(3, 4))
    torch.testing.assert_close(gx, 2.0 * torch.exp(x.detach()))
    redispatches.clear()
    with torch.no_grad():
        with FakeTensorMode() as mode:
            fake = TOY.fwd_op(*TOY.fwd_plan.encode(ToyFwd(
                mode.from_tensor(x), **{k: mode.from_tensor(v) if torch.is_tensor(v) else v
                                        for k, v in parts.items()})))
        meta = TOY.fwd_op(*TOY.fwd_plan.encode(ToyFwd(
            x.detach().to("meta"), **{k: v.to("meta") if torch.is_tensor(v) else v
                                      for k, v in parts.items()})))
    assert len(redispatches) == 2
    assert fake[0].shape == meta[0].shape == (3, 4) and meta[0].device.type == "meta"


def test_quantized_output_is_rebuilt_from_the_flat_list():
    torch._dynamo.reset()
    q = te.Float8CurrentScalingQuantizer("e4m3")

    def f(x):
        return TOY(ToyFwd(x, quantizer=q))["y"]

    x = torch.randn(8, 16)
    eager = TOY.eager(ToyFwd(x, quantizer=q))["y"]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert type(compiled) is te.Float8Tensor and compiled.shape == (8, 16)
    assert torch.equal(compiled.dequantize(), eager.dequantize())


def test_output_aliasing_an_argument_is_refused():
    def bad_forward(args):
        return OpResult({"y": args.x}, {})

    pair = register_custom_op("toy_alias", fwd_args=ToyFwd, bwd_args=ToyBwd,
                              forward=bad_forward, forward_fake=bad_forward,
                              backward=toy_backward, backward_fake=toy_backward_fake,
                              setup_context=toy_setup, grad_fields={"grad_y": "y"})
    with pytest.raises(RuntimeError, match="same object as 'arg:x'"):
        pair.fwd_op(*pair.fwd_plan.encode(ToyFwd(torch.ones(2))))


def test_native_hooks_run_first_and_only_for_real_calls():
    """An op's native impls (``native_forward`` / ``native_backward``) are
    tried before its impls on real calls, given the flat arguments, and a
    None from them runs the impls; fakes and compiled traces never call
    them, while a compiled graph's runtime does (its op calls are real)."""
    seen = []

    def native_forward(pair, decoder, flat, args):
        seen.append(("fwd", type(flat[0]) is torch.Tensor))
        if args.factor == 5.0:  # "covered": y = 5 exp(x) + other + offset
            return [torch.exp(args.x) * 5.0 + args.other + args.offset]
        return None

    def native_backward(pair, decoder, flat, args):
        seen.append(("bwd", type(flat[0]) is torch.Tensor))
        return None

    pair = register_custom_op("toy_native", fwd_args=ToyFwd, bwd_args=ToyBwd,
                              forward=toy_forward, forward_fake=toy_forward_fake,
                              backward=toy_backward, backward_fake=toy_backward_fake,
                              setup_context=toy_setup, grad_fields={"grad_y": "y"},
                              native_forward=native_forward, native_backward=native_backward)
    x, one = torch.linspace(-1, 1, 6), torch.ones(6)
    with torch.no_grad():
        covered = pair.fwd_op(*pair.fwd_plan.encode(ToyFwd(x, one, one, factor=5.0)))
        other = pair.fwd_op(*pair.fwd_plan.encode(ToyFwd(x, one, one, factor=2.0)))
        grads = pair.bwd_op(*pair.bwd_plan.encode(ToyBwd(torch.ones(6), y=x, x=x, factor=2.0)))
    assert seen == [("fwd", True), ("fwd", True), ("bwd", True)]
    assert torch.equal(covered[0], torch.exp(x) * 5.0 + 2.0)
    assert torch.equal(other[0], torch.exp(x) * 2.0 + 1.0 + 1.0)  # the impl's
    assert torch.equal(grads[0], torch.exp(x) * 2.0)
    seen.clear()

    def step(x, other, offset):
        return pair(ToyFwd(x, other, offset, factor=5.0))["y"]

    torch._dynamo.reset()
    xg, og, fg = (t.clone().requires_grad_() for t in (x, one, one))
    y = torch.compile(step, fullgraph=True, backend="aot_eager")(xg, og, fg)
    y.sum().backward()
    # tracing ran the fakes only; the runtime's forward and backward calls ran the hooks
    assert seen == [("fwd", True), ("bwd", True)]
    assert torch.equal(y, torch.exp(x) * 5.0 + 2.0)
    torch.testing.assert_close(xg.grad, torch.exp(x) * 5.0)
    assert torch.equal(og.grad, torch.ones(6))


@pytest.fixture
def single_process_group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}",
                                rank=0, world_size=1)
        try:
            yield dist.new_group([0])
        finally:
            dist.destroy_process_group()


def test_process_group_crosses_as_its_name(single_process_group):
    group = single_process_group
    flat = TOY.fwd_plan.encode(ToyFwd(torch.ones(2), group=group))
    assert flat[-2] == group.group_name
    assert TOY.fwd_plan.decode(flat).group is group

    def f(x):
        return TOY(ToyFwd(x, group=group, factor=2.0))["y"]

    torch._dynamo.reset()
    x = torch.randn(4)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, TOY.eager(ToyFwd(x, group=group, factor=2.0))["y"])
    assert math.isclose(compiled[0].item(), 2.0 * math.exp(x[0].item()), rel_tol=1e-6)


def test_compiled_call_guards_hold_no_dataclass_internals():
    """Tracing the ops reads the argument dataclasses' field names, not
    ``dataclasses.replace`` (which reads every field's private ``_field_type``
    and makes Dynamo add a Python identity check per field to the guards run
    on every call of the compiled function)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    layer = te.Linear(32, 32, bias=False, params_dtype=torch.bfloat16)
    rec = te.recipe.Float8CurrentScaling()

    def f(x):
        with te.autocast(recipe=rec):
            return layer(x).float().sum()

    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
    (entry,) = _debug_get_cache_entry_list(f.__code__)
    guards = str(entry.guard_manager)
    assert "LinearFwdArgs" in guards  # the guards do see the argument class
    assert "_field_type" not in guards and "__dataclass_fields__" not in guards
