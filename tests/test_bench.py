"""The benchmark module and the kernel dispatch on CPU (the GPU numbers
themselves live in docs/benchmarks.md; they are never asserted in tests)."""

import json

import torch

from transformer_engine_compile import bench, kernels
from transformer_engine_compile.kernels import reference as ref


def test_bench_cpu_smoke_prints_every_row(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench.main(["--recipes", "fp8_current", "--modes", "eager", "default",
                     "--iters", "1", "--no-torchao", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    labels = {(r["candidate"], r["mode"]) for r in rows}
    assert labels == {(c, m) for c in ("torch bf16", "te bf16", "te fp8_current")
                      for m in ("eager", "default")}
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    table = capsys.readouterr().out
    assert "x bf16" in table and table.count("te fp8_current") >= 4


def test_bench_fp8_grad_rows(tmp_path):
    out = tmp_path / "rows.json"
    rc = bench.main(["--device", "cpu", "--configs", "tiny", "--recipes", "fp8_current",
                     "nvfp4", "--modes", "default", "--iters", "1", "--no-torchao", "--fp8-grad",
                     "--json", str(out)])
    assert rc == 0
    labels = [r["candidate"] for r in json.loads(out.read_text())["rows"]]
    assert labels == ["torch bf16", "te bf16", "te fp8_current", "te fp8_current fp8_grad",
                      "te nvfp4"]
    # the first layer's output (second layer's input) gets a quantized gradient
    import transformer_engine_compile as te
    model = bench._te_fp8_grad_model(128, 128, 2, "cpu")
    seen = []

    def watch(module, inputs, out):
        out.register_hook(seen.append)

    model.layers[0].register_forward_hook(watch)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=bench.RECIPES["fp8_current"]):
        model(x).float().sum().backward()
    assert isinstance(seen[0], te.Float8Tensor) and not isinstance(x.grad, te.Float8Tensor)


def test_cpu_dispatch_is_the_reference():
    x = torch.randn(4, 8)
    assert kernels.get("quantize_fp8_current", x) is ref.quantize_fp8_current
    assert kernels.get("amax", x) is ref.amax
    assert not kernels.fast_kernels_available("cpu")


def test_nvfp4_constants_built_on_device_match_their_definitions():
    h = torch.ones(1, 1)
    while h.shape[0] < ref.NVFP4_BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.tensor(ref.RHT_SIGNS, dtype=torch.float32)
    assert torch.equal(ref.rht_matrix(), h * signs / 4.0)
    t = ref.rht_matrix()
    assert torch.allclose(t @ t.t(), torch.eye(16))
    assert torch.equal(ref._e2m1_grid("cpu"), torch.tensor(ref._E2M1_VALUES))


def test_current_scaling_reference_is_amax_then_scale():
    x = torch.randn(64, 32) * 5
    out = ref.quantize_fp8_current(x, "e4m3", False, 0.0, True, False)
    scale = ref.compute_scale(x.abs().amax(), 448.0)
    assert torch.equal(out["scale_inv"], torch.reciprocal(scale).reshape(1))
    eps_out = ref.quantize_fp8_current(torch.zeros(4, 4), "e4m3", False, 1e-2, True, False)
    assert torch.equal(eps_out["scale_inv"], torch.reciprocal(ref.compute_scale(
        torch.tensor(1e-2), 448.0)).reshape(1))
