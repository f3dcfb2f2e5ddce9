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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=R.RECIPE_NAMES, default="fp8_current")
    p.add_argument("--mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    rec = R.by_name(a.recipe)
    print(f"te.Linear x{a.layers} (hidden {a.hidden}, {a.tokens} tokens), recipe "
          f"{type(rec).__name__ if rec else 'none (bf16)'}, device {device}, torch "
          f"{torch.__version__}, backend {a.backend}, mode {a.mode}")
    data = make_data(a.tokens, a.hidden, device, a.steps)
    eager_model = build_model(a.layers, a.hidden, device)
    compiled_model = copy.deepcopy(eager_model)

    eager_losses, eager_times = train(eager_model, data, rec, lambda f: f, "eager")
    torch._dynamo.reset()
    counters.clear()
    mode = None if a.mode == "default" else a.mode
    compile_fn = lambda f: torch.compile(f, fullgraph=True, backend=a.backend, mode=mode)  # noqa: E731
    if a.backend != "inductor":
        compile_fn = lambda f: torch.compile(f, fullgraph=True, backend=a.backend)  # noqa: E731
    comp_losses, comp_times = train(compiled_model, data, rec, compile_fn, "compiled")

    print(f"{'step':>5} {'eager loss':>12} {'compiled loss':>14}")
    for i in sorted({0, len(data) // 2, len(data) - 1}):
        print(f"{i:>5} {eager_losses[i]:>12.6f} {comp_losses[i]:>14.6f}")
    diff = max(abs(a_ - b_) for a_, b_ in zip(eager_losses, comp_losses))
    print(f"max |eager - compiled| loss: {diff:.3g}")
    breaks = sum(counters["graph_break"].values())
    fallbacks = te.fallback_report(compiled_model) or "none"
    print(f"graphs: {counters['stats']['unique_graphs']}  graph breaks: {breaks}  "
          f"fallbacks: {fallbacks}")
    warm = slice(min(3, len(data) - 1), None)
    e_ms = 1e3 * sum(eager_times[warm]) / len(eager_times[warm])
    c_ms = 1e3 * sum(comp_times[warm]) / len(comp_times[warm])
    print(f"time per step: eager {e_ms:.2f} ms, compiled {c_ms:.2f} ms "
          f"(first compiled step incl. compile {comp_times[0]:.1f} s); "
          f"compiled/eager speed {e_ms / c_ms:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
