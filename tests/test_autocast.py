"""Recipes and te.autocast, eager and inside/outside torch.compile."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe


def _active():
    r = te.get_autocast_recipe()
    return None if r is None else type(r).__name__


def test_defaults_and_nesting_restore_outer_state():
    assert not te.is_autocast_enabled() and te.get_autocast_recipe() is None
    with te.autocast(recipe=recipe.MXFP8BlockScaling()):
        assert _active() == "MXFP8BlockScaling"
        with te.autocast(enabled=False):
            assert _active() is None
        with te.autocast(recipe=recipe.NVFP4BlockScaling()):
            assert _active() == "NVFP4BlockScaling"
        assert _active() == "MXFP8BlockScaling"
    assert _active() is None
    with te.autocast():
        assert isinstance(te.get_autocast_recipe(), recipe.Float8CurrentScaling)


def test_state_restored_after_exception():
    with pytest.raises(RuntimeError):
        with te.autocast(recipe=recipe.Float8BlockScaling()):
            raise RuntimeError("boom")
    assert not te.is_autocast_enabled()


def test_fp8_autocast_alias_and_group():
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(), fp8_group="g"):
        assert _active() == "DelayedScaling"
        from transformer_engine_compile.autocast import get_amax_reduction_group
        assert get_amax_reduction_group() == "g"


def test_recipe_validation_and_te_field_names():
    with pytest.raises(TypeError, match="Recipe"):
        te.autocast(recipe="fp8")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        recipe.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="w_block_scaling_dim"):
        recipe.Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(TypeError, match="Format"):
        recipe.Float8CurrentScaling(fp8_format="E4M3")
    d = recipe.DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent")
    assert (d.margin, d.fp8_format, d.amax_history_len) == (1, recipe.Format.HYBRID, 16)
    assert {f.name for f in dataclasses.fields(recipe.NVFP4BlockScaling)} == {
        "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"}
    assert recipe.MXFP8BlockScaling().mxfp8() and not recipe.MXFP8BlockScaling().delayed()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.margin = 2


def _layer(x):
    """Stand-in for a layer: quantizes when autocast is on."""
    r = te.get_autocast_recipe()
    if r is None:
        return x * 1.0
    return te.quantizer_for(r, "input").with_usage(columnwise=False).quantize(x).dequantize()


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    counters.clear()


def test_autocast_entered_inside_compiled_function():
    def f(x):
        with te.autocast(recipe=recipe.MXFP8BlockScaling()):
            y = _layer(x)
            with te.autocast(enabled=False):
                z = _layer(x)
        return y, z, _layer(x)

    x = torch.randn(64, 64)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    want = f(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], got[1])  # the recipe really applied inside
    assert not te.is_autocast_enabled()  # state restored after the compiled call
    assert not counters["graph_break"]


def test_autocast_outside_compiled_function_guards_on_recipe():
    cf = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(128, 128)
    for r in (recipe.Float8CurrentScaling(), recipe.Float8CurrentScaling(),
              recipe.Float8BlockScaling()):
        with te.autocast(recipe=r):
            assert torch.equal(cf(x), _layer(x))
    assert torch.equal(cf(x), x)  # autocast off again
    assert counters["stats"]["unique_graphs"] == 3  # current, blockwise, off
    assert not counters["graph_break"]


def test_quantizer_for_roles():
    q = te.quantizer_for(recipe.Float8CurrentScaling(), "grad_output")
    assert q.fp8_format == "e5m2"
    q = te.quantizer_for(recipe.Float8BlockScaling(), "weight")
    assert q.block_scaling_dim == 2
    nv = recipe.NVFP4BlockScaling()
    assert te.quantizer_for(nv, "weight").with_2d_quantization
    assert te.quantizer_for(nv, "input").with_rht and not te.quantizer_for(nv, "input").stochastic_rounding
    assert te.quantizer_for(nv, "grad_output").stochastic_rounding
    assert not te.quantizer_for(recipe.NVFP4BlockScaling(disable_rht=True), "input").with_rht
    d = te.quantizer_for(recipe.DelayedScaling(margin=2, amax_compute_algo="most_recent"),
                         "grad_output")
    assert (type(d).__name__, d.fp8_format, d.margin, d.amax_compute_algo) == (
        "Float8DelayedScalingQuantizer", "e5m2", 2, "most_recent")
    with pytest.raises(ValueError, match="role"):
        te.quantizer_for(nv, "bias")


def test_recipe_by_name():
    from transformer_engine_compile import recipe as R

    assert R.by_name("bf16") is None
    assert isinstance(R.by_name("fp8_block"), R.Float8BlockScaling)
    assert R.by_name("nvfp4") == R.NVFP4BlockScaling()
    with pytest.raises(ValueError, match="unknown recipe name 'fp16'"):
        R.by_name("fp16")


def test_recipe_numeric_fields_are_validated_and_kept_as_constants():
    from transformer_engine_compile import recipe as R

    rec = R.Float8BlockScaling(amax_epsilon=1e-3, w_block_scaling_dim=1)
    assert rec.constant("amax_epsilon") == 1e-3 and type(rec.constant("amax_epsilon")) is float
    assert rec.constant("w_block_scaling_dim") == 1
    assert R.Float8CurrentScaling(amax_epsilon=0).amax_epsilon == 0.0
    with pytest.raises(TypeError, match="amax_epsilon must be float"):
        R.Float8CurrentScaling(amax_epsilon="0.1")
    with pytest.raises(TypeError, match="margin must be int"):
        R.DelayedScaling(margin=1.5)


def test_autocast_and_fp8_autocast_as_decorators():
    @te.autocast(recipe=recipe.MXFP8BlockScaling())
    def mx(x):
        return _active(), _layer(x)

    @te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(), fp8_group="g")
    def delayed():
        from transformer_engine_compile.autocast import get_amax_reduction_group
        return _active(), get_amax_reduction_group()

    @te.autocast(enabled=False)
    def off():
        return _active()

    x = torch.randn(64, 64)
    with te.autocast(recipe=recipe.Float8BlockScaling()):
        name, y = mx(x)
        assert name == "MXFP8BlockScaling" and _active() == "Float8BlockScaling"  # restored
        assert off() is None and _active() == "Float8BlockScaling"
    with te.autocast(recipe=recipe.MXFP8BlockScaling()):
        assert torch.equal(y, _layer(x))
    assert delayed() == ("DelayedScaling", "g") and _active() is None
    assert mx.__name__ == "mx"  # functools.wraps
    # a decorated function compiles without a graph break and equals eager
    got = torch.compile(mx, fullgraph=True, backend="aot_eager")(x)
    assert got[0] == "MXFP8BlockScaling" and torch.equal(got[1], y)
    assert not counters["graph_break"] and not te.is_autocast_enabled()
