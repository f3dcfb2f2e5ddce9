"""The tensor-parallel benchmark on 2 CPU processes (gloo, llama-tiny):
every candidate trains eagerly and compiled (one graph), from the same full
weights, so the bf16 rows' first losses agree and the FP8 ones are near
them.  The times mean nothing on a CPU and are not asserted."""

import math

import pytest
import torch.distributed as dist

from transformer_engine_compile.benchmarks import tp as bench_tp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def test_tp_bench_cpu_candidates_losses_and_profile(capfd):
    rows = bench_tp.cpu_run(["--recipes", "fp8_current,mxfp8", "--modes", "eager,compiled",
                             "--backend", "aot_eager", "--profile"])
    labels = ["torch bf16 TP", *(f"te {r} TP" for r in ("bf16", "fp8_current", "mxfp8")),
              *(f"te {r} TP+SP" for r in ("bf16", "fp8_current", "mxfp8"))]
    assert [(r["candidate"], r["mode"]) for r in rows] == [
        (c, m) for c in labels for m in ("eager", "compiled")]
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and math.isfinite(r["first_loss"]) and r["profile"] == [{}, {}]
        assert r["graphs"] == (1 if r["mode"] == "compiled" else 0), r  # fullgraph, no recompile
    by = {(r["candidate"], r["mode"]): r for r in rows}
    for mode in ("eager", "compiled"):
        base = by[("torch bf16 TP", mode)]["first_loss"]
        assert base > 0.5  # the MSE of unrelated random targets: about 1, not a degenerate 0
        # the same weights and tokens: torch's tensor parallelism, te's, te's with SP
        for label in ("te bf16 TP", "te bf16 TP+SP"):
            assert by[(label, mode)]["first_loss"] == pytest.approx(base, rel=1e-4), label
        for label in labels[2:]:
            assert by[(label, mode)]["first_loss"] == pytest.approx(base, rel=1e-2), label
        for r in rows:
            if r["mode"] == mode:
                assert r["x_bf16"] == pytest.approx(by[("torch bf16 TP", mode)]["ms"] / r["ms"])
    out = capfd.readouterr().out
    assert out.count("| config | candidate | mode | ms/step |") == 1
    assert "tensor parallel, steps 1 (2 ranks, gloo)" in out and "| NCCL share |" in out


def test_tp_bench_refuses_uneven_heads():
    import torch

    cfg = bench_tp.CONFIGS["llama-tiny"]  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="3 ranks do not split 4 heads"):
        bench_tp.TPBlock(cfg, 3, torch.device("cpu"))
