"""FSDP2 whole-training-step benchmark: benchmarks.llama's Llama-style model, data
parallel over N ranks, with weights all-gathered in bf16 or quantized.

    torchrun --nproc_per_node 2 -m transformer_engine_compile.benchmarks.fsdp \\
        --configs llama-b --recipes bf16,fp8_current,fp8_block --modes eager,compiled

Candidates, side by side in one process: bf16 ``torch.nn.Linear`` under
torch's ``fully_shard`` (the baseline), ``te.Linear`` in bf16 and under each
recipe with its weights gathered quantized (``te.fsdp.fully_shard(...,
recipe=rec)``), FP8 current and blockwise scaling also with the plain bf16
gather (so the gather format's effect shows), and torchao's ``Float8Linear`` tensorwise with
its FP8 all-gather and with the bf16 gather when torchao imports.

Sharding as torchtitan does it: ``fully_shard`` on each decoder block, then
on the root.  "compiled" compiles each block after sharding it
(``block.compile(fullgraph=True)``: FSDP2's hooks run eagerly around the
compiled block, and fullgraph makes any graph break an error); "eager" runs
uncompiled.  Every rank trains on its own batch of the config's size, so the
global batch is N times it.  One step is benchmarks.llama's (forward under the
recipe, fp32 MSE loss, backward, AdamW (fused on CUDA), ``loss.item()``),
bf16 parameters.

Printed by rank 0, per candidate and mode: rank 0's median ms per step,
global tokens/s, the ratio to the baseline in the same mode (>1: faster),
all-gather bytes per step and rank (counted over one step by wrapping
``torch.distributed``'s all-gather functions, which FSDP2 calls through the
module attribute), rank 0's peak memory, and the Dynamo graphs compiled over
the candidate's steps (one per block when nothing recompiles); with
``--profile`` each candidate's step broken down per CUDA stream on every
rank and a cProfile of it (:mod:`.step_profile`).  A candidate that fails prints
its error and the others still run (the failure must happen on every rank,
as it does for errors that do not depend on the data; otherwise the other
ranks wait in a collective).

``--device cpu`` runs gloo and ``llama-tiny``, a smoke run whose times mean
nothing (torchao's GEMMs emulated); :func:`cpu_run` spawns the processes for
the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch
import torch.distributed as dist

from . import distributed as D
from . import llama
from .. import recipe as R
from .compare import RECIPES, torchao_unavailable_reason

BASELINE = "torch bf16"
MODES = ("eager", "compiled")
CONFIGS = {**llama.LLAMA_CONFIGS, **llama.TINY_LLAMA, **llama.HF_CONFIGS,
           **llama.TINY_HF,
           # llama-b's layer, 4 layers, 2 x 2048 tokens per rank: the model data
           # parallelism is measured on (Hugging Face's, as users convert it)
           "hf-llama-b4": dataclasses.replace(llama.LLAMA_CONFIGS["llama-b"], layers=4,
                                              batch=2, vocab=32000)}


def candidates(recipe_names, with_torchao, kept_copies=False, no_reshard=False):
    """(label, model kind, recipe, gather recipe, reshard after forward) in
    table order: benchmarks.llama's candidates (te bf16 always; "bf16" in
    ``recipe_names`` adds nothing), each recipe gathering in its own format,
    fp8_current and fp8_block also gathering bf16; ``kept_copies``: those
    also with the bf16 gather and each layer keeping its FP8 weight copy
    for the backward (gather recipe :data:`KEPT`), the memory-for-time
    trade te.fsdp.fully_shard does not make; ``no_reshard``: torch bf16 and
    the te recipes' own gathers also with the blocks keeping their gathered
    weights from the forward to the backward (FSDP2's
    ``reshard_after_forward=False``: one gather per step instead of two,
    the gathered weights held meanwhile)."""
    recipes = {name: RECIPES[name] for name in recipe_names if name != "bf16"}
    out = []
    for label, kind, rec in llama.candidates(recipes, with_torchao):
        # torchao's gather is set by its own config: True for its FP8 all-gather
        out.append((label, kind, rec, True if kind == "torchao" else rec, True))
        if label in HP_GATHER_TOO:
            out.append((f"{label} (bf16 gather)", kind, rec, None, True))
            if kept_copies and kind != "torchao":
                out.append((f"{label} (bf16 gather + FP8 copy kept)", kind, rec, KEPT, True))
    if no_reshard:
        out += [(f"{label} (no reshard)", kind, rec, gather, False)
                for label, kind, rec, gather, _ in list(out) if label in NO_RESHARD_TOO]
    return out


# the gather recipe of a candidate that gathers bf16 and keeps the forward's
# FP8 weight copies for the backward (save_original_weight off)
KEPT = "kept"


# the recipes whose weights FSDP2 can gather quantized: each also runs with
# the plain bf16 gather, so the gather format's effect shows
HP_GATHER_TOO = ("te fp8_current", "te fp8_block", "torchao fp8 tensorwise")
# the candidates ``--no-reshard`` also runs with reshard_after_forward=False
NO_RESHARD_TOO = ("torch bf16", "te fp8_current", "te fp8_block")


def shard(model, gather_recipe, mesh, compiled, backend, save_original_weight=True,
          reshard=True):
    """torchtitan's layout: each block its own FSDP2 unit (compiled when
    asked), the root the rest.  ``te.fsdp.fully_shard`` with ``recipe=None``
    is torch's ``fully_shard`` (nothing is wrapped), so the baseline and
    torchao go through it too.  ``save_original_weight=False``: the te
    layers keep their FP8 weight copies for the backward instead
    (te.fsdp.fully_shard's setting undone; the blocks compile at their
    first call, after it); ``reshard=False``: the blocks keep their
    gathered weights until the backward (``reshard_after_forward``)."""
    from ..parallel import fsdp

    for block in llama.decoder_blocks(model):
        fsdp.fully_shard(block, recipe=gather_recipe, mesh=mesh, quantized_gather=True,
                         reshard_after_forward=reshard)
        if compiled:
            block.compile(fullgraph=True, backend=backend)
    fsdp.fully_shard(model, mesh=mesh)
    if not save_original_weight:
        for layer in model.modules():
            if hasattr(type(layer), "save_original_weight"):
                layer.save_original_weight = False


def gather_label(model, kind):
    """How the GEMM weights are gathered: e.g. "fp8_current 14/14" for the
    te weights FSDP2 gathers quantized, "bf16" when none is."""
    from ..parallel.fsdp import QuantizedAllGatherWeight, gemm_weight_names

    if kind == "torchao":
        fp8 = any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
                  for m in model.modules())
        return "fp8 (torchao)" if fp8 else "bf16"
    total = sum(len(gemm_weight_names(m)) for m in model.modules())
    formats = [p._local_tensor._format for p in model.parameters()
               if isinstance(getattr(p, "_local_tensor", None), QuantizedAllGatherWeight)]
    return f"{formats[0]} {len(formats)}/{total}" if formats else "bf16"


@contextlib.contextmanager
def count_all_gather_bytes(group=None):
    """Counts the output bytes of ``torch.distributed.all_gather_into_tensor``
    and ``all_gather_single`` (where torch has it) called while inside; yields
    a one-element list holding the running total.  FSDP2 calls them through
    the ``torch.distributed`` attribute, so wrapping the attribute sees its
    gathers; ``all_gather_into_tensor`` calling ``all_gather_single`` inside
    torch counts once.  ``group``: count only the gathers over this process
    group (e.g. FSDP2's dp group, not the tensor-parallel layers' gathers)."""
    total = [0]
    depth = [0]
    saved = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_gather_single")
             if hasattr(dist, name)}

    def wrap(fn):
        def counted(output_tensor, *args, **kwargs):
            call_group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if depth[0] == 0 and (group is None or call_group is group):
                total[0] += output_tensor.numel() * output_tensor.element_size()
            depth[0] += 1
            try:
                return fn(output_tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(fn))
    try:
        yield total
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def prepare(cfg, kind, rec, gather_recipe, mode, device, mesh, backend, reshard=True):
    """One candidate built, sharded (and its blocks compiled): ``(model,
    step, x, target)``, this rank's own batch."""
    float8_config = after_step = None
    if kind == "torchao":  # its FP8 all-gather and scale precompute as torchao documents, or bf16
        from torchao.float8 import Float8LinearConfig, precompute_float8_dynamic_scale_for_fsdp
        float8_config = Float8LinearConfig(enable_fsdp_float8_all_gather=bool(gather_recipe),
                                           emulate=device.type != "cuda")
    model = llama.build(cfg, kind, device, float8_config=float8_config)
    kept = gather_recipe == KEPT
    gather_recipe = None if kept else gather_recipe
    shard(model, None if kind == "torchao" else gather_recipe, mesh, mode == "compiled", backend,
          save_original_weight=not kept, reshard=reshard)
    if kind == "torchao":
        if gather_recipe:
            after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    elif gather_recipe is not None:  # te: the weights' amaxes in one all-reduce
        from ..parallel import fsdp
        after_step = lambda: fsdp.precompute_scales(model)  # noqa: E731
    # only DelayedScaling reads the group: its amaxes are all-reduced over the ranks
    group = dist.group.WORLD if isinstance(rec, R.DelayedScaling) else None
    step = llama.make_step(model, rec, "eager", amax_reduction_group=group,
                           after_step=after_step)
    x, target = llama.inputs(cfg, device, seed=1 + dist.get_rank())  # own batch per rank
    return model, step, x, target


def first_steps(model, kind, step, x, target, device) -> dict:
    """The fields of a row measured on a fresh candidate's first steps: its
    gather format, first step (compile included), peak memory over one
    step, all-gather bytes over one step."""
    row = {"gather": gather_label(model, kind)}
    t0 = time.perf_counter()
    step(x, target)
    row["first_step_s"] = time.perf_counter() - t0  # compile included
    row["peak_gib"] = llama.peak_gib(step, x, target, device)  # one step, CUDA only
    with count_all_gather_bytes() as gathered:
        row["loss"] = step(x, target)
    row["all_gather_bytes"] = gathered[0]
    return row


def measure(cfg, kind, rec, gather_recipe, mode, device, mesh, *, steps, warmup, backend,
            profile=False, gc_every=50, reshard=True):
    """One candidate in one mode: the row's measured fields (``profile``:
    also ``row["profile"]``, :func:`profile_step`'s breakdown per rank);
    ``gc_every``: the steps' garbage collection
    (:func:`.distributed.collection_schedule`)."""
    model, step, x, target = prepare(cfg, kind, rec, gather_recipe, mode, device, mesh, backend,
                                     reshard)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with D.collection_schedule(gc_every) as schedule:
        step = schedule(step)
        row = first_steps(model, kind, step, x, target, device)
        row["ms"], row["host_ms"] = llama.time_steps(step, x, target, warmup=warmup,
                                                     steps=steps)
        # compiles over all its steps: one per block unless something recompiled
        row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        row["tokens_per_s"] = cfg.tokens * mesh.size() / row["ms"] * 1e3
        if profile:
            from .step_profile import profile_step
            row["profile"] = profile_step(step, x, target)
        return row


def run_interleaved(configs, cands, modes, device, mesh, *, steps, backend, rounds, gc_every,
                    only, log) -> list:
    """:func:`run`'s rows timed in ``rounds`` rounds that take turns (as
    ``benchmarks.llama``'s ``--rounds``): every candidate is built, compiled
    and measured on its first steps, all stay resident, then each round
    times ``steps`` steps of each in turn and the medians are over all
    rounds.  Candidates timed one after the other on these machines moved
    by 10-15% between runs (the hosts' speed drifts, and one slow host
    holds up every rank); taking turns shares the drift.  Peak memory is
    each candidate's own (less what the candidates built before it hold)."""
    rows, live = [], []
    llama.keep_compiled_entries()  # every candidate's compiled blocks stay resident
    with D.collection_schedule(gc_every) as schedule:
        for cname in configs:
            for cand in cands:
                if only and cand[0] not in only:
                    continue
                _, kind, rec, gather_recipe, reshard = cand
                for mode in modes:
                    row = {"config": cname, "candidate": cand[0], "mode": mode, "rounds": rounds}
                    rows.append(row)
                    try:
                        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                        model, step, x, target = prepare(CONFIGS[cname], kind, rec,
                                                         gather_recipe, mode, device, mesh,
                                                         backend, reshard)
                        step = schedule(step)
                        row.update(first_steps(model, kind, step, x, target, device))
                        row["graphs"] = (torch._dynamo.utils.counters["stats"]["unique_graphs"]
                                         - graphs)
                        row["peak_gib"] -= base / 2 ** 30
                        live.append((row, step, x, target))
                    except Exception as e:  # one failing candidate must not hide the others
                        row["error"] = llama.error_text(e)
        built = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        llama.time_in_rounds(live, rounds, steps)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - built
    if recompiled:  # not attributable to one candidate: every row says so
        for row, *_ in live:
            row["recompiled_in_rounds"] = recompiled
        log(f"{recompiled} graph(s) compiled during the timed rounds")
    for row, *_ in live:
        if "error" not in row:
            row["tokens_per_s"] = CONFIGS[row["config"]].tokens * mesh.size() / row["ms"] * 1e3
    live.clear()
    for cname in configs:
        log(HEADER)
        for row in rows:
            if row["config"] == cname:
                row["x_bf16"] = llama._ratio(rows, row, BASELINE, row["mode"])
                log(format_row(row))
        log("")
    return rows


def run(configs, recipe_names, modes, device, *, steps=10, warmup=3, backend="inductor",
        with_torchao=True, only=None, log=print, profile=False, gc_every=50, rounds=1,
        kept_copies=False, no_reshard=False):
    """All rows (every rank computes them; rank 0 logs them); ``only``: these
    candidate labels alone; ``profile``: each row also profiles a step and
    logs its breakdown after the table; ``gc_every``: :func:`measure`'s;
    ``rounds > 1``: interleaved (:func:`run_interleaved`, no profile);
    ``kept_copies``, ``no_reshard``: :func:`candidates`'."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if with_torchao and (reason := torchao_unavailable_reason()):
        log(f"torchao skipped: {reason}\n")
        with_torchao = False
    elif with_torchao:
        import torchao
        log(f"torchao {torchao.__version__}\n")

    cands = candidates(recipe_names, with_torchao, kept_copies, no_reshard)
    if rounds > 1:
        return run_interleaved(configs, cands, modes, device, mesh, steps=steps,
                               backend=backend, rounds=rounds, gc_every=gc_every, only=only,
                               log=log)

    def measure_row(cname, candidate, mode):
        _, kind, rec, gather_recipe, reshard = candidate
        return measure(CONFIGS[cname], kind, rec, gather_recipe, mode, device, mesh,
                       steps=steps, warmup=warmup, backend=backend, profile=profile,
                       gc_every=gc_every, reshard=reshard)

    rows = D.run_rows(configs, cands, modes, only, measure_row, BASELINE, HEADER, format_row,
                      log, device)
    if profile:
        log(format_profiles(rows))
    return rows


def format_profiles(rows) -> str:
    """Per row: every rank's step breakdown in one line, then rank 0's in
    full (:func:`.step_profile.format_summary`)."""
    from .step_profile import format_summary

    out = []
    for row in rows:
        summaries = row.get("profile")
        if not summaries:
            continue
        label = f"{row['config']} / {row['candidate']} / {row['mode']}"
        out.append(format_summary(f"{label} (rank 0)", summaries[0]))
        if summaries[0].get("python"):
            out.append("```\n" + summaries[0]["python"] + "```")
        out.append("| rank | step ms | compute busy | compute idle | NCCL | NCCL exposed |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for rank, s in enumerate(summaries):
            if s:
                out.append(f"| {rank} | {s['step']:.2f} | {s['compute']:.2f} | "
                           f"{s['compute_idle']:.2f} | {s['nccl']:.2f} | {s['nccl_exposed']:.2f} |")
        out.append("")
    return "\n".join(out)


HEADER = ("| config | candidate | mode | gather | ms/step | tokens/s (global) | x bf16 "
          "| all-gather MiB/step/rank | peak GiB/rank | 1st step s | graphs |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")


def format_row(row):
    return D.table_row(row, lambda r: (
        f"{r['gather']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['x_bf16']:.2f} | "
        f"{r['all_gather_bytes'] / 2 ** 20:.2f} | {r['peak_gib']:.2f} | "
        f"{r['first_step_s']:.1f} | {r['graphs']}"))


def main(argv=None):
    """Parse, set up the process group (unless one exists), run; rank 0
    prints and writes ``--json``.  Returns 0 when no candidate failed."""
    p = argparse.ArgumentParser(prog="torchrun ... -m transformer_engine_compile.benchmarks.fsdp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=D.csv(list(CONFIGS)), default=None,
                   help="comma-separated; default llama-b on CUDA, llama-tiny on CPU")
    p.add_argument("--recipes", type=D.csv(["bf16", *RECIPES]), default=["bf16", "fp8_current", "fp8_block"],
                   help="comma-separated; te bf16 and the torch bf16 baseline always run")
    p.add_argument("--modes", type=D.csv(list(MODES)), default=list(MODES))
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for 'compiled'")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--candidates", type=lambda text: text.split(","), default=None,
                   help="comma-separated labels: run only these (e.g. 'torch bf16,te fp8_current')")
    p.add_argument("--json", help="rank 0 writes the rows here")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step per candidate and print where its time goes "
                        "per CUDA stream (every rank; rank 0's kernels and host ranges)")
    D.add_gc_argument(p)
    p.add_argument("--kept-copies", action="store_true",
                   help="also run each te recipe's bf16 gather with the layers keeping their "
                        "FP8 weight copies for the backward (more memory, no re-quantization)")
    p.add_argument("--no-reshard", action="store_true",
                   help="also run torch bf16 and each te recipe's own gather with the blocks "
                        "keeping their gathered weights until the backward "
                        "(reshard_after_forward=False: one gather per step, more memory)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the candidates in N interleaved rounds of --steps steps each "
                        "(all resident; medians over the rounds; no --profile)")
    args = p.parse_args(argv)
    configs = args.configs or (["llama-b"] if args.device == "cuda" else ["llama-tiny"])
    # the root's te layers run eagerly: run_main builds the native extension first
    return D.run_main(args.device, args.json,
                      f"data parallel, per-rank batch as the config, steps {args.steps}",
                      lambda device, log: run(configs, args.recipes, args.modes, device,
                                              steps=args.steps, warmup=args.warmup,
                                              backend=args.backend,
                                              with_torchao=not args.no_torchao,
                                              only=args.candidates, profile=args.profile,
                                              gc_every=args.gc_every, rounds=args.rounds,
                                              kept_copies=args.kept_copies,
                                              no_reshard=args.no_reshard, log=log))


def cpu_run(argv=(), nprocs=2):
    """Run the benchmark on ``nprocs`` CPU processes (gloo) with ``argv``
    (default ``llama-tiny``, one warm-up and one timed step); rank 0's rows."""
    return D.cpu_run(main, argv, nprocs)


if __name__ == "__main__":
    sys.exit(main())
