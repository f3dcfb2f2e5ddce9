"""Side-by-side benchmark: forward + backward of te.Linear per recipe and mode
against torch.nn.Linear in bf16 (and torchao's Float8Linear when installed),
in one process, on one GPU.

    python -m transformer_engine_compile.benchmarks                 # every config
    python -m transformer_engine_compile.benchmarks --configs launch --json out.json
    python -m transformer_engine_compile.benchmarks --configs stack --fp8-grad
    python -m transformer_engine_compile.benchmarks --configs llama-a llama-b   # whole steps
    python -m transformer_engine_compile.benchmarks --configs hf-llama-a   # Hugging Face's model
    python -m transformer_engine_compile.benchmarks --configs host   # host time per op call

Each row is one (config, candidate, mode).  ``x bf16`` is the time of bf16
``torch.nn.Linear`` compiled in default mode on the same config divided by
the row's time (higher is faster); ``x eager`` divides the candidate's own
eager time by the row's.  ``peak GiB`` is the peak of allocated memory during
one step (weights and inputs included).  Times are medians of repeated timed
loops measured with CUDA events; by default every step reads one output
element back (as a loop reading its loss does), so host time is not hidden
behind a full GPU queue (``--no-sync`` times back-to-back steps instead).

The ``llama-*`` configs time whole training steps of the Llama-style model
of ``benchmarks.llama``, the ``hf-*`` configs those of Hugging Face's
``LlamaForCausalLM`` converted (where ``transformers`` is installed; by
default only then); ``host`` runs ``benchmarks.host``'s per-call host times.
docs/benchmarks.md has results.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import warnings

import torch

from . import host, llama
from .. import recipe as R
from ..quantization import cuda_gemm

CONFIGS = {  # name: (tokens M, in K, out N, layers)
    "8192^3": (8192, 8192, 8192, 1),
    "16384x4096x14336": (16384, 4096, 14336, 1),
    "4096^3": (4096, 4096, 4096, 1),
    "4095x4096x4096": (4095, 4096, 4096, 1),  # a ragged token count against 4096^3
    "launch": (256, 1024, 1024, 4),
    "stack": (8192, 4096, 4096, 4),  # layers in a row: where fp8_grad applies
}
TINY = {"tiny": (64, 128, 128, 2)}  # CPU smoke run
RECIPES = {"fp8_delayed": R.DelayedScaling(),
           **{name: R.by_name(name) for name in ("fp8_current", "fp8_block", "mxfp8", "nvfp4")}}
ALL_CONFIGS = [*CONFIGS, *llama.LLAMA_CONFIGS, *llama.HF_CONFIGS, "host"]
CPU_CONFIGS = {**TINY, **llama.TINY_LLAMA, **llama.TINY_HF}
MODES = ("eager", "default", "reduce-overhead")


class _TeStack(torch.nn.Module):
    """te.Linear layers in a row; with ``fp8_grad`` every layer but the first
    (whose input is the graph input) hands its predecessor a quantized dgrad."""

    def __init__(self, k, n, layers, device, fp8_grad=False, bias=False):
        from ..module.linear.layer import Linear

        super().__init__()
        self.layers = torch.nn.ModuleList(
            Linear(k if i == 0 else n, n, bias=bias, params_dtype=torch.bfloat16, device=device)
            for i in range(layers))
        self.fp8_grad = fp8_grad

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, fp8_grad=self.fp8_grad and i > 0)
        return x


def _te_model(k, n, layers, device, bias=False):
    return _TeStack(k, n, layers, device, bias=bias)


def _te_fp8_grad_model(k, n, layers, device, bias=False):
    return _TeStack(k, n, layers, device, fp8_grad=True, bias=bias)


def _torch_model(k, n, layers, device, bias=False):
    return torch.nn.Sequential(*[torch.nn.Linear(k if i == 0 else n, n, bias=bias,
                                                 dtype=torch.bfloat16, device=device)
                                 for i in range(layers)])


def _torchao_model(k, n, layers, device, bias=False):
    from torchao.float8 import convert_to_float8_training
    return convert_to_float8_training(_torch_model(k, n, layers, device, bias))


def torchao_unavailable_reason():
    """None when ``torchao.float8`` imports, else the import error's text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8  # noqa: F401
        return None
    except Exception as e:  # missing, or built for another torch
        return llama.error_text(e)


def torchao_available() -> bool:
    return torchao_unavailable_reason() is None


FP8_GRAD_RECIPES = ("fp8_current", "fp8_block", "mxfp8")  # recipes that take fp8_grad


def candidates(recipes, with_torchao, fp8_grad=False):
    """(label, model factory, recipe, GEMM path label)."""
    out = [("torch bf16", _torch_model, None, "bf16"), ("te bf16", _te_model, None, "bf16")]
    for name in recipes:
        out.append((f"te {name}", _te_model, RECIPES[name], None))
        if fp8_grad and name in FP8_GRAD_RECIPES:
            out.append((f"te {name} fp8_grad", _te_fp8_grad_model, RECIPES[name], None))
    if with_torchao:
        out.append(("torchao fp8 tensorwise", _torchao_model, None, "fp8_tensorwise"))
    return out


def _gemm_label(model, rec, device) -> str:
    """Which GEMM path the layer's fprop takes (native or emulated), for the table."""
    if rec is None or device.type != "cuda":
        return "bf16" if rec is None else "reference"
    from ..quantization.factory import quantizer_for
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    one = torch.ones(1, device=device)

    def quantized(role):  # DelayedScaling's quantizers take the layer's scale
        q = quantizer_for(rec, role, internal=True)
        return q.quantize_with_scale(x, one) if rec.delayed() else q.quantize(x)

    return cuda_gemm.gemm_path(quantized("input"), quantized("weight"), torch.bfloat16)


def _make_step(model, rec, mode):
    from ..autocast import autocast

    def fwd(x):
        with autocast(enabled=rec is not None, recipe=rec):
            return model(x)

    f = fwd if mode == "eager" else torch.compile(
        fwd, fullgraph=True, mode=None if mode == "default" else mode)
    params = list(model.parameters())

    def step(x, dy):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        x.grad = None
        y = f(x)
        y.backward(dy)
        return y

    return step


def _synced(step):
    """The step, then one element of its output read back (a loop reading its loss)."""
    def synced(x, dy):
        step(x, dy).view(-1)[0].item()
    return synced


def _time(step, x, dy, device, iters, repeats):
    for _ in range(3):
        step(x, dy)
    if device.type != "cuda":
        import time
        t0 = time.perf_counter()
        for _ in range(iters):
            step(x, dy)
        return (time.perf_counter() - t0) / iters * 1e3
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            step(x, dy)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _cleanup():
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(configs, recipes, modes, device, iters=None, repeats=5, with_torchao=False, log=print,
        fp8_grad=False, sync=True, bias=False, rounds=1):
    """``bias``: every layer with a bias (te.Linear's default; the tables
    in docs/benchmarks.md are bias-free unless they say otherwise).
    ``rounds > 1``: per config, every (candidate, mode) is built and run
    first, then the rounds time each in turn (one repeat of ``iters``
    steps each) and ``ms`` is the median over the rounds, so a GPU or host
    that drifts over minutes skews no ratio (eager against default
    included); ``peak_gib`` is then each candidate's own, less what the
    candidates built before it hold.  Eager input sharing is off: every
    step feeds the same input, and each step's first layer quantizes it."""
    from ..dynamo import shared_inputs
    with shared_inputs.eager_sharing(False):
        return _run_layers(configs, recipes, modes, device, iters, repeats, with_torchao, log,
                           fp8_grad, sync, bias, rounds)


def _run_layers(configs, recipes, modes, device, iters, repeats, with_torchao, log, fp8_grad,
                sync, bias, rounds) -> list:
    rows = []
    if rounds > 1:
        llama.keep_compiled_entries()
    for cname, (m, k, n, layers) in configs.items():
        flops = 6 * m * k * n * layers  # fwd + dgrad + wgrad
        n_iter = iters or max(3, min(50, int(2e13 / flops)))
        live = []  # rounds > 1: (row, step, x, dy) of the candidates built so far
        for label, factory, rec, path in candidates(recipes, with_torchao, fp8_grad):
            for mode in modes:
                # rounds > 1: what the candidates built before this one hold
                base = (torch.cuda.memory_allocated(device)
                        if rounds > 1 and device.type == "cuda" else 0)
                row, step, x, dy = _candidate(cname, (m, k, n, layers), label, factory, rec,
                                              path, mode, device, bias, sync)
                try:
                    if rounds > 1:
                        for _ in range(3):  # compile and warm up before the rounds
                            step(x, dy)
                        row["rounds"] = rounds
                        row["peak_gib"] = llama.peak_gib(step, x, dy, device) - base / 2**30
                        live.append((row, step, x, dy))
                    else:
                        row["ms"] = _time(step, x, dy, device, n_iter, repeats)
                        row["peak_gib"] = llama.peak_gib(step, x, dy, device)
                        row["tflops"] = flops / row["ms"] / 1e9
                except Exception as e:  # one failing candidate must not hide the others
                    row["error"] = llama.error_text(e)
                rows.append(row)
                if rounds == 1 or "error" in row:
                    log(_format_row(row, rows))
                del step, x, dy  # (rounds > 1: held in live)
                if rounds == 1:  # a reset would also drop the built candidates' graphs
                    _cleanup()
        _time_in_rounds(live, rounds, device, n_iter, flops)
        for row, *_ in live:
            log(_format_row(row, rows))
        live.clear()
        _cleanup()
    return rows


def _candidate(cname, shape, label, factory, rec, path, mode, device, bias, sync) -> tuple:
    """``(row, step, x, dy)`` of one (candidate, mode); the model lives in
    the step's closure."""
    m, k, n, layers = shape
    torch.manual_seed(0)
    model = factory(k, n, layers, device, bias=bias)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
    row = {"config": cname, "candidate": label, "mode": mode,
           "gemm": path or _gemm_label(model, rec, device)}
    step = _make_step(model, rec, mode)
    return row, (_synced(step) if sync else step), x, dy


def _time_in_rounds(live, rounds, device, n_iter, flops) -> None:
    """Time each built candidate once per round, in turn; ``ms``: the median."""
    samples = {id(row): [] for row, *_ in live}
    for _ in range(rounds):
        for row, step, x, dy in live:
            if "error" in row:  # failed in an earlier round
                continue
            try:
                samples[id(row)].append(_time(step, x, dy, device, n_iter, 1))
            except Exception as e:
                row["error"] = llama.error_text(e)
    for row, *_ in live:
        if "error" not in row:
            row["ms"] = statistics.median(samples[id(row)])
            row["tflops"] = flops / row["ms"] / 1e9


def _ratio(rows, row, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and r["config"] == row["config"] \
                and "ms" in r and "ms" in row:
            return r["ms"] / row["ms"]
    return float("nan")


def _format_row(row, rows):
    if "error" in row:
        return f"{row['config']:>17} {row['candidate']:>23} {row['mode']:>15}  ERROR {row['error']}"
    vs_bf16 = _ratio(rows, row, candidate="torch bf16", mode="default")
    vs_eager = _ratio(rows, row, candidate=row["candidate"], mode="eager")
    return (f"{row['config']:>17} {row['candidate']:>23} {row['mode']:>15} {row['gemm']:>15} "
            f"{row['ms']:9.3f} {row['tflops']:8.1f} {vs_bf16:7.2f} {vs_eager:7.2f} "
            f"{row['peak_gib']:8.2f}")


HEADER = (f"{'config':>17} {'candidate':>23} {'mode':>15} {'gemm path':>15} "
          f"{'ms/step':>9} {'TFLOP/s':>8} {'x bf16':>7} {'x eager':>7} {'peak GiB':>8}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m transformer_engine_compile.benchmarks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=[*ALL_CONFIGS, *CPU_CONFIGS], default=None,
                   help="single-layer configs, llama-* (whole training steps of a Llama-style "
                        "model) and host (host time per op call); default: all of them on a "
                        "GPU, tiny on a CPU")
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None, help="timed steps per repeat")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--fp8-grad", action="store_true",
                   help="also run te.Linear stacks with fp8_grad=True (quantized dgrad)")
    p.add_argument("--no-sync", action="store_true",
                   help="single-layer configs: time back-to-back steps without reading an "
                        "output back each step (hides host time behind a full GPU queue)")
    p.add_argument("--candidates", nargs="+", default=None, metavar="LABEL",
                   help="llama configs: run only these candidates (e.g. 'torch bf16' "
                        "'te fp8_current')")
    p.add_argument("--steps", type=int, default=10, help="llama configs: timed steps")
    p.add_argument("--rounds", type=int, default=1,
                   help="build every candidate of a config first, then time them in this "
                        "many rounds that take turns (robust ratios on a drifting host or GPU); "
                        "host: always at least 3")
    p.add_argument("--fused", action="store_true",
                   help="llama configs: also the packed-projection model from te.LayerNormLinear "
                        "+ te.LayerNormMLP ('fused'), from separate norms + te.Linear "
                        "('unfused') and the same with q/k/v and gate/up as parameters of "
                        "their own ('split': parameters_split)")
    p.add_argument("--unshared", action="store_true",
                   help="llama configs: also each te recipe with eager input sharing off "
                        "('unshared': q/k/v and gate/up each quantize their input)")
    p.add_argument("--bias", action="store_true",
                   help="single-layer configs: layers with a bias (te.Linear's default)")
    p.add_argument("--autograd-threads", choices=("on", "off"), default="on",
                   help="off: torch.autograd.set_multithreading_enabled(False) for the whole "
                        "run, so backward functions run on the calling thread instead of the "
                        "autograd engine's device thread (eager te.Linear's Python backward "
                        "runs faster there; docs/linear.md, 'Eager speed')")
    p.add_argument("--profile", action="store_true",
                   help="llama configs: after the timing, one traced step per candidate: the "
                        "compute stream's busy and idle time and its kernels by class")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    with torch.autograd.set_multithreading_enabled(args.autograd_threads == "on"):
        return _main(args)


def _main(args) -> int:
    device = torch.device(args.device)
    names = args.configs or (
        [c for c in ALL_CONFIGS if c not in llama.HF_CONFIGS or llama.hf_available()]
        if device.type == "cuda" else ["tiny"])
    modes = [m for m in args.modes if device.type == "cuda" or m != "reduce-overhead"]
    with_torchao = False if args.no_torchao else (device.type == "cuda" and torchao_available())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"torch {torch.__version__}, device {gpu or 'cpu'}")
    if device.type != "cuda":
        print("(on a CPU the times say little about a GPU: this is a smoke run)")
    if args.autograd_threads == "off":
        print("autograd engine threads off: backward runs on the calling thread")
    result = {"torch": torch.__version__, "device": str(device), "gpu": gpu,
              "autograd_threads": args.autograd_threads}
    if device.type == "cuda":  # eager fp8_current runs natively once built (kernels/native.py)
        from ..kernels import native
        ext = native.extension(wait=True)
        result["native_eager"] = ext is not None
        print("native eager path: " + ("built" if ext is not None else
                                      f"not used ({native._state['failed'] or 'disabled'})"))
    layer_cfgs = {c: {**CONFIGS, **TINY}[c] for c in names if c in CONFIGS or c in TINY}
    llama_cfgs = {c: llama.ALL_LLAMA[c] for c in names if c in llama.ALL_LLAMA}
    rows, llama_rows, ok = [], [], True
    if layer_cfgs:
        print(HEADER)
        rows = run(layer_cfgs, args.recipes, modes, device, iters=args.iters,
                   with_torchao=with_torchao, fp8_grad=args.fp8_grad, sync=not args.no_sync,
                   bias=args.bias, rounds=args.rounds)
        print("\n" + HEADER)  # the whole table again, ratios now complete
        for row in rows:
            print(_format_row(row, rows))
        result["rows"] = rows
    if llama_cfgs:
        print("\n" + llama.HEADER)
        llama_rows = llama.run(llama_cfgs, {r: RECIPES[r] for r in args.recipes}, modes,
                                     device, with_torchao, only=args.candidates,
                                     steps=args.steps, fused=args.fused, rounds=args.rounds,
                                     unshared=args.unshared, profile=args.profile)
        print("\n" + llama.HEADER)
        for row in llama_rows:
            print(llama.format_row(row, llama_rows))
        result["llama"] = llama_rows
    if "host" in names:
        print("\nhost time per call (us), 256 x 256 weight, 256 tokens")
        result["host"] = host.measure(
            [r for r in host.HOST_RECIPES if r == "bf16" or r in args.recipes], device,
            n=args.iters or 200, rounds=max(3, args.rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = all("error" not in r for r in rows + llama_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
