"""Host time per ``te.GroupedLinear`` op call, per recipe and expert count.

The ``te_compile::grouped_linear_fwd`` / ``grouped_linear_bwd`` ops are
called with their flat arguments, as a compiled graph's runtime calls them
(no grad mode), against ``torch._grouped_mm``'s own call, the bf16 GEMM
the baseline's step runs in their place (three per layer and step: fprop,
dgrad, wgrad).  The experts (``--experts``: Mixtral has 8, Qwen3-MoE 128,
DeepSeek-V3 256) have 256 x 256 weights and 16 rows each, so the GPU
never bounds the calls: N back-to-back calls, one synchronize, the wall
time over N, medians over rounds that take turns (``benchmarks.host``
says why).

    python -m transformer_engine_compile.benchmarks.grouped_host [--experts 8 128] \\
        [--recipes bf16 fp8_current_e4m3 fp8_block] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from .host import _busy_gpu, _per_call_us, flat_op_calls

RECIPES = ("bf16", "fp8_current_e4m3", "fp8_delayed_e4m3", "fp8_block")
SIZE = 256   # in and out features: whole 128-blocks, any recipe takes them
ROWS = 16    # rows per expert


def _op_calls(experts: int, recipe_name: str, device) -> tuple:
    """Closures calling the forward and backward ops of one grouped layer
    with flat arguments, as a compiled step's runtime does."""
    from ..autocast import autocast
    from ..module.grouped.layer import GroupedLinear, forward_args, quantizer_fields
    from ..module.grouped.ops import GROUPED_LINEAR_OPS as ops
    from ..module.grouped.state import bind_delayed_state
    from .moe import recipe

    rec = None if recipe_name == "bf16" else recipe(recipe_name)
    torch.manual_seed(0)
    layer = GroupedLinear(experts, SIZE, SIZE, bias=False, params_dtype=torch.bfloat16,
                          device=device)
    x = torch.randn(experts * ROWS, SIZE, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    counts = torch.full((experts,), ROWS, dtype=torch.int32, device=device)
    with autocast(enabled=rec is not None, recipe=rec):
        state, = bind_delayed_state(layer, layer._gemms(), layer.weight.device)
        args = forward_args(x, layer.weight, None, counts, None,
                            quantizer_fields(rec, state, x))
    return flat_op_calls(ops, args, {"grad_output": dy})


def measure(experts=(8, 128), recipes=RECIPES, device="cuda", n=100, rounds=3,
            log=print) -> list:
    """Rows ``{"experts", "candidate", "us"}``: ``torch._grouped_mm`` per
    call, and per recipe the forward and backward op per call (a recipe
    whose ops cannot be built here is logged, not timed)."""
    device = torch.device(device)
    calls = {}
    for e in experts:
        x = torch.randn(e * ROWS, SIZE, device=device, dtype=torch.bfloat16)
        w = torch.randn(e, SIZE, SIZE, device=device, dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * ROWS
        calls[(e, "torch._grouped_mm")] = (
            lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
        for name in recipes:
            try:
                fwd, bwd = _op_calls(e, name, device)
            except Exception as err:  # one failing recipe must not hide the others
                log(f"{e:>4} experts {name:>18}: ERROR {type(err).__name__}: {err}")
                continue
            calls[(e, f"te {name} fwd op")], calls[(e, f"te {name} bwd op")] = fwd, bwd
    samples = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            _busy_gpu(device, 0.05)
            samples[key].append(_per_call_us(fn, device, n))
    rows = []
    for (e, label), s in samples.items():
        rows.append({"experts": e, "candidate": label, "us": statistics.median(s)})
        log(f"{e:>4} experts {label:>30} {rows[-1]['us']:9.1f} us")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100, help="back-to-back calls per figure")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else
             ": a smoke run, its numbers mean nothing"))
    n = args.calls if device == "cuda" else 1
    rows = measure(args.experts, args.recipes, device, n, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
