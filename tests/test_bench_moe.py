"""The mixture-of-experts benchmark's CPU smoke run: every candidate gets a
row, te.GroupedExperts' output equals the torch baseline's, a failing
candidate shows as an error row, not a crash, and the Hugging Face MoE
model's training step runs as is and after te.convert."""

import json

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.benchmarks import moe


def test_moe_benchmark_rows(tmp_path, monkeypatch):
    out = tmp_path / "moe.json"
    real = moe.time_block

    def failing_for_mxfp8(block, rec, *args, **kwargs):
        if isinstance(rec, te.recipe.MXFP8BlockScaling):
            raise RuntimeError("a candidate that fails")
        return real(block, rec, *args, **kwargs)

    monkeypatch.setattr(moe, "time_block", failing_for_mxfp8)
    rc = moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_current",
                   "mxfp8", "fp8_delayed", "--json", str(out)])
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["rows"]}
    assert rc == 1  # the mxfp8 row failed; the others still ran
    assert rows["torch bf16"]["x_bf16"] == 1.0
    for label in ("te bf16", "te fp8_current", "te fp8_delayed"):
        assert rows[label]["ms"] > 0 and rows[label]["x_bf16"] > 0
    assert "a candidate that fails" in rows["te mxfp8"]["error"]


def test_moe_benchmark_compiles_in_the_mode_asked(tmp_path, monkeypatch):
    """``--mode reduce-overhead`` reaches torch.compile (CUDA graphs on a GPU;
    on a CPU inductor runs without them) and the result file says so."""
    out = tmp_path / "moe.json"
    modes = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (modes.append(kw.get("mode")),
                                                            real(fn, **kw))[1])
    rc = moe.main(["--configs", "tiny", "--steps", "1", "--recipes", "fp8_current",
                   "--mode", "reduce-overhead", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["mode"] == "reduce-overhead"
    assert modes and set(modes) == {"reduce-overhead"}
    assert all(r["ms"] > 0 for r in result["rows"])


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


def test_hf_moe_model_rows(tmp_path):
    """A Hugging Face MoE model's training step as is and after te.convert:
    the te rows run te.GroupedExperts, the baseline HF's grouped_mm experts,
    and both fit the batch to about the same loss."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    rc = moe.main(["--configs", "hf-tiny", "--steps", "2", "--eager", "--recipes",
                   "fp8_current", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, rows
    by = {r["candidate"]: r for r in rows}
    assert set(by) == {"torch bf16", "te bf16", "te fp8_current"}
    assert by["te bf16"]["experts"] == by["te fp8_current"]["experts"] == "te.GroupedExperts"
    assert by["torch bf16"]["experts"] in ("grouped_mm", "eager")
    assert all(r["host_ms"] > 0 and r["ms"] >= r["host_ms"] for r in rows)
    assert abs(by["te bf16"]["loss"] - by["torch bf16"]["loss"]) < 0.05 * by["torch bf16"]["loss"]


def test_the_dequantized_candidate_turns_the_blockwise_kernel_off(tmp_path, monkeypatch):
    """``fp8_block_dequantized`` times the same recipe with the CuTeDSL kernel
    off (its fallback path), and leaves the switch as it found it."""
    import os

    from transformer_engine_compile.module.grouped.blockwise_gemm import DISABLE_VAR

    seen = {}

    def record(block, rec, *args, **kwargs):
        seen[type(rec).__name__ if rec is not None else None, os.environ.get(DISABLE_VAR)] = 1
        return {"ms": 1.0, "host_ms": 0.5}

    monkeypatch.delenv(DISABLE_VAR, raising=False)
    monkeypatch.setattr(moe, "time_block", record)
    moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_block",
              "fp8_block_dequantized", "--json", str(tmp_path / "m.json")])
    assert ("Float8BlockScaling", None) in seen and ("Float8BlockScaling", "0") in seen
    assert DISABLE_VAR not in os.environ


def test_microbatches_add_a_cached_row_and_cache_the_weights(tmp_path, monkeypatch):
    """``--microbatches`` runs each recipe also with its FP8 weights cached
    across the microbatches: the cached block calls ``is_first_microbatch``
    True once, then False, per step, and accumulates the same gradients as
    the uncached one; reduce-overhead refuses microbatches."""
    cfg = moe.CONFIGS["tiny"]
    rec = te.recipe.Float8CurrentScaling()
    x = torch.randn(cfg.tokens, cfg.hidden, dtype=torch.bfloat16)
    grads, flags = [], []
    for cache in (False, True):
        block = moe.build(cfg, "te", torch.device("cpu"))
        real_forward = block.experts.forward
        block.experts.forward = lambda *a: (flags.append(a[3] if len(a) > 3 else None),
                                            real_forward(*a))[1]
        moe.time_block(block, rec, x.clone().requires_grad_(), steps=1, compiled=False,
                       microbatches=3, cache=cache)
        grads.append(block.experts.down_proj.grad)
    # 3 warm-up steps + 1 timed step, 3 microbatches each
    assert flags[:12] == [None] * 12 and flags[12:] == [True, False, False] * 4
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    out = tmp_path / "moe.json"
    assert moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_current",
                     "--microbatches", "2", "--json", str(out)]) == 0
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["te fp8_current cached"]["ms"] > 0 and rows["te fp8_current"]["microbatches"] == 2
    with pytest.raises(ValueError, match="default mode"):
        moe.run(["tiny"], ["fp8_current"], torch.device("cpu"), 1, True, mode="reduce-overhead",
                microbatches=2)


def test_tokens_override_the_block_configs(tmp_path):
    """--tokens: the block runs that many tokens per step, and its rows say so."""
    out = tmp_path / "moe.json"
    rc = moe.main(["--configs", "tiny", "--steps", "1", "--eager", "--recipes", "fp8_current",
                   "--tokens", "96", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and {r["tokens"] for r in rows} == {96}
    assert moe.format_row(rows[0]).split()[0] == "tiny@96"
    assert moe.config_with_tokens("tiny").tokens == moe.CONFIGS["tiny"].tokens


def test_tokens_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        moe.main(["--configs", "tiny", "--tokens", "0"])
    assert "--tokens must be positive" in capsys.readouterr().err
