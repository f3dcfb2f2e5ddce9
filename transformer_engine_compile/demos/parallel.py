"""Tensor + sequence-parallel MLP of two te.Linear layers under torch.compile.

    torchrun --nproc_per_node 2 -m transformer_engine_compile.demos.parallel \\
        [--recipe fp8_current] [--steps 5]

fc1 is column-parallel (all-gathers the sequence-split input), fc2 is
row-parallel (reduce-scatters its output back to a sequence split).  Every
rank builds the same full weights, loads its shard, and trains next to a
single-device copy of the MLP; each step prints the loss and how far the TP
output is from the single-device one.  NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import transformer_engine_compile as te
from transformer_engine_compile import distributed as D

TOLERANCE = {"bf16": 0.02, "nvfp4": 0.25}  # relative error of the output; others 0.1


class MLP(torch.nn.Module):
    def __init__(self, hidden, ffn, group=None, device=None):
        super().__init__()
        tp = dict(tp_group=group, sequence_parallel=True) if group is not None else {}
        kw = dict(params_dtype=torch.bfloat16, device=device)
        self.fc1 = te.Linear(hidden, ffn, parallel_mode="column" if tp else None, **tp, **kw)
        self.fc2 = te.Linear(ffn, hidden, parallel_mode="row" if tp else None, **tp, **kw)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="TP + SP te.Linear MLP under torch.compile")
    parser.add_argument("--recipe", default="bf16", choices=te.recipe.RECIPE_NAMES)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.group.WORLD
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rec = te.recipe.by_name(args.recipe)

    torch.manual_seed(0)  # the same full weights and data on every rank
    w1 = torch.randn(4 * args.hidden, args.hidden) * args.hidden ** -0.5
    w2 = torch.randn(args.hidden, 4 * args.hidden) * (4 * args.hidden) ** -0.5
    b1, b2 = torch.randn(4 * args.hidden) * 0.1, torch.randn(args.hidden) * 0.1
    tp_mlp = MLP(args.hidden, 4 * args.hidden, group, device)
    ref_mlp = MLP(args.hidden, 4 * args.hidden, device=device)
    for model in (tp_mlp, ref_mlp):
        model.fc1.load_full_weight_(w1, b1)
        model.fc2.load_full_weight_(w2, b2)

    def forward(model, x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return model(x)

    compiled = torch.compile(forward, fullgraph=True)
    tol = TOLERANCE.get(args.recipe, 0.1)
    ok = True
    for step in range(args.steps):
        x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=torch.bfloat16)
        y_tp = compiled(tp_mlp, D.shard_sequence(x, group))  # (seq / tp, batch, hidden)
        y_ref = forward(ref_mlp, x)
        for model, y in ((tp_mlp, y_tp), (ref_mlp, y_ref)):
            # each rank's share of the global mean: TP grads then equal the reference's
            (y.float().square().sum() / x.numel()).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad.to(p.dtype)
                    p.grad = None
        want = D.shard_sequence(y_ref.detach(), group)
        err = ((y_tp.detach().float() - want.float()).norm() / want.float().norm()).item()
        ok &= err <= tol
        if rank == 0:
            print(f"step {step}: loss {y_ref.float().square().mean().item():.5f} "
                  f"rel. error vs single device {err:.2e}", flush=True)
    counts = torch._dynamo.utils.counters
    if rank == 0:
        print(f"graphs: {counts['stats']['unique_graphs']}, graph breaks: "
              f"{sum(counts['graph_break'].values())}")
        print(f"TP == single device: {ok} (tolerance {tol})")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
