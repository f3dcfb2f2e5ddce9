"""``torch.export``: a program made by ``te.export``
survives ``torch.export.save`` / ``torch.export.load`` and its outputs equal
eager bit for bit; one made by plain ``torch.export.export`` does not (torch
drops the inline value-opaque arguments when saving)."""

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile import compat
from transformer_engine_compile.dynamo.buckets import SimpleValues

from test_linear import _reset

RECIPES = {name: recipe.by_name(name) for name in recipe.RECIPE_NAMES}
RECIPES["delayed"] = recipe.DelayedScaling(amax_history_len=4)


saveable = pytest.mark.skipif(not compat.export_keeps_opaque_constants(),
                              reason="this torch cannot save opaque constants "
                                     "(test_old_torch_refuses_at_export_and_save)")


@pytest.fixture(autouse=True)
def _fresh():
    _reset()
    yield


class Model(torch.nn.Module):
    """Two layers under ``rec``; ``region`` puts both inside a
    ``torch.no_grad()`` or ``torch.autocast`` region of the forward."""

    def __init__(self, rec, region=None, dtype=torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = te.Linear(128, 128, params_dtype=dtype)
        self.fc2 = te.Linear(128, 128, params_dtype=dtype)
        self.rec, self.region = rec, region

    def layers(self, x):
        if self.region == "no_grad":
            with torch.no_grad():
                return self.fc2(self.fc1(x))
        if self.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc2(self.fc1(x))
        return self.fc2(self.fc1(x))

    def forward(self, x):
        with te.autocast(enabled=self.rec is not None, recipe=self.rec):
            return self.layers(x)


def _round_trip(ep, path):
    torch.export.save(ep, path)
    return torch.export.load(path)


def _x(dtype=torch.bfloat16, rows=32, scale=1.0):
    return torch.randn(rows, 128, dtype=dtype) * scale


@saveable
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_saved_program_equals_eager(name, tmp_path):
    model = Model(RECIPES[name])
    x = _x()
    if name == "delayed":
        model(x)  # some history, so the scales are not the initial ones
    eager = copy.deepcopy(model)
    loaded = _round_trip(te.export(model, (x,)), tmp_path / "m.pt2").module()
    for i in range(3 if name == "delayed" else 1):  # delayed: the state advances alike
        xi = _x(scale=i + 1.0)
        assert torch.equal(loaded(xi), eager(xi))
    if name == "delayed":
        assert torch.equal(loaded.fc1.fp8_scale_fwd, eager.fc1.fp8_scale_fwd)
        assert torch.equal(loaded.fc1.fp8_amax_history_fwd, eager.fc1.fp8_amax_history_fwd)


@saveable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_program_without_recipe(dtype, tmp_path):
    model, x = Model(None, dtype=dtype), _x(dtype)
    loaded = _round_trip(te.export(model, (x,)), tmp_path / "m.pt2")
    assert torch.equal(loaded.module()(x), model(x))


@saveable
@pytest.mark.parametrize("region", ["no_grad", "autocast"])
@pytest.mark.parametrize("name", ["bf16", "fp8_current"])
def test_layers_inside_grad_and_autocast_regions(name, region, tmp_path):
    """torch records these regions as higher-order ops with their own body
    graph: the body's arguments are lifted too."""
    model = Model(RECIPES[name], region, dtype=torch.float32)
    x = _x(torch.float32)
    ep = te.export(model, (x,))
    assert any(n.op == "get_attr" for n in ep.graph.nodes)  # the region's body
    loaded = _round_trip(ep, tmp_path / "m.pt2")
    assert torch.equal(loaded.module()(x), model(x))


@saveable
def test_dynamic_token_count(tmp_path):
    model, x = Model(RECIPES["fp8_block"]), _x()
    rows = torch.export.Dim("rows", min=2, max=4096)
    loaded = _round_trip(te.export(model, (x,), dynamic_shapes=({0: rows},)),
                         tmp_path / "m.pt2").module()
    for n in (32, 100, 257):
        xn = _x(rows=n)
        assert torch.equal(loaded(xn), model(xn))


@saveable
def test_lift_again_after_run_decompositions(tmp_path):
    """``run_decompositions`` traces again and inlines the objects again."""
    model, x = Model(RECIPES["mxfp8"]), _x()
    ep = te.export(model, (x,)).run_decompositions()
    assert not any(s.kind == torch.export.graph_signature.InputKind.CUSTOM_OBJ
                   for s in ep.graph_signature.input_specs)
    loaded = _round_trip(te.lift_value_opaque(ep), tmp_path / "m.pt2")
    assert torch.equal(loaded.module()(x), model(x))


@saveable
def test_equal_values_share_one_input():
    model, x = Model(RECIPES["fp8_current"]), _x()
    inline = [a for n in torch.export.export(model, (x,)).graph.nodes
              if n.op == "call_function" for a in n.args
              if type(a).__name__ in ("QuantizerSlot", "SimpleValues")]
    ep = te.export(model, (x,))
    lifted = [ep.constants[s.target] for s in ep.graph_signature.input_specs
              if s.kind == torch.export.graph_signature.InputKind.CUSTOM_OBJ]
    assert len(lifted) == len(set(inline)) < len(inline)
    assert set(lifted) == set(inline)


_LOAD_ELSEWHERE = """
import sys, torch
ep = torch.export.load(sys.argv[1])
x, expected = torch.load(sys.argv[2])
assert torch.equal(ep.module()(x), expected)
flags = [v for v in ep.constants.values() if type(v).__name__ == "SimpleValues"]
assert flags and all(hash(v) == hash(type(v)(v.items)) for v in flags)
print("ok")
"""


@saveable
def test_load_in_a_fresh_process(tmp_path):
    """``torch.export.load`` in a process that never imported the library
    (unpickling the constants imports it) and hashes strings differently."""
    model, x = Model(RECIPES["fp8_current"]), _x()
    torch.export.save(te.export(model, (x,)), tmp_path / "m.pt2")
    torch.save((x, model(x)), tmp_path / "ref.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(te.__file__)))
    env = dict(os.environ, PYTHONPATH=root, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _LOAD_ELSEWHERE, str(tmp_path / "m.pt2"),
                          str(tmp_path / "ref.pt")], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_simple_values_pickle_without_cached_hash():
    values = SimpleValues((("a", 1), ("b", "x")))
    hash(values)
    copy_ = pickle.loads(pickle.dumps(values))
    assert copy_ == values and "_hash" not in copy_.__dict__


@saveable
def test_plain_torch_export_does_not_load(tmp_path):
    """The torch limit ``te.export`` works around (torch 2.13, 2.15): the
    save succeeds, the load fails.  If this starts failing, torch stores
    inline opaque values: update docs/linear.md."""
    model, x = Model(RECIPES["fp8_current"]), _x()
    with pytest.warns(UserWarning, match=r"call te\.lift_value_opaque\(ep\) before saving"):
        ep = torch.export.export(model, (x,))
    assert torch.equal(ep.module()(x), model(x))  # runs in this process
    torch.export.save(ep, tmp_path / "m.pt2")
    with pytest.raises(RuntimeError, match="deserializing"):
        torch.export.load(tmp_path / "m.pt2")


@saveable
def test_refuses_layers_inside_other_higher_order_ops():
    layer = te.Linear(64, 64)
    rec = RECIPES["fp8_current"]  # without a recipe the layer is F.linear: nothing to refuse

    def quantized(x):
        with te.autocast(recipe=rec):
            return layer(x)

    class Cond(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, quantized, lambda x: x.clone(), (x,))

    x = torch.randn(8, 64)
    assert torch.equal(torch.export.export(Cond(), (x,)).module()(x), Cond()(x))
    with pytest.raises(NotImplementedError, match=r"torch\.cond.*KeyError '_custom_obj_<n>'"):
        te.export(Cond(), (x,))


@pytest.mark.skipif(compat.export_keeps_opaque_constants(),
                    reason="this torch saves te.export programs")
def test_old_torch_refuses_at_export_and_save(tmp_path):
    """torch 2.11: te.export says why it cannot make a saveable program, and
    saving a plain torch.export.export program fails at save time, not at load."""
    model, x = Model(RECIPES["fp8_current"]), _x()
    with pytest.raises(NotImplementedError, match="needs torch >= 2.13"):
        te.export(model, (x,))
    ep = torch.export.export(model, (x,))
    assert torch.equal(ep.module()(x), model(x))  # runs in this process
    with pytest.raises(Exception, match="Unsupported argument type"):
        torch.export.save(ep, tmp_path / "m.pt2")


@pytest.mark.parametrize("strict", [False, True])
def test_plain_export_warns_and_te_export_does_not(strict):
    """The save of a plain torch.export.export program cannot be made to
    fail, so the export warns, naming the limit and the workaround; te.export
    (whose program saves) does not."""
    import warnings
    model, x = Model(RECIPES["fp8_current"]), _x()
    want = ("te.lift_value_opaque" if compat.export_keeps_opaque_constants()
            else "save its state_dict and export it there")
    with pytest.warns(UserWarning, match=want):
        torch.export.export(model, (x,), strict=strict)
    if compat.export_keeps_opaque_constants():
        _reset()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="te_compile")  # ours would raise
            te.export(model, (x,), strict=strict)


def test_torch_compile_does_not_warn_about_export():
    """Dynamo on torch 2.11 answers is_exporting() True inside torch.compile
    (pytorch#176347): the export warning reads the flag at trace time."""
    import warnings
    model, x = Model(RECIPES["fp8_current"]), _x()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="te_compile")
        torch.compile(model, fullgraph=True, backend="aot_eager")(x)
