"""Convergence: does FP8 training hurt the model?  One Llama-style model
trained from the same initialisation on the same batches, in bf16 and
under every recipe, its training and held-out losses compared.

    python -m transformer_engine_compile.benchmarks.convergence \\
        [--config llama-100m] [--recipes bf16 fp8_current ...] \\
        [--json out.json] [--plot out.png]
    torchrun --nproc_per_node 2 -m transformer_engine_compile.benchmarks.convergence \\
        --fsdp --recipes bf16 fp8_current        # the same global batches under FSDP2

The model is Hugging Face's ``LlamaForCausalLM`` built from a config
(``llama-100m``: 8 layers, hidden 1024, ffn 2816, 103M parameters with a
byte vocabulary), fp32 parameters under ``torch.autocast`` bf16, after
``te.convert`` for the recipes (the bf16 baseline keeps
``torch.nn.Linear``), compiled.  The text is the Python standard library's
own source files, read as bytes (a 256-token vocabulary: nothing to
download, the same corpus on every machine); every twentieth file is held
out.  Fused AdamW, linear warm-up then cosine decay to a tenth; the
training loss is read every step, the held-out loss every ``eval_every``
steps over the same batches for every recipe.  Under ``--fsdp`` each rank
takes its share of every global batch, so the curve should follow the
single-GPU one.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

from .. import recipe as R

RECIPES = ("bf16", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    layers: int
    hidden: int
    ffn: int
    heads: int
    seq: int
    batch: int              # sequences per step (the global batch under --fsdp)
    steps: int
    warmup: int
    lr: float
    eval_every: int
    eval_batches: int


CONFIGS = {
    "llama-100m": RunConfig(layers=8, hidden=1024, ffn=2816, heads=16, seq=512, batch=16,
                            steps=2000, warmup=100, lr=6e-4, eval_every=100, eval_batches=16),
    # the CPU version the test suite runs
    "tiny": RunConfig(layers=2, hidden=128, ffn=256, heads=4, seq=64, batch=8, steps=300,
                      warmup=20, lr=3e-3, eval_every=50, eval_batches=4),
}


# -- the text ------------------------------------------------------------------------------
def corpus(max_bytes: int = 64 << 20) -> tuple:
    """``(train, held out)`` uint8 tensors: the standard library's ``.py``
    files in sorted order, every twentieth one held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f)
    parts: tuple = ([], [])
    total = 0
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        parts[i % 20 == 0].append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return tuple(torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8) for p in parts)


def batches(data: torch.Tensor, cfg: RunConfig, count: int, seed: int) -> list:
    """``count`` batches of ``(inputs, next-byte targets)``, windows drawn
    with ``seed`` (the same for every recipe)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=g)
        rows = torch.stack([data[s:s + cfg.seq + 1] for s in starts.tolist()]).long()
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


# -- the model and the step ----------------------------------------------------------------
def build(cfg: RunConfig, name: str, device) -> torch.nn.Module:
    """The model at its initialisation (seed 0), ``te.convert``-ed for a recipe."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
        attn_implementation="sdpa",
        # training keeps no KV cache: with one, every layer guards on its
        # index and per-layer compilation (--fsdp) recompiles per layer
        use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg)
    if name != "bf16":
        from ..convert import convert
        convert(model)
    return model


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``cfg.lr``."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def loss_of(model, x, y, rec):
    """Mean next-byte cross-entropy, bf16 autocast (and ``rec``'s FP8)."""
    from ..autocast import autocast

    with torch.autocast(x.device.type, dtype=torch.bfloat16), \
            autocast(enabled=rec is not None, recipe=rec):
        logits = model(x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(cfg: RunConfig, name: str, device, data, compiled: bool, fsdp: bool = False,
          log=print) -> dict:
    """One recipe's run: losses per step, held-out losses, tokens per second."""
    import torch.distributed as dist

    rec = R.DelayedScaling() if name == "fp8_delayed" else R.by_name(name)
    model = build(cfg, name, device)
    world, rank = (dist.get_world_size(), dist.get_rank()) if fsdp else (1, 0)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..parallel import fsdp as te_fsdp
        mesh = init_device_mesh(device.type, (world,))  # --device's, not the machine's default
        for layer in model.model.layers:
            te_fsdp.fully_shard(layer, recipe=rec, mesh=mesh)
            if compiled:  # torchtitan's way: each FSDP2 block compiled after sharding
                layer.compile()
        fully_shard(model, mesh=mesh)
    if cfg.batch % world:
        raise ValueError(f"the batch of {cfg.batch} does not split over {world} ranks")
    share = slice(rank * cfg.batch // world, (rank + 1) * cfg.batch // world)
    step_loss = torch.compile(loss_of) if compiled and not fsdp else loss_of
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg))
    train_data, held_out = data
    val = batches(held_out, cfg, cfg.eval_batches, seed=2)
    out = {"train": [], "val": [], "tokens_per_s": None}
    timed_tokens, timed_s = 0, 0.0

    def evaluate(step):
        model.eval()
        with torch.no_grad():
            losses = [step_loss(model, x[share].to(device), y[share].to(device), rec)
                      for x, y in val]
        model.train()
        value = _mean_over_ranks(torch.stack(losses).mean(), fsdp)
        out["val"].append((step, value))
        log(f"  {name:>12} step {step:5d}  held-out loss {value:.4f}")

    for step, (x, y) in enumerate(batches(train_data, cfg, cfg.steps, seed=1)):
        if step % cfg.eval_every == 0:
            evaluate(step)
        start = time.perf_counter()
        loss = step_loss(model, x[share].to(device), y[share].to(device), rec)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if fsdp and rec is not None:
            te_fsdp.precompute_scales(model)
        value = _mean_over_ranks(loss.detach(), fsdp)  # read every step
        if step >= 10:  # past the compilation
            timed_s += time.perf_counter() - start
            timed_tokens += cfg.batch * cfg.seq
        out["train"].append(value)
    evaluate(cfg.steps)
    out["tokens_per_s"] = timed_tokens / timed_s if timed_s else None
    out["final_train"] = sum(out["train"][-50:]) / len(out["train"][-50:])
    out["final_val"] = out["val"][-1][1]
    return out


def _mean_over_ranks(value: torch.Tensor, fsdp: bool) -> float:
    if fsdp:
        import torch.distributed as dist
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


# -- results -------------------------------------------------------------------------------
def table(results: dict) -> str:
    """Final losses per recipe and their difference from bf16's."""
    base = results.get("bf16")
    lines = ["| recipe | final train loss | final held-out loss | held-out vs bf16 | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        diff = "" if base is None else \
            f"{100 * (r['final_val'] - base['final_val']) / base['final_val']:+.2f}%"
        tps = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        lines.append(f"| {name} | {r['final_train']:.4f} | {r['final_val']:.4f} | {diff} | "
                     f"{tps} |")
    return "\n".join(lines)


def plot(results: dict, path: str, title: str) -> None:
    """Loss curves of every recipe (training, smoothed; held out, marked)
    and each recipe's held-out loss minus bf16's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    base = dict(results["bf16"]["val"]) if "bf16" in results else None
    for name, r in results.items():
        train_loss = torch.tensor(r["train"])
        window = max(1, len(train_loss) // 100)
        smooth = train_loss.unfold(0, window, 1).mean(1) if len(train_loss) >= window else \
            train_loss
        line, = top.plot(range(window - 1, window - 1 + len(smooth)), smooth.tolist(),
                         lw=1, alpha=0.7, label=f"{name} (train)")
        steps, vals = zip(*r["val"])
        top.plot(steps, vals, "o-", ms=3, color=line.get_color(), label=f"{name} (held out)")
        if base is not None and name != "bf16":
            bottom.plot(steps, [v - base[s] for s, v in zip(steps, vals)], "o-", ms=3,
                        color=line.get_color(), label=name)
    top.set_ylabel("loss (nats per byte)")
    top.set_title(title)
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0, color="grey", lw=0.8)
    bottom.set_ylabel("held-out loss - bf16's")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def merge(paths, plot_path=None, json_path=None, recipes=None) -> int:
    """One table (and plot, and JSON) of the results of several ``--json``
    files of the same configuration, in the order given (only ``recipes``
    when given).  A ``--fsdp`` run's recipes are labelled ``<recipe> fsdp2``,
    so it sits beside the one-GPU run of the same recipe."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    first = runs[0]
    for run, path in zip(runs[1:], paths[1:]):
        if run["config"] != first["config"]:
            raise SystemExit(f"{path}: another configuration than {paths[0]}'s")
    results = {f"{name} fsdp2" if run.get("fsdp") else name: r for run in runs
               for name, r in run["results"].items() if recipes is None or name in recipes}
    print(f"{first['device']}, torch {first['torch']}, {first['config']}")
    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**first, "results": results}, f)
    if plot_path:
        cfg = first["config"]
        plot(results, plot_path, f"{cfg['steps']} steps of {cfg['batch']}x{cfg['seq']} bytes")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="default: llama-100m on a GPU, tiny on a CPU")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="override the config's")
    parser.add_argument("--eager", action="store_true", help="do not compile")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over the torchrun ranks")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of the curves (matplotlib)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="no training: the table (and --plot, --json) of earlier runs' "
                             "--json files, e.g. recipes run on separate GPUs")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.plot, args.json,
                     None if args.recipes == list(RECIPES) else args.recipes)
    cfg = CONFIGS[args.config or ("llama-100m" if args.device == "cuda" else "tiny")]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    own_group = False
    if args.fsdp:
        from . import distributed as bd
        device, own_group = bd.start(args.device)
        log = bd.rank0_log()
    else:
        device = torch.device(args.device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        log = print
    try:
        data = corpus()
        log(f"{device_name(device)}, "
            f"torch {torch.__version__}, {cfg}, {data[0].numel():,} training bytes, "
            f"{data[1].numel():,} held out")
        results = {}
        writer = not args.fsdp or torch.distributed.get_rank() == 0
        for name in args.recipes:
            results[name] = train(cfg, name, device, data, compiled=not args.eager,
                                  fsdp=args.fsdp, log=log)
            torch._dynamo.reset()
            if args.json and writer:  # after every recipe: a cut-short run keeps its curves
                with open(args.json, "w") as f:
                    json.dump({"config": dataclasses.asdict(cfg), "torch": torch.__version__,
                               "device": device_name(device), "fsdp": args.fsdp,
                               "results": results}, f)
        log(table(results))
        if args.plot and writer:
            plot(results, args.plot, f"{args.config or 'convergence'}: "
                 f"{cfg.steps} steps of {cfg.batch}x{cfg.seq} bytes")
    finally:
        if own_group:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
