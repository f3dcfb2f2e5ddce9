"""Tensor-parallel whole-training-step benchmark: benchmarks.llama's Llama-style
decoder with its projections split over N ranks (q, k, v, gate, up
column-parallel; o, down row-parallel), FP8 recipes against bf16.

    torchrun --nproc_per_node 4 -m transformer_engine_compile.benchmarks.tp \\
        --configs llama-b --recipes fp8_current,fp8_block [--profile]

Candidates, side by side in one process:

* ``torch bf16 TP``, the baseline: ``torch.nn.Linear`` split by torch's own
  tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel``; every rank holds every token, the row-parallel
  outputs are all-reduced);
* ``te bf16 TP`` and ``te <recipe> TP``: ``te.Linear(parallel_mode=...,
  tp_group=...)``, the collectives inside the layers' ops;
* the same with sequence parallelism (``+SP``): between the blocks every
  rank holds its share of the tokens, the column-parallel layers all-gather
  them and the row-parallel ones reduce-scatter their outputs.

The ranks share one batch of the config's size (tensor parallelism splits
the layers, not the data), and every candidate starts from the same full
weights (the te layers load their shards of the torch model's).  One step
is benchmarks.llama's (forward under the recipe, fp32 MSE loss, backward, fused
AdamW on CUDA, ``loss.item()``), the whole step compiled (``fullgraph``)
or eager.

Printed by rank 0 per candidate: median ms per step, tokens/s, the ratio to
the baseline in the same mode (>1: faster), peak memory, the first step's
loss (the ranks' mean; the same model, so the bf16 rows agree to bf16
rounding) and, with
``--profile``, the collectives' share of the step: NCCL kernel time and
the part of it the compute stream did not overlap (:mod:`.step_profile`).

``--device cpu`` runs gloo and ``llama-tiny``, a smoke run whose times mean
nothing; :func:`cpu_run` spawns the processes for the tests.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import distributed as D
from . import llama
from .compare import RECIPES

BASELINE = "torch bf16 TP"
MODES = ("eager", "compiled")
CONFIGS = {**llama.LLAMA_CONFIGS, **llama.TINY_LLAMA}
COLUMN = ("q", "k", "v", "gate", "up")
ROW = ("o", "down")


class TPBlock(llama.Block):
    """benchmarks.llama's block (full-size ``torch.nn.Linear`` projections, which
    :func:`build` then splits) computing on this rank's heads; tokens come
    in flattened, ``(tokens, hidden)`` (this rank's share under SP)."""

    def __init__(self, cfg, tp: int, device):
        if cfg.heads % tp or cfg.kv_heads % tp or cfg.ffn % tp:
            raise ValueError(f"{tp} ranks do not split {cfg.heads} heads, {cfg.kv_heads} KV "
                             f"heads and ffn {cfg.ffn} evenly")
        super().__init__(cfg, llama.torch_linear, device)
        self.heads, self.kv_heads = cfg.heads // tp, cfg.kv_heads // tp  # this rank's
        self.batch, self.seq = cfg.batch, cfg.seq

    def forward(self, x, cos, sin):
        h = self.attn_norm(x)
        a = llama._attention(self, self.q(h), self.k(h), self.v(h), self.batch, self.seq,
                                   cos, sin)
        x = x + self.o(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def build(cfg, kind, rec, sp: bool, group, device):
    """The model of one candidate: ``kind`` "torch" (torch's tensor
    parallelism) or "te"; every candidate from the same full weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from ..module.linear.layer import Linear

    tp = dist.get_world_size(group)
    torch.manual_seed(0)
    # benchmarks.llama's decoder over TP blocks: tokens flattened, (tokens, hidden)
    model = llama.Llama(cfg, None, device, block=lambda: TPBlock(cfg, tp, device))
    if kind == "torch":
        mesh = init_device_mesh(device.type, (tp,))
        plan = {**{n: ColwiseParallel() for n in COLUMN}, **{n: RowwiseParallel() for n in ROW}}
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
        return model
    for block in model.blocks:
        for name in COLUMN + ROW:
            full = getattr(block, name)
            layer = Linear(full.in_features, full.out_features, bias=False,
                           params_dtype=torch.bfloat16, device=device,
                           parallel_mode="column" if name in COLUMN else "row",
                           sequence_parallel=sp, tp_group=group)
            with torch.no_grad():
                layer.load_full_weight_(full.weight)
            setattr(block, name, layer)
    return model


def candidates(recipe_names, sp_modes):
    """(label, kind, recipe, sequence parallel) in table order."""
    out = [(BASELINE, "torch", None, False)]
    for sp in sp_modes:
        tail = " TP+SP" if sp else " TP"
        out.append((f"te bf16{tail}", "te", None, sp))
        out += [(f"te {name}{tail}", "te", RECIPES[name], sp)
                for name in recipe_names if name != "bf16"]
    return out


def inputs(cfg, sp: bool, group, device):
    """(x, target) on this rank: the shared batch's tokens, flattened, or
    this rank's contiguous share of them under SP."""
    x, target = llama.inputs(cfg, device, seed=1)  # the same on every rank
    x, target = x.reshape(-1, cfg.hidden), target.reshape(-1, cfg.hidden)
    if sp:
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        x, target = x.chunk(tp)[rank].contiguous(), target.chunk(tp)[rank].contiguous()
    return x, target


def measure(cfg, kind, rec, sp, mode, group, device, *, steps, warmup, profile, backend,
            gc_every=50):
    """One candidate in one mode: the row's measured fields; ``gc_every``:
    the steps' garbage collection (:func:`.distributed.collection_schedule`)."""
    from .step_profile import profile_step

    model = build(cfg, kind, rec, sp, group, device)
    step = llama.make_step(model, rec, mode if mode == "eager" else "default",
                                 backend=backend)
    with D.collection_schedule(gc_every) as schedule:
        step = schedule(step)
        x, target = inputs(cfg, sp, group, device)
        row = {}
        torch._dynamo.utils.counters.clear()
        t0 = time.perf_counter()
        loss = step(x, target)
        row["first_step_s"] = time.perf_counter() - t0  # compile included
        # the ranks' mean: under SP each rank's loss covers its share of the tokens
        losses = [None] * dist.get_world_size(group)
        dist.all_gather_object(losses, loss, group=group)
        row["first_loss"] = sum(losses) / len(losses)
        row["ms"], row["host_ms"] = llama.time_steps(step, x, target, warmup=warmup,
                                                           steps=steps)
        row["tokens_per_s"] = cfg.tokens / row["ms"] * 1e3
        row["peak_gib"] = llama.peak_gib(step, x, target, device)
        row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if profile:
            row["profile"] = profile_step(step, x, target)
        return row


def run(configs, recipe_names, sp_modes, modes, device, *, steps=10, warmup=3, only=None,
        log=print, profile=False, backend="inductor", gc_every=50):
    """All rows (every rank computes them; rank 0 logs them); ``gc_every``:
    :func:`measure`'s."""
    group = dist.group.WORLD

    def measure_row(cname, candidate, mode):
        _, kind, rec, sp = candidate
        return measure(CONFIGS[cname], kind, rec, sp, mode, group, device, steps=steps,
                       warmup=warmup, profile=profile, backend=backend, gc_every=gc_every)

    rows = D.run_rows(configs, candidates(recipe_names, sp_modes), modes, only, measure_row,
                      BASELINE, HEADER, format_row, log, device)
    if profile:
        log(format_collectives(rows))
    return rows


HEADER = ("| config | candidate | mode | ms/step | tokens/s | x bf16 TP | peak GiB/rank "
          "| first loss | 1st step s | graphs |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|")


def format_row(row):
    return D.table_row(row, lambda r: (
        f"{r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['x_bf16']:.2f} | {r['peak_gib']:.2f} | "
        f"{r['first_loss']:.5f} | {r['first_step_s']:.1f} | {r['graphs']}"))


def format_collectives(rows) -> str:
    """The collectives' share of each profiled step (rank 0; the slowest
    rank's exposed time too)."""
    out = ["| config | candidate | mode | step ms | NCCL ms | NCCL share | exposed ms "
           "| exposed, slowest rank |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        summaries = [s for s in row.get("profile") or [] if s]
        if not summaries:
            continue
        s = summaries[0]
        worst = max(x["nccl_exposed"] for x in summaries)
        out.append(f"| {row['config']} | {row['candidate']} | {row['mode']} | {s['step']:.2f} | "
                   f"{s['nccl']:.2f} | {s['nccl'] / s['step']:.0%} | {s['nccl_exposed']:.2f} | "
                   f"{worst:.2f} |")
    return "\n".join(out)


def main(argv=None):
    """Parse, set up the process group (unless one exists), run; rank 0
    prints and writes ``--json``.  Returns 0 when no candidate failed."""
    p = argparse.ArgumentParser(prog="torchrun ... -m transformer_engine_compile.benchmarks.tp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=D.csv(list(CONFIGS)), default=None,
                   help="comma-separated; default llama-b on CUDA, llama-tiny on CPU")
    p.add_argument("--recipes", type=D.csv(["bf16", *RECIPES]), default=["fp8_current", "fp8_block"],
                   help="comma-separated; te bf16 and the torch baseline always run")
    p.add_argument("--sp", type=D.csv(["0", "1"]), default=["0", "1"],
                   help="te candidates without (0) and with (1) sequence parallelism")
    p.add_argument("--modes", type=D.csv(list(MODES)), default=["compiled"])
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for 'compiled'")
    p.add_argument("--candidates", type=lambda text: text.split(","), default=None,
                   help="comma-separated labels: run only these")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step per candidate: the collectives' share")
    p.add_argument("--json", help="rank 0 writes the rows here")
    D.add_gc_argument(p)
    args = p.parse_args(argv)
    configs = args.configs or (["llama-b"] if args.device == "cuda" else ["llama-tiny"])
    llama.keep_compiled_entries()
    return D.run_main(args.device, args.json, f"tensor parallel, steps {args.steps}",
                      lambda device, log: run(configs, args.recipes,
                                              [s == "1" for s in args.sp], args.modes, device,
                                              steps=args.steps, warmup=args.warmup,
                                              only=args.candidates, profile=args.profile,
                                              backend=args.backend, gc_every=args.gc_every,
                                              log=log))


def cpu_run(argv=(), nprocs=2):
    """Run the benchmark on ``nprocs`` CPU processes (gloo) with ``argv``
    (default ``llama-tiny``, one warm-up and one timed step); rank 0's rows."""
    return D.cpu_run(main, argv, nprocs)


if __name__ == "__main__":
    sys.exit(main())
