"""The first compiled training step, as a user's fresh process pays it.

    python -m transformer_engine_compile.benchmarks.first_step --configs hf-llama-b \\
        --recipes fp8_current --rounds 2

Each candidate's first step (``benchmarks.llama``'s step in default mode:
the whole forward and loss compiled, backward, fused AdamW, loss read)
runs in a process of its own with empty inductor and Triton caches
(``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` in a fresh temporary
folder), so no candidate reuses another's graphs, kernels or one-time
imports.  The candidates take turns for ``--rounds`` rounds (a host's
speed drifts over minutes).  Printed per candidate: the median first step,
its ratio to the bf16 model's, and torch's compile phases summed over the
step (``torch._dynamo.utils.compile_times``): Dynamo's bytecode tracing,
AOTAutograd with inductor, and inductor's waits for its kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# this module's import name, also when run with ``python -m`` (as ``__main__``)
_MODULE = __spec__.name if __spec__ is not None else __name__

# the phases printed (torch's compile_times names) and their column labels
PHASES = (("bytecode_tracing", "Dynamo trace s"),
          ("OutputGraph.call_user_compiler", "AOT + inductor s"),
          ("async_compile.wait", "kernel compile wait s"))


def child(config: str, recipe: str, device: str, backend: str) -> dict:
    """One candidate's first step in this process: its time and the compile
    phases (seconds, summed over the step's compiles)."""
    import torch

    from . import llama
    from .compare import RECIPES

    dev = torch.device(device)
    cfg = llama.ALL_LLAMA[config]
    torch.manual_seed(0)
    rec = None if recipe == "bf16" else RECIPES[recipe]
    model = llama.build(cfg, "torch" if recipe == "bf16" else "te", dev)
    x, target = llama.inputs(cfg, dev, seed=1)
    step = llama.make_step(model, rec, "default", backend=backend)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    loss = step(x, target)
    sync()
    first = time.perf_counter() - t0
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    phases = {n: float(v) for n, v in zip(names, values)}
    return {"first_step_s": first, "loss": loss, "phases": phases}


def measure(config: str, recipe: str, device: str, backend: str) -> dict:
    """:func:`child` in a fresh process with empty compile caches."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(d, "triton"))
        code = (f"import json; from {_MODULE} import child; "
                f"print('ROW ' + json.dumps(child({config!r}, {recipe!r}, {device!r}, "
                f"{backend!r})))")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    rows = [line[4:] for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if p.returncode != 0 or not rows:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(rows[-1])


def run(configs, recipes, device, backend="inductor", rounds=2, log=print) -> list:
    """Rows per (config, candidate): every round's measurement, the median
    first step and phases, the ratio to the bf16 model's median."""
    names = ["bf16", *[r for r in recipes if r != "bf16"]]
    rows = [{"config": c, "recipe": r, "runs": []} for c in configs for r in names]
    for _ in range(rounds):
        for row in rows:
            row["runs"].append(measure(row["config"], row["recipe"], device, backend))
    for row in rows:
        ok = [r for r in row["runs"] if "error" not in r]
        if not ok:
            row["error"] = row["runs"][0]["error"]
            continue
        row["first_step_s"] = statistics.median(r["first_step_s"] for r in ok)
        row["phases"] = {p: statistics.median(r["phases"].get(p, 0.0) for r in ok)
                         for p, _ in PHASES}
    log(format_table(rows))
    return rows


def format_table(rows) -> str:
    head = ("| config | candidate | first step s (median) | x bf16 | "
            + " | ".join(label for _, label in PHASES) + " |")
    out = [head, "|---|---|" + "---:|" * (2 + len(PHASES))]
    base = {r["config"]: r.get("first_step_s") for r in rows if r["recipe"] == "bf16"}
    for r in rows:
        label = "torch bf16" if r["recipe"] == "bf16" else f"te {r['recipe']}"
        if "error" in r:
            out.append(f"| {r['config']} | {label} | ERROR: {r['error'][:150]} |")
            continue
        ratio = r["first_step_s"] / base[r["config"]] if base.get(r["config"]) else float("nan")
        out.append(f"| {r['config']} | {label} | {r['first_step_s']:.2f} | {ratio:.2f} | "
                   + " | ".join(f"{r['phases'][p]:.2f}" for p, _ in PHASES) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    from . import llama
    from .compare import RECIPES

    p = argparse.ArgumentParser(prog="python -m transformer_engine_compile.benchmarks.first_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["hf-llama-b"], choices=list(llama.ALL_LLAMA))
    p.add_argument("--recipes", nargs="+", default=["fp8_current"], choices=list(RECIPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = run(args.configs, args.recipes, args.device, args.backend, args.rounds)
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": args.device, "rows": rows}, f,
                      indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
