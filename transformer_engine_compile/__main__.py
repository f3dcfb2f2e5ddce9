"""Training demo: ``python -m transformer_engine_compile [--recipe ...] [--mode ...]``.

Trains a small stack of ``te.Linear`` layers on synthetic regression data,
once eagerly and once under ``torch.compile(fullgraph=True)`` from the same
initial weights, and prints the losses side by side, the graph and
graph-break counts, the layers that fell back to eager, and time per step.
The format tour lives in ``python -m transformer_engine_compile.tour``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R



def build_model(layers: int, hidden: int, device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [te.Linear(hidden, hidden, params_dtype=torch.bfloat16, device=device),
                   torch.nn.GELU()]
    return torch.nn.Sequential(*blocks[:-1])


def make_data(tokens: int, hidden: int, device, steps: int):
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    batches = [torch.randn(tokens, hidden, generator=g) for _ in range(4)]
    xs = [batches[i % len(batches)] for i in range(steps)]  # a few batches, cycled
    return [(x.to(device, torch.bfloat16), torch.tanh(x @ teacher).to(device, torch.bfloat16))
            for x in xs]


def progress(label: str, i: int, n: int, loss: float, width: int = 24) -> None:
    done = int(width * (i + 1) / n)
    sys.stdout.write(f"\r{label:>9} [{'#' * done}{'.' * (width - done)}] "
                     f"{i + 1:>3}/{n} loss {loss:.5f}")
    if i + 1 == n:
        sys.stdout.write("\n")
    sys.stdout.flush()


def train(model, data, rec, step_fn_wrapper, label, lr=0.02):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def forward_loss(x, y):
        with te.autocast(enabled=rec is not None, recipe=rec):
            out = model(x)
        return (out.float() - y.float()).pow(2).sum(-1).mean()  # squared error per token

    forward_loss = step_fn_wrapper(forward_loss)
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.manual_seed(i)  # NVFP4 stochastic rounding: same draws in both runs
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # syncs
        times.append(time.perf_counter() - t0)
        progress(label, i, len(data), losses[-1])
    return losses, times


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m transformer_engine_compile",
                                description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--recipe", choices=R.RECIPE_NAMES, default="fp8_current",
                   help="quantization recipe (bf16: none); default %(default)s")
    p.add_argument("--mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode (inductor only); default %(default)s")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="torch.compile backend; aot_eager runs the same kernels as eager, "
                        "so the losses match bit for bit; default %(default)s")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where to train; default %(default)s")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps per run (eager, then compiled); default %(default)s")
    p.add_argument("--layers", type=int, default=3,
                   help="te.Linear layers (GELU between them); default %(default)s")
    p.add_argument("--hidden", type=int, default=256,
                   help="features of each layer; default %(default)s")
    p.add_argument("--tokens", type=int, default=256,
                   help="tokens (rows) per batch; default %(default)s")
    return p


def _same_layer_output(model, x, rec, compile_fn) -> bool:
    """The first te.Linear on one batch, eager and compiled: bit for bit."""
    layer = model[0]
    with te.autocast(enabled=rec is not None, recipe=rec):
        want = layer(x)
        got = compile_fn(lambda t: layer(t))(x)
    return torch.equal(want, got)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda, but this torch ({torch.__version__}) sees no CUDA "
              f"device", file=sys.stderr)
        return 2
    for flag in ("steps", "layers", "hidden", "tokens"):
        if getattr(a, flag) < (0 if flag == "steps" else 1):
            print(f"error: --{flag} must be {'>= 0' if flag == 'steps' else '>= 1'}",
                  file=sys.stderr)
            return 2
    device = torch.device(a.device)
    rec = R.by_name(a.recipe)
    print(f"te.Linear x{a.layers} (hidden {a.hidden}, {a.tokens} tokens), recipe "
          f"{type(rec).__name__ if rec else 'none (bf16)'}, device {device}, torch "
          f"{torch.__version__}, backend {a.backend}, mode {a.mode}")
    if a.steps == 0:
        print("--steps 0: nothing to train")
        return 0
    data = make_data(a.tokens, a.hidden, device, a.steps)
    eager_model = build_model(a.layers, a.hidden, device)
    compiled_model = copy.deepcopy(eager_model)

    eager_losses, eager_times = train(eager_model, data, rec, lambda f: f, "eager")
    torch._dynamo.reset()
    counters.clear()
    mode = None if a.mode == "default" or a.backend != "inductor" else a.mode

    def compile_fn(f):
        return torch.compile(f, fullgraph=True, backend=a.backend, mode=mode)
    print(f"compiling with {a.backend} (the first compiled step includes it) ...", flush=True)
    comp_losses, comp_times = train(compiled_model, data, rec, compile_fn, "compiled")

    print(f"{'step':>5} {'eager loss':>12} {'compiled loss':>14}")
    for i in sorted({0, len(data) // 2, len(data) - 1}):
        print(f"{i:>5} {eager_losses[i]:>12.6f} {comp_losses[i]:>14.6f}")
    diff = max(abs(a_ - b_) for a_, b_ in zip(eager_losses, comp_losses))
    print(f"max |eager - compiled| loss over the steps: {diff:.3g}", end="")
    print(" (bit for bit)" if diff == 0 else
          f" ({a.backend} compiles the loss and the GELUs around the te ops differently "
          f"from eager, so whole steps may differ in the last bits; --backend aot_eager "
          f"runs eager's kernels)")
    breaks = sum(counters["graph_break"].values())
    fallbacks = te.fallback_report(compiled_model) or "none"
    print(f"graphs: {counters['stats']['unique_graphs']}  graph breaks: {breaks}  "
          f"fallbacks: {fallbacks}")
    torch._dynamo.reset()
    same = _same_layer_output(build_model(a.layers, a.hidden, device), data[0][0], rec,
                              compile_fn)
    print(f"te.Linear output on one batch, eager vs compiled ({a.backend}): "
          f"{'bit for bit equal' if same else 'DIFFERENT'}")
    print(f"first compiled step (compiles): {comp_times[0]:.1f} s")
    if len(data) < 2:
        print("time per step: needs --steps 2 or more (the first step of each run warms up)")
    else:
        e_ms = 1e3 * statistics.median(eager_times[1:])
        c_ms = 1e3 * statistics.median(comp_times[1:])
        print(f"time per step (median of steps 2..{len(data)}): eager {e_ms:.2f} ms, compiled "
              f"{c_ms:.2f} ms; compiled/eager speed {e_ms / c_ms:.2f}x")
        if device.type == "cpu":
            print("(on a CPU these times mean little: the formats are emulated in plain torch; "
                  "see docs/benchmarks.md for GPU figures)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
