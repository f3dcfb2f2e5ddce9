"""The FSDP2 benchmark on 2 CPU processes (gloo, llama-tiny): every candidate
runs eagerly and with compiled blocks, quantized gathers move fewer bytes,
ratios are against the baseline.  The times themselves mean nothing on a CPU
and are not asserted."""

import math

import pytest
import torch.distributed as dist

from transformer_engine_compile.benchmarks import fsdp as bench_fsdp
from transformer_engine_compile.benchmarks.compare import torchao_available

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def test_fsdp_bench_cpu_every_candidate_and_gather_bytes(capfd):
    # aot_eager: the same Dynamo capture (fullgraph) as inductor, without its CPU codegen time
    rows = bench_fsdp.cpu_run(["--recipes", "bf16,fp8_current,fp8_block",
                               "--modes", "eager,compiled", "--backend", "aot_eager"])
    labels = ["torch bf16", *(["torchao fp8 tensorwise", "torchao fp8 tensorwise (bf16 gather)"]
                              if torchao_available() else []),
              "te bf16", "te fp8_current", "te fp8_current (bf16 gather)", "te fp8_block",
              "te fp8_block (bf16 gather)"]
    assert [(r["candidate"], r["mode"]) for r in rows] == [
        (c, m) for c in labels for m in ("eager", "compiled")]
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and math.isfinite(r["loss"]) and r["all_gather_bytes"] > 0
        # compiled: one graph per block (2), so no graph break and no recompile
        assert r["graphs"] == (2 if r["mode"] == "compiled" else 0), r

    for mode in ("eager", "compiled"):
        by = {r["candidate"]: r for r in rows if r["mode"] == mode}
        # the same bf16 parameters gather the same bytes on torch.nn.Linear and te.Linear
        assert by["te bf16"]["all_gather_bytes"] == by["torch bf16"]["all_gather_bytes"]
        # FP8 current scaling gathers every GEMM weight in 1 byte instead of 2
        # (the norm weights stay bf16); the plain gather of the recipe moves bf16
        fp8, plain = by["te fp8_current"], by["te fp8_current (bf16 gather)"]
        assert fp8["gather"] == "fp8_current 14/14" and plain["gather"] == "bf16"
        assert fp8["all_gather_bytes"] <= 0.55 * by["te bf16"]["all_gather_bytes"]
        assert fp8["all_gather_bytes"] < plain["all_gather_bytes"]
        assert plain["all_gather_bytes"] == by["te bf16"]["all_gather_bytes"]
        # 128x128 blocks: k and v (128 rows) do not split into whole blocks over 2 ranks
        assert by["te fp8_block"]["gather"] == "fp8_block 10/14"
        assert by["te fp8_block"]["all_gather_bytes"] < by["te bf16"]["all_gather_bytes"]
        assert by["te fp8_block (bf16 gather)"]["gather"] == "bf16"
        if torchao_available():  # torchao's FP8 all-gather, and its bf16 gather
            ao, ao_plain = by["torchao fp8 tensorwise"], by["torchao fp8 tensorwise (bf16 gather)"]
            assert ao["gather"] == "fp8 (torchao)" and ao_plain["gather"] == "bf16"
            assert ao["all_gather_bytes"] < ao_plain["all_gather_bytes"]
            assert ao_plain["all_gather_bytes"] == by["torch bf16"]["all_gather_bytes"]

        # the ratio column: the baseline's ms over the row's, in the same mode
        base = by["torch bf16"]
        assert base["x_bf16"] == 1.0
        for r in by.values():
            assert r["x_bf16"] == pytest.approx(base["ms"] / r["ms"], rel=1e-12)
            # global tokens: 2 ranks x llama-tiny's 2 x 64 each
            assert r["tokens_per_s"] == pytest.approx(2 * 2 * 64 / r["ms"] * 1e3)

    out = capfd.readouterr().out  # rank 0 printed the table; rank 1 printed nothing
    assert out.count("| config | candidate |") == 1 and "(2 ranks, gloo)" in out
    assert out.count("| llama-tiny | te fp8_current (bf16 gather) |") == 2


def test_fsdp_bench_hugging_face_layers_share_one_graph():
    """The Hugging Face model trains without a KV cache, as training does:
    its compiled decoder layers share one graph (with the cache each layer
    would compile its own, every call checking the guards of those before)."""
    pytest.importorskip("transformers")
    rows = bench_fsdp.cpu_run(["--configs", "hf-llama-tiny", "--recipes", "fp8_current",
                               "--modes", "compiled", "--backend", "aot_eager", "--no-torchao",
                               "--candidates", "torch bf16,te fp8_current"])
    for r in rows:
        assert "error" not in r, r
        assert r["graphs"] == 1, r


def test_fsdp_bench_hugging_face_model_and_profile(capfd):
    """The Hugging Face model after te.convert, sharded per decoder layer,
    and ``--profile``: every rank's step summary comes back (on CPU the
    trace has no GPU events, so each summary is empty) and rank 0 prints
    the breakdown section."""
    pytest.importorskip("transformers")
    rows = bench_fsdp.cpu_run(["--configs", "hf-llama-tiny", "--recipes", "fp8_current",
                               "--modes", "eager", "--no-torchao", "--profile",
                               "--candidates", "torch bf16,te fp8_current"])
    assert [r["candidate"] for r in rows] == ["torch bf16", "te fp8_current"]
    for r in rows:
        assert "error" not in r, r
        assert math.isfinite(r["loss"]) and r["profile"] == [{}, {}]
    te_row = rows[1]
    # te.convert also converts the LM head, which the root unit gathers in bf16
    assert te_row["gather"] == "fp8_current 14/15"
    assert te_row["all_gather_bytes"] < rows[0]["all_gather_bytes"]
    out = capfd.readouterr().out
    assert "### hf-llama-tiny / te fp8_current / eager (rank 0)" in out


def test_fsdp_bench_interleaved_rounds(capfd):
    """``--rounds 2``: every candidate built first, then timed in turns; the
    rows carry the same measured fields (the first steps' bytes, graphs)
    and the ratio to the baseline.  Six resident candidates of two compiled
    blocks each hold more graphs of one code object than Dynamo's default
    limit (8): none may fail on it."""
    rows = bench_fsdp.cpu_run(["--recipes", "fp8_current,fp8_block", "--modes", "compiled",
                               "--backend", "aot_eager", "--no-torchao", "--rounds", "2"])
    assert [r["candidate"] for r in rows] == [
        "torch bf16", "te bf16", "te fp8_current", "te fp8_current (bf16 gather)",
        "te fp8_block", "te fp8_block (bf16 gather)"]
    for r in rows:
        assert "error" not in r, r
        assert r["rounds"] == 2 and r["ms"] > 0 and math.isfinite(r["loss"])
        assert r["graphs"] == 2, r  # one per block, compiled once, none over the rounds
        assert r["x_bf16"] == pytest.approx(rows[0]["ms"] / r["ms"], rel=1e-12)
    assert rows[2]["gather"] == "fp8_current 14/14" and rows[3]["gather"] == "bf16"
    assert rows[2]["all_gather_bytes"] < rows[3]["all_gather_bytes"] == rows[0]["all_gather_bytes"]
    out = capfd.readouterr().out
    assert out.count("| config | candidate |") == 1
    assert out.count("| llama-tiny | te fp8_current |") == 1


def test_fsdp_bench_kept_copies_equal_the_requantized_backward():
    """``--kept-copies``: each te recipe's bf16 gather also runs with the
    layers keeping their FP8 weight copies for the backward; its losses
    equal those of the default (the backward quantizing the gathered weight
    again) bit for bit, step after step."""
    rows = bench_fsdp.cpu_run(["--recipes", "fp8_current", "--modes", "compiled",
                               "--backend", "aot_eager", "--no-torchao", "--kept-copies",
                               "--candidates", "te fp8_current (bf16 gather),"
                               "te fp8_current (bf16 gather + FP8 copy kept)"])
    assert [r["candidate"] for r in rows] == [
        "te fp8_current (bf16 gather)", "te fp8_current (bf16 gather + FP8 copy kept)"]
    for r in rows:
        assert "error" not in r, r
        assert r["gather"] == "bf16" and r["graphs"] == 2
    assert rows[0]["loss"] == rows[1]["loss"]


def test_fsdp_bench_no_reshard_gathers_once_with_the_same_losses():
    """``--no-reshard``: torch bf16 and te fp8_current's FP8 gather also run
    with the blocks keeping their gathered weights until the backward
    (``reshard_after_forward=False``): the same losses bit for bit (FP8:
    the forward's gather makes the transposed copy the backward's would
    have), and fewer bytes gathered (the blocks' weights once, not twice)."""
    labels = ["torch bf16", "te fp8_current", "torch bf16 (no reshard)",
              "te fp8_current (no reshard)"]
    rows = bench_fsdp.cpu_run(["--recipes", "fp8_current", "--modes", "compiled",
                               "--backend", "aot_eager", "--no-torchao", "--no-reshard",
                               "--steps", "2", "--candidates", ",".join(labels)])
    assert [r["candidate"] for r in rows] == labels
    by = {r["candidate"]: r for r in rows}
    for r in rows:
        assert "error" not in r, r
        assert r["graphs"] == 2, r  # one per block, no recompile
    for label in labels[:2]:
        kept, default = by[f"{label} (no reshard)"], by[label]
        assert kept["loss"] == default["loss"]
        assert kept["gather"] == default["gather"]
        assert 0 < kept["all_gather_bytes"] < default["all_gather_bytes"]
