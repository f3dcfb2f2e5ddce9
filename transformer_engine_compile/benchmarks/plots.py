"""Turn the benchmark result files in docs/results into the figures of
docs/benchmarks.md.

    python -m transformer_engine_compile.benchmarks.plots \\
        [--results docs/results] [--out docs/images]

Reads the JSON files that ``python -m transformer_engine_compile.benchmarks
--json FILE`` writes (:data:`SOURCES`) and draws two PNGs with matplotlib
(``pip install -e '.[plots]'``):

* ``speedup_by_recipe.png``: per model config, the speed-up of every
  candidate and mode over torch bf16 compiled (default mode);
* ``fp8_speedup_by_size.png``: FP8 current scaling and torchao against
  bf16 compiled as the model or layer grows.

A ratio is only ever taken inside one result file (candidates timed side by
side in one process), never between files.  Where several files hold the
same (config, candidate, mode), the later one in :data:`SOURCES` wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Result files behind the figures, oldest first (a later file's rows replace
# an earlier file's rows of the same config, candidate and mode).
SOURCES = (
    "bench_layers_rounds_h200_2026-11-24u.json",  # 8192^3; fp8_delayed, fp8_block layers
    "bench_hf_llama_a_h200_2026-11-24t.json",  # hf-llama-a eager and te bf16
    "bench_first_step_llama_a_hf_h200_2026-11-25.json",  # hf-llama-a fp8_current compiled
    "bench_layers_h200_2026-11-25_42.json",  # 4096^3, 16384x4096x14336
    "bench_llama_a_nvfp4_h200_2026-11-25_42.json",
    "bench_llama_b_h200_2026-11-25_42.json",
    "bench_llama_a_h200_2026-11-25_42.json",
    "bench_llama_a_h200_2026-11-25_43.json",
)

MODEL_CONFIGS = ("llama-a", "hf-llama-a", "llama-b")  # figure 1, one panel each
HIDDEN = {"llama-a": 2048, "llama-b": 4096}  # figure 2, left
LAYER_CONFIGS = {  # figure 2, right: GFLOP per forward + backward step (6 M K N)
    "4096^3": 6 * 4096 ** 3 / 1e9,
    "8192^3": 6 * 8192 ** 3 / 1e9,
    "16384x4096x14336": 6 * 16384 * 4096 * 14336 / 1e9,
}
MODES = ("eager", "default", "reduce-overhead")
LINE_COLORS = {("te fp8_current", "default"): "tab:blue", ("te fp8_current", "eager"): "tab:orange",
               ("torchao fp8 tensorwise", "default"): "tab:green"}
BASELINE = ("torch bf16", "default")


def _file_rows(path: str) -> list:
    """The timed rows of one result file: single layers ("rows") and whole
    steps ("llama"), with the ratios to that file's own torch bf16."""
    with open(path) as f:
        data = json.load(f)
    raw = [r for r in data.get("rows", []) + data.get("llama", []) if "ms" in r]
    base = {(r["config"], r["mode"]): r["ms"] for r in raw if r["candidate"] == BASELINE[0]}
    out = []
    for r in raw:
        compiled = base.get((r["config"], BASELINE[1]))
        eager = base.get((r["config"], "eager"))
        out.append({
            "config": r["config"], "candidate": r["candidate"], "mode": r["mode"],
            "ms": r["ms"],
            "x_bf16": compiled / r["ms"] if compiled else None,  # over torch bf16 compiled
            "x_bf16_eager": eager / r["ms"] if eager else None,  # over torch bf16 eager
            "source": os.path.basename(path), "torch": data.get("torch"), "gpu": data.get("gpu"),
        })
    return out


def load_rows(results_dir: str = "docs/results") -> list:
    """One row per (config, candidate, mode) from :data:`SOURCES`, the latest
    file's; each a dict with ``config``, ``candidate``, ``mode``, ``ms``,
    ``x_bf16`` (torch bf16 compiled in default mode over ``ms``, same file),
    ``x_bf16_eager`` and ``source``."""
    latest = {}
    for name in SOURCES:
        for row in _file_rows(os.path.join(results_dir, name)):
            latest[(row["config"], row["candidate"], row["mode"])] = row
    return list(latest.values())


def _x(rows, config, candidate, mode="default"):
    for r in rows:
        if (r["config"], r["candidate"], r["mode"]) == (config, candidate, mode):
            return r["x_bf16"]
    return None


def _label(candidate: str) -> str:
    return candidate.replace("torchao fp8 tensorwise", "torchao tensorwise")


def plot_by_recipe(plt, rows, path) -> None:
    """Bars: speed-up over torch bf16 compiled, per candidate and mode, one
    panel per model config."""
    fig, axes = plt.subplots(1, len(MODEL_CONFIGS), figsize=(5 * len(MODEL_CONFIGS), 4.5),
                             sharey=True)
    width = 0.27
    for ax, config in zip(axes, MODEL_CONFIGS):
        cands = sorted({r["candidate"] for r in rows if r["config"] == config},
                       key=lambda c: (not c.startswith("torch bf16"), c))
        for i, mode in enumerate(MODES):
            xs = [j + (i - 1) * width for j in range(len(cands))]
            ys = [_x(rows, config, c, mode) or 0.0 for c in cands]
            bars = ax.bar(xs, ys, width, label=mode)
            ax.bar_label(bars, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=6,
                         rotation=90, padding=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cands)), [_label(c) for c in cands], rotation=30, ha="right")
        ax.set_title(config)
        ax.set_ylim(0, 1.6)
    axes[0].set_ylabel("speed-up over torch bf16 compiled")
    axes[0].legend(title="mode", fontsize=8)
    fig.suptitle("Training step speed-up, one H200 (higher is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_by_size(plt, rows, path) -> None:
    """Lines: FP8 speed-up over bf16 compiled as the model (whole steps) and
    the GEMMs (single layers) grow, te fp8_current and torchao."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    panels = (
        (axes[0], "Llama-style model, whole training step", HIDDEN,
         [f"{c}\nhidden {h}" for c, h in HIDDEN.items()], ("default",)),
        (axes[1], "single te.Linear, forward + backward", LAYER_CONFIGS,
         [f"{c}\n{f:.0f} GFLOP" for c, f in LAYER_CONFIGS.items()], ("default", "eager")),
    )
    for ax, title, configs, ticks, modes in panels:
        for cand in ("te fp8_current", "torchao fp8 tensorwise"):
            for mode in modes if cand.startswith("te") else ("default",):
                pts = [(i, _x(rows, c, cand, mode)) for i, c in enumerate(configs)]
                pts = [(i, y) for i, y in pts if y]
                ax.plot(*zip(*pts), marker="o", label=f"{_label(cand)}, {mode}",
                        color=LINE_COLORS[cand, mode])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(configs)), ticks)
        ax.set_xlim(-0.3, len(configs) - 0.7)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("speed-up over torch bf16 compiled")
    fig.suptitle("FP8 against bf16 by size, one H200 (higher is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m transformer_engine_compile.benchmarks.plots",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="docs/results", help="folder of the result files")
    p.add_argument("--out", default="docs/images", help="folder the PNGs are written to")
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: pip install -e '.[plots]'", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_rows(args.results)
    os.makedirs(args.out, exist_ok=True)
    for name, draw in (("speedup_by_recipe.png", plot_by_recipe),
                       ("fp8_speedup_by_size.png", plot_by_size)):
        path = os.path.join(args.out, name)
        draw(plt, rows, path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
