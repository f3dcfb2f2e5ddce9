"""The benchmark module and the kernel dispatch on CPU (the GPU numbers
themselves live in docs/benchmarks.md; they are never asserted in tests)."""

import json
import math
import statistics

import pytest
import torch

from transformer_engine_compile import kernels
from transformer_engine_compile.benchmarks import compare as bench
from transformer_engine_compile.kernels import reference as ref


def test_bench_cpu_smoke_runs_every_recipe(tmp_path):
    """The default CPU run (64 tokens: below one block of FP8 blockwise,
    MXFP8 and NVFP4) gives a row without error for every recipe."""
    out = tmp_path / "rows.json"
    rc = bench.main(["--device", "cpu", "--configs", "tiny", "--modes", "default",
                     "--iters", "1", "--no-torchao", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["candidate"] for r in rows} == {"torch bf16", "te bf16",
                                              *(f"te {n}" for n in bench.RECIPES)}
    assert all(r["ms"] > 0 and "error" not in r for r in rows)


def test_bench_cpu_smoke_prints_every_row(tmp_path, capsys):
    out = tmp_path / "rows.json"
    # --device cpu: on a GPU machine the default is every GPU config (minutes)
    rc = bench.main(["--device", "cpu", "--recipes", "fp8_current", "--modes", "eager",
                     "default", "--iters", "1", "--no-torchao", "--json", str(out)])
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


def test_llama_smoke_run_prints_every_candidate(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench.main(["--device", "cpu", "--configs", "llama-tiny", "--recipes", "fp8_current",
                     "fp8_block", "--modes", "eager", "default", "--steps", "1", "--json",
                     str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["llama"]
    assert [(r["candidate"], r["mode"]) for r in rows] == [
        (c, m) for c in ("torch bf16", "te bf16", "te fp8_current", "te fp8_block")
        for m in ("eager", "default")]
    for r in rows:
        assert "error" not in r and 0 < r["host_ms"] <= r["ms"] and r["loss"] == r["loss"]
    assert "tokens/s" in capsys.readouterr().out


def test_hugging_face_llama_config_trains_every_candidate(tmp_path):
    """``hf-llama-tiny``: Hugging Face's LlamaForCausalLM as is and after
    te.convert, its own loss; te bf16 computes torch bf16's losses bit for
    bit (te.convert keeps the GEMMs), and the FP8 candidate trains."""
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--configs", "hf-llama-tiny", "--recipes",
                       "fp8_current", "--modes", "eager", "--steps", "2", "--json",
                       str(out)]) == 0
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["llama"]}
    assert set(rows) == {"torch bf16", "te bf16", "te fp8_current"}
    assert rows["te bf16"]["loss"] == rows["torch bf16"]["loss"]
    # the losses are the models' cross-entropy: about log(vocab) at the start
    assert all(0 < r["loss"] < 2 * math.log(512) for r in rows.values())


def test_unshared_candidate_trains_to_the_same_losses(tmp_path, monkeypatch):
    """``--unshared``: the te model with eager input sharing off, for an A/B
    in one run.  Sharing changes no bits, so both candidates' losses are
    equal; each candidate's layer calls run with its own setting."""
    pytest.importorskip("transformers")
    from transformer_engine_compile.dynamo import shared_inputs
    offered = []
    real = shared_inputs.record
    monkeypatch.setattr(shared_inputs, "record",
                        lambda x, q, xq, tag=None: (offered.append(shared_inputs.EAGER),
                                                    real(x, q, xq, tag))[1])
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--configs", "hf-llama-tiny", "--recipes",
                       "fp8_current", "--modes", "eager", "--steps", "2", "--unshared",
                       "--candidates", "te fp8_current", "te fp8_current unshared",
                       "--json", str(out)]) == 0
    rows = {r["candidate"]: r for r in json.loads(out.read_text())["llama"]}
    assert set(rows) == {"te fp8_current", "te fp8_current unshared"}
    assert rows["te fp8_current"]["loss"] == rows["te fp8_current unshared"]["loss"]
    assert True in offered and False in offered  # each candidate ran with its own setting
    assert shared_inputs.EAGER  # restored after the run


def test_hugging_face_model_refuses_packed_kinds():
    pytest.importorskip("transformers")
    from transformer_engine_compile.benchmarks import llama as bl
    with pytest.raises(ValueError, match="no 'te-fused' variant"):
        bl.build(bl.TINY_HF["hf-llama-tiny"], "te-fused", "cpu")


def test_autograd_threads_off_holds_for_the_run_only(tmp_path, monkeypatch):
    """``--autograd-threads off``: the timed steps run with the engine's
    device threads off, the setting comes back after, the JSON says so."""
    from transformer_engine_compile.benchmarks import llama as bench_llama
    seen = []

    def fake_run(*args, **kwargs):
        seen.append(torch.autograd.is_multithreading_enabled())
        return []

    monkeypatch.setattr(bench_llama, "run", fake_run)
    out = tmp_path / "rows.json"
    for flag, expected in (("off", False), ("on", True)):
        assert bench.main(["--device", "cpu", "--configs", "llama-tiny", "--modes", "eager",
                           "--autograd-threads", flag, "--json", str(out)]) == 0
        assert seen[-1] is expected
        assert json.loads(out.read_text())["autograd_threads"] == flag
        assert torch.autograd.is_multithreading_enabled()


def test_llama_model_on_te_linear_is_the_torch_model():
    """Same weights: te.Linear in bf16 runs the same GEMMs as torch.nn.Linear."""
    from transformer_engine_compile.benchmarks import llama as bl
    cfg = bl.TINY_LLAMA["llama-tiny"]
    ref_model, te_model = bl.build(cfg, "torch", "cpu"), bl.build(cfg, "te", "cpu")
    te_model.load_state_dict(ref_model.state_dict())
    x, target = bl.inputs(cfg, torch.device("cpu"))
    assert torch.equal(te_model(x), ref_model(x))
    losses = [bl.make_step(te_model, None, "eager", lr=1e-2)(x, target) for _ in range(3)]
    assert losses[2] < losses[0]  # the step trains: AdamW updated the te.Linear weights


def test_host_stack_step_runs_every_layer_once_backward():
    from transformer_engine_compile.benchmarks import host as bench_host
    layers = [torch.nn.Linear(8, 8, bias=False) for _ in range(bench_host.STACK)]
    x = torch.randn(4, 8, requires_grad=True)
    dy = torch.randn(4, 8)
    bench_host._stack_step(layers, x, dy)
    y = x.detach().requires_grad_()
    ref = y
    for layer in layers:
        ref = torch.nn.functional.linear(ref, layer.weight.detach())
    ref.backward(dy)
    torch.testing.assert_close(x.grad, y.grad)  # dy went back through all 8 layers
    assert all(layer.weight.grad is not None for layer in layers)


def test_host_benchmark_times_the_real_ops():
    import transformer_engine_compile as te
    from transformer_engine_compile.benchmarks import host as bench_host
    out = bench_host.measure(["bf16", "fp8_current"], "cpu", n=1, size=128, tokens=128,
                             rounds=2, log=lambda *_: None)
    assert [r["recipe"] for r in out["rows"]] == ["bf16", "fp8_current"]
    assert {"torch.mm", "torch.empty", "nn.Linear fwd+bwd"} <= set(out["baselines"])
    assert all(r["fwd_us"] > 0 and r["bwd_us"] > 0 and r["eager_us"] > 0
               and r["eager_1thread_us"] > 0 and r["eager_stack_us"] > 0
               for r in out["rows"])
    assert "nn.Linear fwd+bwd stack" in out["baselines"]
    # every figure is the median of its rounds
    assert all(len(r["rounds"][k]) == 2 and r[k + "_us"] == statistics.median(r["rounds"][k])
               for r in out["rows"] for k in ("fwd", "bwd", "eager", "eager_stack"))
    assert out["rows"][1]["vs_fp8_current"] == 1.0
    assert torch.autograd.is_multithreading_enabled()  # the 1-thread rows restore it
    # the timed closures call the layer's ops: the forward op returns the layer's output
    rec = bench_host.host_recipe("fp8_current")
    layer = te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    with te.autocast(recipe=rec):
        expected = layer(x)
    from transformer_engine_compile.module.linear.ops import LINEAR_OPS
    with te.autocast(recipe=rec):
        flat = LINEAR_OPS.fwd_plan.encode(layer._make_args(x, None, False, False))
    with torch.no_grad():
        assert torch.equal(LINEAR_OPS.fwd_op(*flat)[0], expected)


def test_host_benchmark_times_layers_quantizing_their_own_input(monkeypatch):
    """The eager rows call one layer on the same input again and again:
    input sharing is off while timing (each call quantizes its input), and
    back on after."""
    from transformer_engine_compile.benchmarks import host as bench_host
    from transformer_engine_compile.dynamo import shared_inputs
    offered = []
    real = shared_inputs.record
    monkeypatch.setattr(shared_inputs, "record",
                        lambda x, q, xq, tag=None: (offered.append(shared_inputs.EAGER),
                                                    real(x, q, xq, tag))[1])
    bench_host.measure(["fp8_current"], "cpu", n=1, size=128, tokens=128, rounds=1,
                       log=lambda *_: None)
    assert offered and not any(offered)
    assert shared_inputs.EAGER


def test_layer_benchmark_quantizes_the_input_at_every_step(monkeypatch):
    """The single-layer configs feed the same input at every step: eager
    input sharing is off while they run, and back on after."""
    from transformer_engine_compile.dynamo import shared_inputs
    offered = []
    real = shared_inputs.record
    monkeypatch.setattr(shared_inputs, "record",
                        lambda x, q, xq, tag=None: (offered.append(shared_inputs.EAGER),
                                                    real(x, q, xq, tag))[1])
    assert bench.main(["--device", "cpu", "--configs", "tiny", "--recipes", "fp8_current",
                       "--modes", "eager", "--iters", "1"]) == 0
    assert offered and not any(offered)
    assert shared_inputs.EAGER


def test_bench_error_text_names_the_layers_error_under_compile():
    """A candidate failing inside torch.compile is reported with the layer's
    own error (Dynamo raises "Observed exception" with it as the cause),
    whole and on one line."""
    import transformer_engine_compile as te
    from transformer_engine_compile.benchmarks.llama import error_text

    layer = te.Linear(100, 64)

    def step(x):
        with te.autocast(recipe=te.recipe.Float8BlockScaling()):
            return layer(x)

    try:
        torch.compile(step, fullgraph=True, backend="aot_eager")(torch.randn(8, 100))
    except Exception as e:  # noqa: BLE001 - the point is what the report says
        text = error_text(e)
    else:
        raise AssertionError("a 100-column input fits no 1x128 block: expected an error")
    assert "te.Linear(100 -> 64): the input as a 8 x 100 matrix does not fit the recipe" in text
    assert "needs the columns divisible by 128" in text and "\n" not in text
    assert error_text(ValueError("plain\nmessage")) == "ValueError: plain message"


def test_bench_error_text_keeps_dynamos_debug_context_where_the_cause_lacks_it():
    """torch 2.11's Dynamo names the observed exception's class only in the
    cause ("ExceptionVariable(<class 'ValueError'>)") and its message only in
    the wrapper's "Developer debug context" line: that line is kept, and only
    where the cause does not already say it (torch 2.13: both say it)."""
    from transformer_engine_compile.benchmarks.llama import error_text

    def chained(context, cause_text):
        wrapper = RuntimeError(f"Observed exception\n  Explanation: no handler.\n\n"
                               f"  Developer debug context: {context}\n\n from user code:\n  x")
        wrapper.__cause__ = RuntimeError(cause_text)
        return wrapper

    old = error_text(chained("raised exception ValueError([ConstantVariable(str: 'no fit: "
                             "needs the columns divisible by 128')])",
                             "raised exception ExceptionVariable(<class 'ValueError'>)"))
    assert old == ("RuntimeError: Observed exception (raised exception ValueError("
                   "[ConstantVariable(str: 'no fit: needs the columns divisible by 128')]))"
                   " <- caused by RuntimeError: raised exception "
                   "ExceptionVariable(<class 'ValueError'>)")
    same = "raised exception ValueError('no fit')"
    assert error_text(chained(same, same)) == (
        "RuntimeError: Observed exception <- caused by RuntimeError: " + same)


def test_llama_fused_model_computes_the_unfused_model():
    """The packed-projection Llama from te.LayerNormLinear + te.LayerNormMLP
    and from separate norms + te.Linear, given the same weights, compute the
    same function (up to the norms' roundings: the bench's RMSNorm rounds
    twice, the fused norm once)."""
    from transformer_engine_compile.benchmarks import llama as bl
    cfg = bl.TINY_LLAMA["llama-tiny"]
    fused, unfused = bl.build(cfg, "te-fused", "cpu"), bl.build(cfg, "te-unfused", "cpu")
    names = {"qkv.layer_norm_weight": "attn_norm.weight", "mlp.layer_norm_weight":
             "mlp_norm.weight", "mlp.fc1_weight": "fc1.weight", "mlp.fc2_weight": "fc2.weight"}
    src = unfused.state_dict()
    state = {}
    for k in fused.state_dict():
        if k.endswith("_extra_state"):  # FP8 state: empty before any run
            state[k] = fused.state_dict()[k]
            continue
        prefix, _, rest = k.partition(".")
        if prefix == "blocks":
            i, _, rest = rest.partition(".")
            state[k] = src[f"blocks.{i}.{names.get(rest, rest)}"]
        else:
            state[k] = src[k]
    fused.load_state_dict(state)
    x, target = bl.inputs(cfg, torch.device("cpu"))
    a, b = fused(x).float(), unfused(x).float()
    assert ((a - b).norm() / b.norm()).item() < 0.01  # 0.002 measured; swapped halves: 0.06
    losses = [bl.make_step(fused, None, "eager", lr=1e-2)(x, target) for _ in range(3)]
    assert losses[2] < losses[0]


def test_llama_split_model_is_the_unfused_model():
    """The packed model with q/k/v and gate/up as parameters of their own
    (``parameters_split``), loaded from the unfused model's packed weights,
    trains bit for bit as the unfused model (fp8_current, eager)."""
    from transformer_engine_compile.benchmarks import llama as bl
    from transformer_engine_compile import recipe
    cfg = bl.TINY_LLAMA["llama-tiny"]
    split, unfused = bl.build(cfg, "te-split", "cpu"), bl.build(cfg, "te-unfused", "cpu")
    assert "blocks.0.qkv.key_weight" in split.state_dict()
    assert "blocks.0.fc1.up_weight" in split.state_dict()
    for a, b in zip(split.blocks, unfused.blocks):
        for name in ("qkv", "fc1"):
            getattr(a, name).load_full_weight_(getattr(b, name).weight.detach())
        a.load_state_dict({k: v for k, v in b.state_dict().items()
                           if not k.startswith(("qkv.", "fc1."))}, strict=False)
    x, target = bl.inputs(cfg, torch.device("cpu"))
    rec = recipe.by_name("fp8_current")
    losses = [[bl.make_step(m, rec, "eager", lr=1e-2)(x, target) for _ in range(3)]
              for m in (split, unfused)]
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0]


def test_bench_bias_flag_builds_layers_with_a_bias(tmp_path):
    out = tmp_path / "rows.json"
    rc = bench.main(["--device", "cpu", "--configs", "tiny", "--recipes", "fp8_current",
                     "--modes", "default", "--iters", "1", "--no-torchao", "--bias",
                     "--json", str(out)])
    assert rc == 0 and all("error" not in r for r in json.loads(out.read_text())["rows"])
    for factory in (bench._torch_model, bench._te_model):
        assert all(layer.bias is not None for layer in factory(64, 64, 2, "cpu", bias=True)
                   .modules() if hasattr(layer, "weight"))
        assert all(layer.bias is None for layer in factory(64, 64, 2, "cpu")
                   .modules() if hasattr(layer, "weight"))


def test_llama_interleaved_rounds_take_turns(monkeypatch):
    """--rounds: every candidate is built first, then the rounds time each in
    turn (the calls of one candidate are spread over the whole run)."""
    from transformer_engine_compile.benchmarks import llama as bl
    calls, made = [], []
    make_step = bl.make_step

    def recording(model, rec, mode, **kw):
        step = make_step(model, rec, mode, **kw)
        made.append(mode)
        name = f"{type(rec).__name__}/{mode}"

        def wrapped(x, target, timings=None):
            calls.append(name)
            return step(x, target, timings)
        return wrapped

    monkeypatch.setattr(bl, "make_step", recording)
    from transformer_engine_compile import recipe
    rows = bl.run(bl.TINY_LLAMA, {"fp8_current": recipe.Float8CurrentScaling()},
                  ["eager", "default"], torch.device("cpu"), with_torchao=False,
                  only=["torch bf16", "te fp8_current"], steps=1, log=lambda *a: None,
                  rounds=2)
    assert [(r["candidate"], r["mode"], r["rounds"]) for r in rows] == [
        (c, m, 2) for c in ("torch bf16", "te fp8_current") for m in ("eager", "default")]
    for r in rows:
        assert "error" not in r and 0 < r["host_ms"] <= r["ms"] and r["loss"] == r["loss"]
    names = ["NoneType/eager", "NoneType/default", "Float8CurrentScaling/eager",
             "Float8CurrentScaling/default"]
    first, rest = calls[:4], calls[4:]
    assert first == names  # built and compiled (one step each) before any timing
    one_round = [n for n in names for _ in range(3)]  # 2 warm-up + 1 timed step each
    assert rest[:24] == one_round * 2
    assert rest[24:] == names  # the final loss read


def test_layer_interleaved_rounds_take_turns(monkeypatch):
    """--rounds on single-layer configs: every (candidate, mode) of a config
    is built and warmed up first, then each round times each in turn, and
    ``ms`` is the median of the rounds' figures."""
    calls = []
    make_step = bench._make_step

    def recording(model, rec, mode):
        step = make_step(model, rec, mode)
        name = f"{type(rec).__name__}/{mode}"

        def wrapped(x, dy):
            calls.append(name)
            return step(x, dy)
        return wrapped

    figures = iter(range(100))  # the n-th timing returns n
    timed = []

    def fake_time(step, x, dy, device, iters, repeats):
        assert repeats == 1
        step(x, dy)
        timed.append(calls[-1])
        return float(next(figures))

    monkeypatch.setattr(bench, "_make_step", recording)
    monkeypatch.setattr(bench, "_time", fake_time)
    rows = bench.run(bench.TINY, ["fp8_current"], ["eager", "default"], torch.device("cpu"),
                     iters=1, log=lambda *a: None, rounds=3, with_torchao=False)
    labels = [(r["candidate"], r["mode"]) for r in rows]
    assert labels[:2] == [("torch bf16", "eager"), ("torch bf16", "default")]
    assert all("error" not in r and r["rounds"] == 3 for r in rows)
    names = [f"{rec}/{mode}" for rec in ("NoneType", "NoneType", "Float8CurrentScaling")
             for mode in ("eager", "default")]
    # built and warmed up (3 steps; the peak memory's step runs on CUDA only) before any timing
    assert calls[:3 * len(names)] == [n for n in names for _ in range(3)]
    assert timed == names * 3  # the rounds take turns
    # six candidates, three rounds: candidate i got i, i + 6 and i + 12
    assert [r["ms"] for r in rows] == [i + 6 for i in range(6)]


def test_bench_rounds_flag_reaches_the_layer_configs(tmp_path):
    out = tmp_path / "rows.json"
    rc = bench.main(["--device", "cpu", "--configs", "tiny", "--recipes", "fp8_current",
                     "--modes", "eager", "default", "--iters", "1", "--no-torchao",
                     "--rounds", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and {r["rounds"] for r in rows} == {2} and all(r["ms"] > 0 for r in rows)
