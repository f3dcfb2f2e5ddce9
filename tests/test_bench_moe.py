"""The mixture-of-experts benchmark's CPU smoke run: every candidate gets a
row, te.GroupedExperts' output equals the torch baseline's, and a recipe
the grouped layer does not run yet shows as an error row, not a crash."""

import json

import torch

from transformer_engine_compile.benchmarks import moe


def test_moe_benchmark_rows(tmp_path):
    out = tmp_path / "moe.json"
    rc = moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_current",
                   "mxfp8", "fp8_delayed", "--json", str(out)])
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["rows"]}
    assert rc == 1  # the fp8_delayed row failed
    assert rows["torch bf16"]["x_bf16"] == 1.0
    for label in ("te bf16", "te fp8_current", "te mxfp8"):
        assert rows[label]["ms"] > 0 and rows[label]["x_bf16"] > 0
    assert "DelayedScaling is not implemented" in rows["te fp8_delayed"]["error"]


def test_te_block_equals_the_torch_block():
    cfg = moe.CONFIGS["tiny"]
    x = torch.randn(cfg.tokens, cfg.hidden, dtype=torch.bfloat16)
    outs = [moe.build(cfg, kind, torch.device("cpu"))(x) for kind in ("torch", "te")]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_padded_permutation_keeps_the_result():
    """torchtitan's padded token groups (the torchao baseline's permutation)
    change nothing but the layout: the same block output."""
    cfg = moe.MoEConfig(hidden=32, ffn=16, experts=4, top_k=2, tokens=24)
    x = torch.randn(cfg.tokens, cfg.hidden).to(torch.bfloat16)
    plain = moe.build(cfg, "torch", torch.device("cpu"))
    padded = moe.build(cfg, "torch", torch.device("cpu"))
    padded.experts.padded = True
    torch.testing.assert_close(padded(x), plain(x), rtol=0, atol=0)


def test_the_bf16_rows_quantize_nothing(monkeypatch):
    """A row without a recipe runs te.autocast disabled: enabled with no
    recipe, te.autocast would quantize with the default one."""
    import sys

    ac = sys.modules["transformer_engine_compile.autocast"]  # the module, not the class
    seen = []
    real = ac.autocast

    def recording(enabled=True, recipe=None, **kwargs):
        seen.append((enabled, recipe))
        return real(enabled=enabled, recipe=recipe, **kwargs)

    monkeypatch.setattr(ac, "autocast", recording)
    cfg = moe.CONFIGS["tiny"]
    x = torch.randn(cfg.tokens, cfg.hidden).to(torch.bfloat16).requires_grad_()
    moe.time_block(moe.build(cfg, "te", torch.device("cpu")), None, x, 1, compiled=False)
    assert seen and all(enabled is False for enabled, _ in seen)


def test_profile_prints_each_rows_kernels(capsys):
    assert moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_current",
                     "--profile"]) == 0
    out = capsys.readouterr().out
    for label in ("torch bf16", "te bf16", "te fp8_current"):
        assert f"### tiny {label}\n" in out
