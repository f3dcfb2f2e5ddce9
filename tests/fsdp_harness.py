"""FSDP2 cases, shared by the CPU tests (gloo, 2 processes spawned by
tests/test_fsdp.py) and the GPU run (NCCL, torchrun, qa/L1_distributed).

A small model of every te layer kind (LayerNormLinear, Linear,
LayerNormMLP) is sharded per layer and at the root, with the weights
gathered quantized (``te.fsdp.fully_shard(recipe=...)``) or in high
precision (``recipe=None``), and trained a few SGD steps on a global
batch split over the ranks.  The loss is a sum over the batch divided by
its size, and each rank's loss is scaled by the world size, so FSDP2's
average of the gradients is the global-batch gradient and every rank's
rows of x and dy are the single-process rows (dy times the world size, a
power of two: the same FP8 bytes under a scale half as large).
Checks, per recipe:

* quantized gather == high-precision gather, bit for bit (every gradient
  and parameter, every step): the gathered FP8 weight is what quantizing
  the whole weight on one device gives;
* compiled (per layer, fullgraph) == eager, bit for bit, no graph break;
* against the single-process model on the global batch: every gradient of
  the first step within ``REL_TOL`` (relative Frobenius error; per-rank
  quantization of x and dy draws other scales than the whole batch's) and
  the loss of every step within ``LOSS_TOL`` (relative; 1% but NVFP4);
* all-gather bytes: the quantized gather moves at most 0.55x of bf16's;
* the quantized gather without ``te.fsdp.precompute_scales`` == with it: each
  gather sees the optimizer's updates;
* DelayedScaling with ``amax_reduction_group``: the scales are identical on
  every rank and equal the single-process model's after the first step
  (the backward's times the world size); without it the same (te reduces
  over every rank by default); with ``reduce_amax=False`` they part;
* no module output is a view (FSDP2 warns about those).

Run under torchrun: ``python -m torch.distributed.run --nproc_per_node 2
tests/fsdp_harness.py --device cuda``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.benchmarks.fsdp import count_all_gather_bytes

NAMES = ("bf16", "fp8_current", "fp8_block", "mxfp8", "nvfp4", "delayed")
QUANTIZED_GATHER = ("fp8_current", "fp8_block")
# FSDP2 against one process, relative Frobenius error of each gradient, any
# step (measured values are a fraction of these)
# delayed: the first step
# quantizes with scale 1, where the world-size factor on dy changes the bytes
REL_TOL = {"bf16": 0.02, "fp8_current": 0.25, "fp8_block": 0.02, "mxfp8": 0.02,
           "nvfp4": 0.5, "delayed": 0.05}
LOSS_TOL = {"nvfp4": 0.03}  # others: 0.01
IN, HID, ROWS, STEPS = 256, 512, 64, 3


def fit_sizes(world: int) -> None:
    """Feature sizes for ``world`` ranks: every weight's rows split into whole
    128-row blocks (the blockwise recipe gathers those quantized): IN 256 up
    to 2 ranks, else 128 per rank; HID twice IN."""
    global IN, HID
    IN = 128 * max(2, world)
    HID = 2 * IN


def recipe_of(name):
    return recipe.DelayedScaling() if name == "delayed" else recipe.by_name(name)


def build(device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    kw = dict(params_dtype=dtype, device=device)
    return torch.nn.Sequential(
        te.LayerNormLinear(IN, HID, **kw), torch.nn.GELU(), te.Linear(HID, IN, **kw),
        te.LayerNormMLP(IN, HID, activation="swiglu", **kw))


def data(device, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, IN, generator=g).to(torch.bfloat16).to(device),
             torch.randn(ROWS, IN, generator=g).to(device)) for _ in range(steps)]


def world_mesh():
    """A 1-D mesh over the world on the process group's device (NCCL: the
    GPUs, gloo: the CPU): without one FSDP2 shards onto the machine's
    accelerator, also in a gloo run on CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def shard(model, rec, quantized: bool, compile_backend=None):
    """Per-layer and root ``fully_shard``."""
    mesh = world_mesh()
    for layer in model:
        if any(True for _ in layer.parameters()):
            te.fsdp.fully_shard(layer, recipe=rec if quantized else None, mesh=mesh,
                                quantized_gather=True)
            if compile_backend is not None:
                layer.compile(fullgraph=True, backend=compile_backend)
    torch_fully_shard(model, mesh=mesh)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model, name, batches, group, sharded: bool, precompute: bool = True,
          amax_group: str = "given"):
    """Per step: loss, the full gradients (by parameter name), the
    DelayedScaling scales of the first layer; and all-gather bytes per step.
    ``precompute``: ``te.fsdp.precompute_scales`` after each optimizer step;
    ``amax_group`` (DelayedScaling): "given" passes the group to te.autocast,
    "default" leaves it out (te reduces over every rank), "off" trains with
    ``reduce_amax=False``."""
    rec = recipe_of(name)
    if amax_group == "off":
        rec = recipe.DelayedScaling(reduce_amax=False)
    given = {"amax_reduction_group": group if sharded else None} if amax_group == "given" else {}
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if sharded else (0, 1)
    # a step size that keeps the loss falling at every size fit_sizes picks
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * 256 / IN, momentum=0.9, foreach=True)
    torch.manual_seed(1234)  # NVFP4's stochastic rounding draws from it
    steps, gathered = [], 0
    for x, target in batches:
        x, target = x.chunk(world)[rank], target.chunk(world)[rank]
        with count_all_gather_bytes() as total, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with te.autocast(enabled=rec is not None, recipe=rec, **given):
                y = model(x)
            loss = (y.float() - target).pow(2).sum() * (world / ROWS)
            loss.backward()
        gathered += total[0]
        views = [str(w.message) for w in seen if "returned a view" in str(w.message)]
        assert not views, views[0]
        grads = {n: _full(p.grad).float().clone() for n, p in model.named_parameters()}
        scales = tuple(_full(model[0]._buffers[b]).clone() for b in
                       ("fp8_scale_fwd", "fp8_scale_bwd")) if name == "delayed" else ()
        opt.step()
        opt.zero_grad()
        if sharded and precompute:  # the next gathers reuse these shards (one all-reduce)
            te.fsdp.precompute_scales(model)
        steps.append((loss.detach(), grads, scales))
    params = {n: _full(p).detach().float().clone() for n, p in model.named_parameters()}
    return steps, params, gathered // len(batches)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_bit_equal(a, b, what):
    (steps_a, params_a, _), (steps_b, params_b, _) = a, b
    for i, ((la, ga, sa), (lb, gb, sb)) in enumerate(zip(steps_a, steps_b)):
        assert torch.equal(la, lb), f"{what}: step {i} loss differs"
        for n in ga:
            assert torch.equal(ga[n], gb[n]), f"{what}: step {i} grad of {n} differs"
        for x, y in zip(sa, sb):
            assert torch.equal(x, y), f"{what}: step {i} scales differ"
    for n in params_a:
        assert torch.equal(params_a[n], params_b[n]), f"{what}: parameter {n} differs"


def run_case(group, name, device, compile_backend=None) -> dict:
    """All checks of the module docstring for one recipe; returns measurements."""
    from torch._dynamo.utils import counters

    batches = data(device)
    initial = build(device)
    reference = train(copy.deepcopy(initial), name, batches, None, sharded=False)
    runs = {}
    # (label, quantized gather, compile backend, train()'s keywords)
    variants = [("quantized", True, None, {}), ("plain", False, None, {})]
    if name in QUANTIZED_GATHER:  # each gather quantizes a weight update itself
        variants.append(("no_precompute", True, None, {"precompute": False}))
    if name == "delayed":
        variants += [("default_group", True, None, {"amax_group": "default"}),
                     ("no_reduction", True, None, {"amax_group": "off"})]
    if compile_backend is not None:
        variants.append(("compiled", True, compile_backend, {}))
    for label, quantized, backend, kw in variants:
        torch._dynamo.reset()
        counters.clear()
        model = shard(copy.deepcopy(initial), recipe_of(name), quantized, backend)
        if quantized and name in QUANTIZED_GATHER:
            kinds = {type(p._local_tensor).__name__ for n, p in model.named_parameters()
                     if n.endswith("weight") and "norm" not in n}
            assert kinds == {"QuantizedAllGatherWeight"}, kinds
        runs[label] = train(model, name, batches, group, sharded=True, **kw)
        if backend is not None:
            assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_bit_equal(runs["quantized"], runs["plain"], f"{name}: quantized vs plain gather")
    if "no_precompute" in runs:
        _assert_bit_equal(runs["no_precompute"], runs["plain"],
                          f"{name}: quantized gather without precompute_scales vs plain")
    if name == "delayed":  # te reduces over every rank unless told otherwise
        _assert_bit_equal(runs["default_group"], runs["quantized"],
                          f"{name}: default amax reduction vs the group given")
        _check_scales_differ(group, runs["no_reduction"])
    if "compiled" in runs:
        _assert_bit_equal(runs["compiled"], runs["quantized"], f"{name}: compiled vs eager")
    grads, ref_grads = runs["quantized"][0][0][1], reference[0][0][1]  # step 0: same weights
    grad_error = max(_rel(grads[n], ref_grads[n]) for n in grads)
    # the loss of every step (rank 0's share times the world size: compare the sums)
    losses = torch.stack([l for l, _, _ in runs["quantized"][0]])
    dist.all_reduce(losses, group=group)
    losses = losses / dist.get_world_size(group)
    ref_losses = torch.stack([l for l, _, _ in reference[0]])
    loss_error = ((losses - ref_losses).abs() / ref_losses).max().item()
    assert grad_error <= REL_TOL[name], f"{name}: gradient error {grad_error:.4f} > {REL_TOL[name]}"
    assert loss_error <= LOSS_TOL.get(name, 0.01), f"{name}: loss error {loss_error:.4f} ({losses} vs {ref_losses})"
    q_bytes, p_bytes = runs["quantized"][2], runs["plain"][2]
    if name in QUANTIZED_GATHER:
        assert q_bytes <= 0.55 * p_bytes, f"{name}: gathered {q_bytes} vs bf16 {p_bytes} bytes"
    else:
        assert q_bytes == p_bytes
    if name == "delayed":
        _check_delayed_scales(group, runs["quantized"], reference, dist.get_world_size(group))
    return {"grad_error": grad_error, "loss_error": loss_error, "gather_bytes": q_bytes, "bf16_gather_bytes": p_bytes}


def _check_delayed_scales(group, run, reference, world):
    """Identical on every rank (the amaxes were all-reduced); after the first
    step equal to the single-process model's (same rows, same weights)."""
    for i, (_, _, scales) in enumerate(run[0]):
        for s in scales:
            everyone = [torch.empty_like(s) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, s.contiguous(), group=group)
            assert all(torch.equal(everyone[0], e) for e in everyone), f"step {i}: scales differ"
    (fwd, bwd), (ref_fwd, ref_bwd) = run[0][0][2], reference[0][0][2]
    assert torch.equal(fwd, ref_fwd), (fwd, ref_fwd)
    assert torch.equal(bwd[0] * world, ref_bwd[0]), (bwd, ref_bwd)


def _check_scales_differ(group, run):
    """``reduce_amax=False``: each rank keeps its own amaxes, so the ranks'
    scales (from their own halves of the batch) part after the first step."""
    differ = False
    for _, _, scales in run[0][1:]:
        for s in scales:
            everyone = [torch.empty_like(s) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, s.contiguous(), group=group)
            differ = differ or not all(torch.equal(everyone[0], e) for e in everyone)
    assert differ, "reduce_amax=False: the ranks' scales stayed identical"


def reported(label: str, case) -> bool:
    """Run ``case()`` (a dict of measured errors), print ``label ok ...`` or
    ``label FAIL <why>`` on rank 0; whether it passed (torchrun mains)."""
    try:
        result = case()
        status, ok = "ok   " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), True
    except AssertionError as e:
        status, ok = f"FAIL {e}", False
    if dist.get_rank() == 0:
        print(f"{label} {status}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--recipes", default=",".join(NAMES))
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) \
        if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    fit_sizes(dist.get_world_size())
    group = dist.group.WORLD
    failures = sum(not reported(f"fsdp {name:12s}",
                                lambda: run_case(group, name, device, args.compile_backend))
                   for name in args.recipes.split(","))
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
