"""The FP8 GEMMs' accumulation (Transformer Engine's ``fp8_gemm_fprop`` /
``_dgrad`` / ``_wgrad`` ``MMParams`` of Float8CurrentScaling): the defaults
(fprop fast, dgrad and wgrad split), the recipe's choice reaching each
GEMM of te.Linear and te.GroupedLinear, and the native plans keeping to
the defaults."""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R
from transformer_engine_compile.module.grouped import fp8_gemm
from transformer_engine_compile.module.linear import compute as linear_compute
from transformer_engine_compile.module.linear.args import LinearBwdArgs, default_accumulation

FAST = R.Float8CurrentScaling(fp8_gemm_dgrad=R.MMParams(use_split_accumulator=False),
                              fp8_gemm_wgrad=R.MMParams(use_split_accumulator=False))


def test_recipe_fields_and_defaults():
    default = R.Float8CurrentScaling()
    assert default.fast_accumulation() == (True, False, False)
    te_defaults = R.Float8CurrentScaling(fp8_gemm_fprop=R.MMParams(use_split_accumulator=False),
                                         fp8_gemm_dgrad=R.MMParams(use_split_accumulator=True),
                                         fp8_gemm_wgrad=R.MMParams(use_split_accumulator=True))
    assert te_defaults.fast_accumulation() == (True, False, False)
    assert FAST.fast_accumulation() == (True, True, True)
    assert FAST != default and hash(FAST) != hash(default)  # compiled code guards on it
    for rec in (R.DelayedScaling(), R.Float8BlockScaling(), R.MXFP8BlockScaling()):
        assert rec.fast_accumulation() == (True, False, False)
    with pytest.raises(TypeError, match="fp8_gemm_dgrad must be a recipe.MMParams or None"):
        R.Float8CurrentScaling(fp8_gemm_dgrad=False)
    with pytest.raises(TypeError, match="use_split_accumulator must be a bool"):
        R.MMParams(use_split_accumulator=1)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rec", [R.Float8CurrentScaling(), FAST], ids=["default", "fast"])
def test_te_linear_passes_each_gemms_accumulation(monkeypatch, rec, compiled):
    torch._dynamo.reset()
    calls = []
    real = linear_compute.gemm

    def recording(a, a_usage, b, b_usage, *args, fast_accum=False, **kwargs):
        calls.append((a_usage, b_usage, fast_accum))
        return real(a, a_usage, b, b_usage, *args, fast_accum=fast_accum, **kwargs)

    monkeypatch.setattr(linear_compute, "gemm", recording)
    layer = te.Linear(64, 32, params_dtype=torch.bfloat16)
    call = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=rec):
        call(x).sum().backward()
    fprop, dgrad, wgrad = rec.fast_accumulation()
    assert calls == [("rowwise", "rowwise", fprop), ("rowwise", "columnwise", dgrad),
                     ("columnwise", "columnwise", wgrad)]


def test_native_plans_run_the_default_accumulation_only():
    assert default_accumulation(LinearBwdArgs(grad_output=torch.zeros(1)))
    assert not default_accumulation(LinearBwdArgs(grad_output=torch.zeros(1),
                                                  wgrad_fast_accum=True))


def test_grouped_linear_takes_the_recipes_accumulation(monkeypatch):
    from transformer_engine_compile.module.grouped import layer as grouped_layer

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    fields = grouped_layer.quantizer_fields(FAST, None, x)
    assert (fields["fprop_fast_accum"], fields["dgrad_fast_accum"],
            fields["wgrad_fast_accum"]) == (True, True, True)
    fields = grouped_layer.quantizer_fields(R.Float8CurrentScaling(), None, x)
    assert (fields["dgrad_fast_accum"], fields["wgrad_fast_accum"]) == (False, False)
    # and the grouped FP8 GEMMs hand it to the kernel
    seen = []

    def scaled_grouped_mm(*args, use_fast_accum=False, **kwargs):
        seen.append(use_fast_accum)
        return torch.zeros(1)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    e4m3 = torch.zeros(32, 16, dtype=torch.float8_e4m3fn)
    s, offs = torch.ones(2), torch.tensor([16, 32], dtype=torch.int32)
    rows = torch.zeros(32, dtype=torch.long)
    w = torch.zeros(2, 16, 16, dtype=torch.float8_e4m3fn)
    fp8_gemm.fprop(e4m3, s, w, s, rows, offs, fast_accum=False)
    fp8_gemm.dgrad(e4m3, s, w, s, rows, offs, fast_accum=True)
    fp8_gemm.wgrad(e4m3.t().contiguous(), s, e4m3.t().contiguous(), s, offs, fast_accum=True)
    assert seen == [False, True, True]
