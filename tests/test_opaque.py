"""Value-opaque quantizers: value semantics, FX repr, compile behaviour."""

import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import compat
from transformer_engine_compile.quantization import opaque

from conftest import STATELESS


def test_every_stateless_quantizer_is_registered(stateless_name):
    q = STATELESS[stateless_name](True, True)
    assert te.is_value_opaque(q)
    assert compat.opaque_type_name(type(q)).endswith(type(q).__name__)


def test_stateful_quantizer_is_not_registered():
    q = te.Float8Quantizer(torch.ones(1), torch.zeros(1))
    assert not te.is_value_opaque(q)


def test_registration_is_not_inherited():
    class Sub(te.MXFP8Quantizer):
        pass
    assert not te.is_value_opaque(Sub())


def test_value_semantics_cover_config_only(stateless_name):
    make = STATELESS[stateless_name]
    a, b = make(True, True), make(True, True)
    assert a == b and hash(a) == hash(b) and a is not b
    a._scratch = torch.zeros(3)  # non-config state is outside the key
    assert a == b
    c = make(True, False)
    assert a != c
    assert a != te.Float8CurrentScalingQuantizer() or stateless_name == "fp8_current_e4m3"


def test_fx_repr_rebuilds_an_equal_quantizer_from_picklable_globals(stateless_name):
    q = STATELESS[stateless_name](False, True)
    expr, globs = q.__fx_repr__()
    assert list(globs.values()) == [type(q)]  # no torch module, no dtype objects
    pickle.dumps(globs)
    rebuilt = eval(expr, dict(globs))
    assert rebuilt == q and type(rebuilt) is type(q)


def test_fx_repr_rejects_non_primitive_config():
    q = te.MXFP8Quantizer()
    q.fp8_format = torch.float8_e4m3fn
    with pytest.raises(TypeError, match="FX graph cache"):
        q.__fx_repr__()


def test_property_is_refused_at_registration():
    class WithProp(te.MXFP8Quantizer):
        @property
        def foo(self):
            return 1
    WithProp.__qualname__ = WithProp.__name__
    with pytest.raises(TypeError, match="@property"):
        te.register_value_opaque_quantizer(WithProp)


def _fresh_counters():
    torch._dynamo.reset()
    counters.clear()


def test_equal_instance_reuses_graph_changed_config_recompiles():
    _fresh_counters()

    def f(x, q):
        return q.quantize(x).dequantize()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(64, 64)
    cf(x, te.Float8CurrentScalingQuantizer())
    cf(x, te.Float8CurrentScalingQuantizer())  # equal, new instance
    assert counters["stats"]["unique_graphs"] == 1
    out = cf(x, te.Float8CurrentScalingQuantizer("e5m2"))  # changed config
    assert counters["stats"]["unique_graphs"] == 2
    assert torch.equal(out, f(x, te.Float8CurrentScalingQuantizer("e5m2")))
    assert not counters["graph_break"]


def test_equal_instance_never_hits_recompile_limit():
    _fresh_counters()

    def f(x, q):
        return q.quantize(x).dequantize() * 2

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(64, 64)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            cf(x, te.MXFP8Quantizer())


_LIB = torch.library.Library("te_compile_test", "FRAGMENT")
_QNAME = compat.opaque_type_name(te.Float8BlockQuantizer)
_LIB.define(f"scaled_by_format(Tensor x, {_QNAME}? q) -> Tensor")


def _scaled_by_format(x, q):
    if q is None:
        return x.clone()
    return x * (2.0 if q.block_scaling_dim == 2 else 3.0)


_LIB.impl("scaled_by_format", _scaled_by_format, "CompositeExplicitAutograd")
torch.library.register_fake("te_compile_test::scaled_by_format", lambda x, q: torch.empty_like(x))


def test_quantizer_reads_and_custom_op_argument_cause_no_graph_break():
    _fresh_counters()

    def f(x, q):
        q2 = q.with_usage(columnwise=False)
        y = torch.ops.te_compile_test.scaled_by_format(x, q2)
        if q.rowwise_usage and q.block_scaling_dim == 2:  # plain attribute reads
            y = y + 1
        return y + torch.ops.te_compile_test.scaled_by_format(x, None)

    x = torch.randn(8)
    q = te.Float8BlockQuantizer()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, q)
    assert torch.equal(out, f(x, q))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert q.columnwise_usage  # with_usage never touched the caller's quantizer


def test_missing_opaque_api_keeps_eager_and_reports_once(monkeypatch):
    monkeypatch.setattr(compat, "_REGISTER", None)
    monkeypatch.setattr(compat, "OPAQUE_UNAVAILABLE_REASON", "torch 0.0 has no opaque API")
    monkeypatch.setattr(opaque, "_unavailable_reported", False)

    class Q1(te.MXFP8Quantizer):
        pass

    class Q2(te.MXFP8Quantizer):
        pass

    Q1.__qualname__, Q2.__qualname__ = "Q1", "Q2"
    with pytest.warns(RuntimeWarning, match="torch 0.0 has no opaque API") as rec:
        opaque.register_value_opaque_quantizer(Q1)
        opaque.register_value_opaque_quantizer(Q2)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    q = Q1()
    assert not te.is_value_opaque(q) and q == Q1()  # value semantics still there
    assert q.quantize(torch.randn(32, 32)).shape == (32, 32)  # eager works
    assert te.compile_support() == (False, "torch 0.0 has no opaque API")


def test_renamed_api_of_newer_torch_is_used_when_present(monkeypatch):
    """torch >= 2.14 renames register_opaque_type -> register_custom_class
    (typ "constant"); the old name stays as a deprecated wrapper."""
    import enum
    import types
    calls = []

    class MemberType(enum.Enum):
        USE_REAL = "use_real"
        INLINED = "inlined"

    fake = types.SimpleNamespace(
        MemberType=MemberType,
        register_custom_class=lambda cls, **kw: calls.append(("new", cls, kw)),
        register_opaque_type=lambda cls, **kw: calls.append(("old", cls, kw)))
    monkeypatch.setattr(compat, "_opaque_mod", fake)
    register, reason = compat._find_register()
    assert reason is None
    register(int, ["a"], ["b"])
    assert calls == [("new", int, {"typ": "constant", "members": {
        "a": MemberType.USE_REAL, "b": MemberType.INLINED}})]
    del fake.register_custom_class  # released 2.11 - 2.13: only the old name
    calls.clear()
    register, _ = compat._find_register()
    register(int, ["a"])
    assert calls == [("old", int, {"typ": "value", "members": {"a": MemberType.USE_REAL}})]
    monkeypatch.setattr(compat, "_opaque_mod", types.SimpleNamespace())
    register, reason = compat._find_register()
    assert register is None and "lacks register_opaque_type" in reason
