"""2-D parallelism: tensor parallel inside, FSDP2 across, on a ``(dp, tp)``
DeviceMesh.  Shared by tests/test_fsdp_2d.py (CPU, gloo, 4 processes as a
2 x 2 mesh) and a GPU run under torchrun (``python -m torch.distributed.run
--nproc_per_node 4 tests/fsdp2d_harness.py --device cuda``).

The model is a Megatron MLP: ``te.Linear`` column-parallel (HID -> FFN),
GELU, ``te.Linear`` row-parallel (FFN -> HID), both with ``tp_group =
mesh["tp"].get_group()`` (with and without sequence parallelism), each
layer and the root sharded by ``te.fsdp.fully_shard(..., mesh=mesh["dp"])``.
FSDP2 sees a TP layer's local shard as the whole parameter: it shards it
over the dp group, gathers it there (quantized under FP8 current scaling
and FP8 blockwise) and reduce-scatters its gradient there.

The global batch ``(SEQ, BATCH, HID)`` is split over dp along the batch
(dim 1) and, with SP, over tp along the sequence (dim 0).  Each rank's
loss is the sum of its squared errors times ``dp / (SEQ * BATCH)``, so
FSDP2's average over dp is the gradient of the global mean (as in
fsdp_harness.py; the factor ``dp`` on dy is a power of two).

Checks, per recipe and SP setting (``run_case``):

* FP8 current scaling and FP8 blockwise: the run with the weights gathered
  quantized equals the run gathering them in bf16, bit for bit (every
  gradient and parameter, every step); bf16 and DelayedScaling gather in
  high precision either way;
* compiled (each layer ``compile(fullgraph=True)`` after sharding) equals
  eager bit for bit, one graph per layer (no graph break, no recompile);
* against one process running the full (unsplit) model on the global
  batch: the first step's gradients within ``REL_TOL``, every step's
  loss within ``LOSS_TOL`` and the parameters' total change over the run
  within ``UPDATE_TOL`` (relative Frobenius errors);
* the bytes all-gathered over the **dp group** (FSDP2's gathers; the TP
  gathers run on the tp group and are not counted): at most 0.55x of the
  bf16 gather's for the quantized gathers, equal otherwise;
* DelayedScaling with ``amax_reduction_group`` = every rank (dp x tp, as
  Megatron's amax reduction group): after each step both layers' scales
  are identical on all ranks, and after the first step they equal the
  single process's exactly (the backward's times dp, the factor on dy);
  with the amaxes reduced over the dp group only (eager), the scales are
  identical on the dp replicas of each tp rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.benchmarks.fsdp import count_all_gather_bytes

from fsdp_harness import _assert_bit_equal, _rel, reported

NAMES = ("bf16", "fp8_current", "fp8_block", "delayed")
QUANTIZED_GATHER = ("fp8_current", "fp8_block")
# 2-D against one process, relative Frobenius error of the first step's
# gradients (measured on CPU: bf16 0.36%, fp8_current 10.4%, fp8_block 1.2%,
# delayed 2.1%): bf16 gradients and their dp reduction round in another
# order; FP8 current scaling quantizes each rank's rows of x / dy, and each
# TP shard of W and dy, with their own scales, its gradients in E5M2; FP8
# blockwise groups other tokens into its 128-token blocks (each dp rank
# holds half of the batch dim, so a block spans other tokens)
REL_TOL = {"bf16": 0.01, "fp8_current": 0.25, "fp8_block": 0.03, "delayed": 0.05}
# the parameters' change over the run (measured: 1.0%, 10.4%, 2.6%, 3.9%): the
# above, plus the bf16 parameters rounding each step's update in their last bit
UPDATE_TOL = {"bf16": 0.03, "fp8_current": 0.25, "fp8_block": 0.06, "delayed": 0.1}
LOSS_TOL = 0.01
HID, FFN, SEQ, BATCH, STEPS = 256, 512, 32, 4, 3
# parameter name -> the dim the TP layer splits (None: whole on every tp rank)
TP_DIM = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}


def recipe_of(name):
    return recipe.DelayedScaling() if name == "delayed" else recipe.by_name(name)


def make_mesh(device_type: str, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def build(device, tp_group=None, sp=False):
    """The full model (``tp_group`` None) or this tp rank's TP model, from the
    same full parameters."""
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device=device)
    full = torch.nn.Sequential(te.Linear(HID, FFN, **kw), torch.nn.GELU(),
                               te.Linear(FFN, HID, **kw))
    with torch.no_grad():
        # the second half of each weight's TP split scaled by 0.7 (not a power
        # of two, which FP8 would absorb in its exponent): the TP shards'
        # amaxes differ, so a scale reduced over the wrong ranks shows
        for layer, dim in ((full[0], 0), (full[2], 1)):
            size = layer.weight.shape[dim]
            layer.weight.narrow(dim, size // 2, size // 2).mul_(0.7)
            layer.bias.normal_(0, 0.1)
    if tp_group is None:
        return full
    kw.update(tp_group=tp_group, sequence_parallel=sp)
    model = torch.nn.Sequential(te.Linear(HID, FFN, parallel_mode="column", **kw),
                                torch.nn.GELU(), te.Linear(FFN, HID, parallel_mode="row", **kw))
    for layer, ref in ((model[0], full[0]), (model[2], full[2])):
        layer.load_full_weight_(ref.weight, ref.bias)
    return model


def data(device, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, BATCH, HID, generator=g).to(torch.bfloat16).to(device),
             torch.randn(SEQ, BATCH, HID, generator=g).to(device)) for _ in range(steps)]


def shard(model, mesh, rec, quantized: bool, compile_backend=None):
    """Per-layer and root FSDP2 over ``mesh["dp"]``; compiled per layer after."""
    for layer in (model[0], model[2]):
        te.fsdp.fully_shard(layer, recipe=rec if quantized else None, mesh=mesh["dp"],
                            quantized_gather=True)
        if compile_backend is not None:
            layer.compile(fullgraph=True, backend=compile_backend)
    torch_fully_shard(model, mesh=mesh["dp"])
    return model


class Layout:
    """Which part of the global batch and of each full parameter a rank holds."""

    def __init__(self, mesh, sp: bool):
        self.mesh, self.sp = mesh, sp
        self.dp = mesh["dp"].size() if mesh is not None else 1
        self.tp = mesh["tp"].size() if mesh is not None else 1
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.tp_rank = mesh["tp"].get_local_rank() if mesh is not None else 0

    def local(self, t):
        t = t.chunk(self.dp, 1)[self.dp_rank]
        if self.sp:
            t = t.chunk(self.tp, 0)[self.tp_rank]
        return t.contiguous()

    def full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A parameter or gradient of the whole model: the dp shards gathered
        (DTensor), then the tp shards concatenated."""
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.detach().float()
        dim = TP_DIM[name]
        if self.mesh is None or dim is None:
            return t.clone()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.mesh["tp"].get_group())
        return torch.cat(parts, dim)


def train(model, name, batches, layout: Layout, amax_group=None):
    """Per step: (global loss, full gradients, DelayedScaling scales of both
    layers); the full parameters at the end; bytes all-gathered over the dp
    group per step."""
    rec = recipe_of(name)
    mesh = layout.mesh
    dp_group = mesh["dp"].get_group() if mesh is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    steps, gathered = [], 0
    for x, target in batches:
        x, target = layout.local(x), layout.local(target)
        with count_all_gather_bytes(group=dp_group) as total:
            with te.autocast(enabled=rec is not None, recipe=rec,
                             amax_reduction_group=amax_group):
                y = model(x)
            loss = (y.float() - target).pow(2).sum() * (layout.dp / (SEQ * BATCH))
            loss.backward()
        gathered += total[0]
        loss = loss.detach().clone()
        if mesh is not None:  # the global loss: every rank's share (tp shares it without SP)
            dist.all_reduce(loss)
            loss = loss / (layout.dp * (1 if layout.sp else layout.tp))
        grads = {n: layout.full(n, p.grad) for n, p in model.named_parameters()}
        scales = tuple(model[i]._buffers[b].clone() for i in (0, 2)
                       for b in ("fp8_scale_fwd", "fp8_scale_bwd")) if name == "delayed" else ()
        opt.step()
        opt.zero_grad()
        if mesh is not None:
            te.fsdp.precompute_scales(model)
        steps.append((loss, grads, scales))
    params = {n: layout.full(n, p) for n, p in model.named_parameters()}
    return steps, params, gathered // len(batches)


def run_case(mesh, name, sp: bool, device, compile_backend=None, reference=None) -> dict:
    """Every check of the module docstring for one recipe and SP setting on
    this rank; returns the measurements.  ``reference``: the single-process
    run, when the caller has it already (it does not depend on ``sp``)."""
    from torch._dynamo.utils import counters

    label = f"{name}{' +SP' if sp else ''}"
    batches = data(device)
    initial = build(device)
    if reference is None:
        reference = train(copy.deepcopy(initial), name, batches, Layout(None, False))
    layout = Layout(mesh, sp)
    variants = [("quantized", True, None)]
    if name in QUANTIZED_GATHER:
        variants.append(("plain", False, None))
    if name == "delayed":  # the alternative: amaxes reduced over the dp group only
        variants.append(("dp_amax", True, None))
    if compile_backend is not None:
        variants.append(("compiled", True, compile_backend))
    runs = {}
    for variant, quantized, backend in variants:
        torch._dynamo.reset()
        counters.clear()
        model = shard(build(device, mesh["tp"].get_group(), sp), mesh, recipe_of(name),
                      quantized, backend)
        if quantized and name in QUANTIZED_GATHER:
            kinds = {type(p._local_tensor).__name__ for n, p in model.named_parameters()
                     if n.endswith("weight")}
            assert kinds == {"QuantizedAllGatherWeight"}, f"{label}: {kinds}"
        amax_group = None
        if name == "delayed":
            amax_group = mesh["dp"].get_group() if variant == "dp_amax" else dist.group.WORLD
        runs[variant] = train(model, name, batches, layout, amax_group)
        if backend is not None:
            assert not counters["graph_break"], f"{label}: {dict(counters['graph_break'])}"
            # one graph per layer: no graph break, no recompile over the steps
            assert counters["stats"]["unique_graphs"] == 2, f"{label}: {dict(counters['stats'])}"
    if "plain" in runs:
        _assert_bit_equal(runs["quantized"], runs["plain"], f"{label}: quantized vs bf16 gather")
    if "compiled" in runs:
        _assert_bit_equal(runs["compiled"], runs["quantized"], f"{label}: compiled vs eager")

    steps, params, q_bytes = runs["quantized"]
    ref_steps, ref_params, _ = reference
    grad_error = max(_rel(steps[0][1][n], ref_steps[0][1][n]) for n in ref_params)
    initial_params = {n: p.detach().float() for n, p in initial.named_parameters()}
    update_error = max(_rel(params[n] - initial_params[n], ref_params[n] - initial_params[n])
                       for n in ref_params)
    losses = torch.stack([s[0] for s in steps])
    ref_losses = torch.stack([s[0] for s in ref_steps])
    loss_error = ((losses - ref_losses).abs() / ref_losses).max().item()
    tol, update_tol = REL_TOL[name], UPDATE_TOL[name]
    assert grad_error <= tol, f"{label}: gradient error {grad_error:.4f} > {tol}"
    assert update_error <= update_tol, \
        f"{label}: parameter update error {update_error:.4f} > {update_tol}"
    assert loss_error <= LOSS_TOL, f"{label}: loss error {loss_error:.4f}: {losses} vs {ref_losses}"
    result = {"grad_error": grad_error, "update_error": update_error, "loss_error": loss_error,
              "dp_gather_bytes": q_bytes}
    if "plain" in runs:
        p_bytes = runs["plain"][2]
        assert q_bytes <= 0.55 * p_bytes, f"{label}: gathered {q_bytes} vs bf16 {p_bytes} bytes"
        result["bf16_dp_gather_bytes"] = p_bytes
    if name == "delayed":
        _check_delayed_scales(label, steps, ref_steps, layout.dp)
        # reduced over dp only: the dp replicas still agree (each tp rank's
        # scales are its shards' own: the weights' differ between tp ranks)
        _check_scales_agree(f"{label} dp-only amax", runs["dp_amax"][0],
                            mesh["dp"].get_group())
    return result


def _check_scales_agree(label, steps, group=None):
    """Every step's scales identical on every rank of ``group`` (None: all)."""
    size = dist.get_world_size(group)
    for i, (_, _, scales) in enumerate(steps):
        for s in scales:
            everyone = [torch.empty_like(s) for _ in range(size)]
            dist.all_gather(everyone, s.contiguous(), group=group)
            assert all(torch.equal(everyone[0], e) for e in everyone), \
                f"{label}: step {i}: scales differ between ranks: {everyone}"


def _check_delayed_scales(label, steps, ref_steps, dp):
    """Identical on every rank of the world (the amaxes were all-reduced over
    it); after the first step the forward scales equal the single process's,
    the backward ones (dy carries the factor dp) are dp times smaller."""
    _check_scales_agree(label, steps)
    for layer, (fwd, bwd, ref_fwd, ref_bwd) in enumerate(
            zip(steps[0][2][::2], steps[0][2][1::2], ref_steps[0][2][::2], ref_steps[0][2][1::2])):
        assert torch.equal(fwd, ref_fwd), \
            f"{label}: layer {layer} forward scales {fwd} vs {ref_fwd}"
        assert torch.equal(bwd[:1] * dp, ref_bwd[:1]), \
            f"{label}: layer {layer} backward scale {bwd} x {dp} vs {ref_bwd}"


def _local_params(model) -> dict:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _full_tensor(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def run_checkpoint(mesh, name, device, path) -> None:
    """``torch.distributed.checkpoint`` of the 2-D model after one step:

    * loaded into a fresh 2-D model (``state_dict`` / ``dcp.load`` /
      ``load_state_dict``), every rank's piece equals the saved model's, and
      one more step from each is bit-identical (layer state included);
    * read by ``get_model_state_dict(full_state_dict=True)``, and loaded
      into the full model sharded over all 4 ranks (no TP: another layout),
      the parameters equal the saved 2-D model's, gathered over dp and tp.

    Before the state-dict hooks of ``fsdp_tp``, DCP took the tp ranks'
    shards for replicas and restored tp rank 0's everywhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    label = f"checkpoint {name}"
    rec = recipe_of(name)
    amax_group = dist.group.WORLD if name == "delayed" else None
    layout = Layout(mesh, False)
    batches = data(device, 2)
    model = shard(build(device, mesh["tp"].get_group()), mesh, rec, True)
    train(model, name, batches[:1], layout, amax_group)
    full = {n: layout.full(n, p) for n, p in model.named_parameters()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for n, want in full.items():
        assert torch.equal(_full_tensor(gathered[n]), want), f"{label}: full state dict {n}"

    resumed = shard(build(device, mesh["tp"].get_group()), mesh, rec, True)
    state = te.fsdp.fit_extra_state(resumed.state_dict(), path)
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state)
    want = _local_params(model)
    for n, got in _local_params(resumed).items():
        assert torch.equal(got, want[n]), f"{label}: {n} differs after the round trip"
    _assert_bit_equal(train(resumed, name, batches[1:], layout, amax_group),
                      train(model, name, batches[1:], layout, amax_group),
                      f"{label}: the step after resuming")

    everyone = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    single = build(device)
    for layer in (single[0], single[2]):
        te.fsdp.fully_shard(layer, recipe=rec, mesh=everyone, quantized_gather=True)
    torch_fully_shard(single, mesh=everyone)
    state = te.fsdp.fit_extra_state(single.state_dict(), path)
    dcp.load(state, checkpoint_id=path)
    single.load_state_dict(state)
    for n, p in single.named_parameters():
        assert torch.equal(_full_tensor(p), full[n]), f"{label}: {n} loaded without TP"


def run_layernorm_checkpoint(mesh, device, path) -> None:
    """The LayerNorm modules' TP-split parameters (LayerNormLinear column,
    LayerNormMLP fc1 column / fc2 row) through a 2-D checkpoint: a fresh
    model loads every rank's piece; a gated LayerNormMLP's state dict is
    refused (its fc1 shard holds rows of both halves)."""
    import torch.distributed.checkpoint as dcp

    kw = dict(params_dtype=torch.bfloat16, device=device, tp_group=mesh["tp"].get_group())

    def ln_model(seed, activation="gelu"):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            te.LayerNormLinear(HID, FFN, parallel_mode="column", **kw),
            te.LayerNormMLP(FFN, HID, activation=activation, set_parallel_mode=True, **kw))
        for layer in model:
            te.fsdp.fully_shard(layer, mesh=mesh["dp"])
        return torch_fully_shard(model, mesh=mesh["dp"])

    model = ln_model(0)
    dcp.save(model.state_dict(), checkpoint_id=path)
    loaded = ln_model(1)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=path)
    loaded.load_state_dict(state)
    want = _local_params(model)
    for n, got in _local_params(loaded).items():
        assert torch.equal(got, want[n]), f"LayerNorm modules checkpoint: {n}"
    try:
        ln_model(0, "swiglu").state_dict()
    except NotImplementedError as e:
        assert "fc1_weight" in str(e) and "both halves" in str(e), e
    else:
        raise AssertionError("a gated LayerNormMLP's 2-D state dict was not refused")


def run_cases(mesh, cases, device, compile_backend=None) -> list:
    """``cases``: (recipe name, sp) pairs; the single-process reference runs
    once per recipe."""
    out, references = [], {}
    for name, sp in cases:
        if name not in references:
            references[name] = train(copy.deepcopy(build(device)), name, data(device),
                                     Layout(None, False))
        out.append(((name, sp), run_case(mesh, name, sp, device, compile_backend,
                                         references[name])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--recipes", default=",".join(NAMES))
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    mesh = make_mesh(device.type, world // args.tp, args.tp)
    failures = sum(
        not reported(f"fsdp2d {name:12s} sp={int(sp)}",
                     lambda: run_cases(mesh, [(name, sp)], device, args.compile_backend)[0][1])
        for name in args.recipes.split(",") for sp in (False, True))
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)  # one checkpoint directory for every rank

    def checkpoints():
        for name in ("fp8_current", "delayed"):
            run_checkpoint(mesh, name, device, f"{path[0]}/{name}")
        run_layernorm_checkpoint(mesh, device, f"{path[0]}/ln")
        return {}

    failures += not reported("fsdp2d checkpoint", checkpoints)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
