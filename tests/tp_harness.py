"""Tensor/sequence-parallel te.Linear cases, shared by the CPU tests (gloo,
2 processes spawned by tests/test_tp.py) and the GPU run (NCCL, torchrun,
qa/L1_distributed/test.sh).

Each case builds the single-device layer and the TP layer from the same full
parameters, runs ``steps`` training steps eager and compiled (fullgraph) on
the TP layer, and checks:

* compiled == eager TP, bit for bit, every step (outputs and all gradients);
* one graph, zero graph breaks;
* step 0 against the single-device reference: bf16 exactly (integer-valued
  data, so every summation order is exact), quantized recipes within
  ``REL_TOL`` (relative Frobenius error, docs/parallel.md);
* with the recording backend (CPU): the collectives are inside the ops, the
  graphs hold no collective of their own.

Run under torchrun: ``python -m torch.distributed.run --nproc_per_node 2
tests/tp_harness.py --device cuda --modes default reduce-overhead``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

RECIPES = {name: recipe.by_name(name) for name in recipe.RECIPE_NAMES}
PARALLEL_CASES = [(m, sp) for m in ("column", "row") for sp in (False, True)]
# TP against single device, step 0, relative Frobenius error (documented in
# docs/parallel.md); measured values are a fraction of these
# (gradients: E5M2 for fp8_current, E4M3 for MXFP8 and blockwise, NVFP4 with
# stochastic rounding, so the two layouts draw different roundings)
REL_TOL = {"fp8_current": 0.10, "mxfp8": 0.01, "fp8_block": 0.01, "nvfp4": 0.30,
           "delayed": 0.01}
SEQ, BATCH, IN, OUT = 128, 2, 256, 256


def fit_sizes(world: int) -> None:
    """Feature sizes for ``world`` ranks: 256 up to 2 ranks, else 128 per rank,
    so every rank's shard of a weight is whole 128x128 blocks (the blockwise
    recipe's weight format) whichever dim the layer splits."""
    global IN, OUT, FFN
    IN = OUT = FFN = 128 * max(2, world)


# -- data -------------------------------------------------------------------------
def full_tensors(rec, device, seq=SEQ):
    """x (seq, BATCH, IN), W (OUT, IN), b (OUT,), dy (seq, BATCH, OUT), identical on
    every rank.  bf16: values in {-1, 0, 1}, so sums stay exact integers (checked
    below 256, where bf16 holds every integer)."""
    g = torch.Generator().manual_seed(0)
    shapes = ((seq, BATCH, IN), (OUT, IN), (OUT,), (seq, BATCH, OUT))
    if rec is None:
        out = [torch.randint(-1, 2, s, generator=g).to(torch.bfloat16) for s in shapes]
    else:
        out = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
        out[1] = out[1] * 0.05
    return [t.to(device) for t in out]


def _part(t, dim, rank, tp):
    return t.chunk(tp, dim)[rank]


class Slicer:
    """Which part of each full tensor a rank holds, per parallel mode."""

    def __init__(self, parallel_mode, sp, rank, tp):
        self.mode, self.sp, self.rank, self.tp = parallel_mode, sp, rank, tp

    def p(self, t, dim):
        return _part(t, dim, self.rank, self.tp)

    def inp(self, x):  # also the layout of dx
        if self.mode == "column":
            return self.p(x, 0) if self.sp else x
        return self.p(x, -1)

    def out(self, y):  # also the layout of dy
        if self.mode == "column":
            return self.p(y, -1)
        return self.p(y, 0) if self.sp else y

    def weight(self, w):
        return self.p(w, 0 if self.mode == "column" else 1)

    def bias(self, b):
        return self.p(b, 0) if self.mode == "column" else b


def recipe_of(name):
    """``RECIPES[name]``, or ``DelayedScaling()`` for ``"delayed"`` (not in
    RECIPES: its quantizers need the layer's scale buffers, so the op-level
    tests cannot take it)."""
    return recipe.DelayedScaling() if name == "delayed" else RECIPES[name]


# -- steps --------------------------------------------------------------------------
def _make_step(layer, rec, amax_group=None):
    """DelayedScaling: the amaxes reduced over ``amax_group`` (the TP group,
    so every rank keeps the scales of the whole tensors)."""
    group = amax_group if rec is not None and rec.delayed() else None

    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec, amax_reduction_group=group):
            return layer(x)
    return step


def run_steps(layer, step_fn, x0, dy0, steps):
    """Forward, backward with a fixed dy, SGD; [out, dx, dW, db] per step."""
    results = []
    torch.manual_seed(1)  # NVFP4 stochastic rounding draws from the global RNG
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # no-op unless reduce-overhead
        x = (x0 * (1 + 0.125 * i)).requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = step_fn(x)
        y.backward(dy0)
        # clones: a CUDA-graph replay overwrites its outputs
        results.append([y.detach().clone(), x.grad.clone(), layer.weight.grad.clone(),
                        layer.bias.grad.clone()])
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.01 * p.grad.to(p.dtype)
    return results


# -- graph recording backend -----------------------------------------------------------
class RecordingBackend:
    """aot_eager that keeps the op targets of the Dynamo, forward and backward graphs."""

    def __init__(self):
        self.targets = {"dynamo": [], "forward": [], "backward": []}

    def _keep(self, kind, gm):
        self.targets[kind] += [str(n.target) for n in gm.graph.nodes
                               if n.op == "call_function"]

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self._keep("dynamo", gm)

        def compiler(kind):
            def fn(g, _):
                self._keep(kind, g)
                return make_boxed_func(g.forward)
            return fn
        return aot_autograd(fw_compiler=compiler("forward"),
                            bw_compiler=compiler("backward"))(gm, example_inputs)

    def check(self):
        everything = sum(self.targets.values(), [])
        collectives = [t for t in everything if "c10d" in t or "distributed" in t]
        assert not collectives, f"collectives outside the ops: {collectives}"
        assert any("te_compile.linear_fwd" in t for t in self.targets["forward"]), self.targets
        assert any("te_compile.linear_bwd" in t for t in self.targets["backward"]), self.targets


def _compile(step, compile_mode):
    if compile_mode == "record":
        backend = RecordingBackend()
        return torch.compile(step, fullgraph=True, backend=backend), backend
    if compile_mode == "default":
        return torch.compile(step, fullgraph=True), None
    return torch.compile(step, fullgraph=True, mode=compile_mode), None


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# -- one case ----------------------------------------------------------------------------
def run_case(group, device, parallel_mode, sp, name, compile_mode, steps=3,
             seq=SEQ) -> dict:
    """Run and check one configuration on this rank; returns the step-0
    relative errors against the single-device layer.  ``seq`` x BATCH tokens
    in all (a ragged count when not a multiple of the recipe's block)."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    rec = recipe_of(name)
    label = f"{parallel_mode}{'+SP' if sp else ''} {name} {compile_mode} seq {seq} rank {rank}"
    x_full, w_full, b_full, dy_full = full_tensors(rec, device, seq)
    sl = Slicer(parallel_mode, sp, rank, tp)

    ref = te.Linear(IN, OUT, params_dtype=torch.bfloat16, device=device)
    ref.load_full_weight_(w_full, b_full)
    expected = run_steps(ref, _make_step(ref, rec), x_full, dy_full, 1)[0]
    if rec is None:  # integers below 256: exact in bf16 whatever the summation order
        assert all(t.abs().max() <= 256 for t in expected), "test data left the exact range"

    layer = te.Linear(IN, OUT, params_dtype=torch.bfloat16, device=device,
                      parallel_mode=parallel_mode, sequence_parallel=sp, tp_group=group)
    layer.load_full_weight_(w_full, b_full)
    assert torch.equal(layer.weight, sl.weight(w_full))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x0, dy0 = sl.inp(x_full), sl.out(dy_full)
    step = _make_step(layer, rec, group)
    eager = run_steps(layer, step, x0, dy0, steps)

    torch._dynamo.reset()
    counters.clear()
    layer.load_state_dict(state)
    compiled_step, backend = _compile(step, compile_mode)
    compiled = run_steps(layer, compiled_step, x0, dy0, steps)

    names = ("out", "dgrad", "wgrad", "bgrad")
    for i, (e, c) in enumerate(zip(eager, compiled)):
        for n, a, b in zip(names, e, c):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{label} step {i} {n}"
            assert torch.equal(a, b), f"{label}: compiled != eager at step {i}, {n}"
    assert counters["stats"]["unique_graphs"] == 1, f"{label}: {dict(counters['stats'])}"
    assert sum(counters["graph_break"].values()) == 0, f"{label}: {dict(counters['graph_break'])}"
    if backend is not None:
        backend.check()

    want = [sl.out(expected[0]), sl.inp(expected[1]), sl.weight(expected[2]),
            sl.bias(expected[3])]
    errors = {}
    for n, got, ref_t in zip(names, eager[0], want):
        assert got.shape == ref_t.shape, f"{label} {n}: {tuple(got.shape)} vs {tuple(ref_t.shape)}"
        if rec is None:
            assert torch.equal(got, ref_t), f"{label}: {n} differs from the single-device layer"
            errors[n] = 0.0
        else:
            errors[n] = rel_err(got, ref_t)
            assert errors[n] <= REL_TOL[name], f"{label}: {n} rel. error {errors[n]:.4f}"
    return errors


def delayed_state_case(group, device, parallel_mode, sp, steps=2) -> None:
    """DelayedScaling with the amaxes reduced over the TP group: after
    ``steps`` eager steps the TP layer's amax histories and scales equal the
    single-device layer's exactly (x, W and dy are the layer's inputs, so the
    max over their shards is the whole tensor's amax)."""
    rec = recipe_of("delayed")
    x, w, b, dy = full_tensors(rec, device)
    sl = Slicer(parallel_mode, sp, dist.get_rank(group), dist.get_world_size(group))
    ref = te.Linear(IN, OUT, params_dtype=torch.bfloat16, device=device).load_full_weight_(w, b)
    layer = te.Linear(IN, OUT, params_dtype=torch.bfloat16, device=device,
                      parallel_mode=parallel_mode, sequence_parallel=sp,
                      tp_group=group).load_full_weight_(w, b)
    run_steps(ref, _make_step(ref, rec), x, dy, steps)
    run_steps(layer, _make_step(layer, rec, group), sl.inp(x), sl.out(dy), steps)
    for name in ("fp8_amax_history_fwd", "fp8_scale_fwd", "fp8_amax_history_bwd",
                 "fp8_scale_bwd"):
        assert torch.equal(layer._buffers[name], ref._buffers[name]), (
            f"{parallel_mode}{'+SP' if sp else ''} delayed: {name} differs from the "
            f"single-device layer's")


def run_cases(group, device, cases, compile_mode, steps=3, seq=SEQ) -> list:
    out = []
    for parallel_mode, sp, name in cases:
        errs = run_case(group, device, parallel_mode, sp, name, compile_mode, steps, seq)
        out.append(((parallel_mode, sp, name, compile_mode), errs))
    return out


# -- te.LayerNormMLP: fc1 column-parallel, fc2 row-parallel ---------------------------------
FFN = 256
# bf16: the norm and the activation leave the integers, so TP (other summation
# orders and collectives) equals the single-device module within bf16 rounding
MLP_REL_TOL = {"bf16": 0.01, **REL_TOL}


def mlp_case(group, device, sp, name, compile_mode, steps=2, activation="swiglu",
             normalization="RMSNorm") -> dict:
    """``te.LayerNormMLP(set_parallel_mode=True)`` on this rank against the
    single-device module (step 0, within ``MLP_REL_TOL``), compiled == eager
    TP bit for bit, one graph; returns the step-0 relative errors."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    rec = recipe_of(name)
    label = f"LayerNormMLP {activation}{' +SP' if sp else ''} {name} rank {rank}"
    g = torch.Generator().manual_seed(0)
    gated = activation.endswith("glu")
    full = {"x": torch.randn(SEQ, BATCH, IN, generator=g),
            "dy": torch.randn(SEQ, BATCH, IN, generator=g),
            "ln_w": 1 + 0.1 * torch.randn(IN, generator=g),
            "fc1_w": 0.05 * torch.randn((2 if gated else 1) * FFN, IN, generator=g),
            "fc1_b": 0.1 * torch.randn((2 if gated else 1) * FFN, generator=g),
            "fc2_w": 0.05 * torch.randn(IN, FFN, generator=g),
            "fc2_b": 0.1 * torch.randn(IN, generator=g)}
    full = {k: v.to(torch.bfloat16).to(device) for k, v in full.items()}

    def build(**kw):
        m = te.LayerNormMLP(IN, FFN, activation=activation, normalization=normalization,
                            params_dtype=torch.bfloat16, device=device, **kw)
        with torch.no_grad():
            m.layer_norm_weight.copy_(full["ln_w"])
        return m.load_full_weights_(full["fc1_w"], full["fc2_w"], full["fc1_b"], full["fc2_b"])

    def run(m, step, x0, dy0, n):
        results = []
        torch.manual_seed(1)
        for i in range(n):
            torch.compiler.cudagraph_mark_step_begin()
            x = (x0 * (1 + 0.125 * i)).requires_grad_()
            m.zero_grad(set_to_none=True)
            y = step(x)
            y.backward(dy0)
            results.append([y.detach().clone(), x.grad.clone()]
                           + [p.grad.clone() for p in m.parameters()])
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.01 * p.grad.to(p.dtype)
        return results

    ref = build()
    expected = run(ref, _make_step(ref, rec), full["x"], full["dy"], 1)[0]
    layer = build(set_parallel_mode=True, sequence_parallel=sp, tp_group=group)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    tokens = (lambda t: _part(t, 0, rank, tp)) if sp else (lambda t: t)
    x0, dy0 = tokens(full["x"]), tokens(full["dy"])
    step = _make_step(layer, rec, group)
    eager = run(layer, step, x0, dy0, steps)
    torch._dynamo.reset()
    counters.clear()
    layer.load_state_dict(state)
    compiled_step, _ = _compile(step, "default" if compile_mode == "record" else compile_mode)
    compiled = run(layer, compiled_step, x0, dy0, steps)
    for i, (e, c) in enumerate(zip(eager, compiled)):
        for j, (a, b) in enumerate(zip(e, c)):
            assert torch.equal(a, b), f"{label}: compiled != eager at step {i}, result {j}"
    assert counters["stats"]["unique_graphs"] == 1, f"{label}: {dict(counters['stats'])}"
    assert sum(counters["graph_break"].values()) == 0, f"{label}: {dict(counters['graph_break'])}"

    def fc1_shard(t):  # a gated fc1 holds this rank's rows of both halves
        halves = t.chunk(2) if gated else (t,)
        return torch.cat([_part(h, 0, rank, tp) for h in halves])

    # out, dx, d gamma (summed over the group under SP), fc1 W/b, fc2 W (columns), fc2 b
    want = [tokens(expected[0]), tokens(expected[1]), expected[2], fc1_shard(expected[3]),
            fc1_shard(expected[4]), _part(expected[5], 1, rank, tp), expected[6]]
    names = ("out", "dx", "d_ln_weight", "d_fc1_weight", "d_fc1_bias", "d_fc2_weight",
             "d_fc2_bias")
    errors = {}
    for n, got, ref_t in zip(names, eager[0], want):
        assert got.shape == ref_t.shape, f"{label} {n}: {tuple(got.shape)} vs {tuple(ref_t.shape)}"
        errors[n] = rel_err(got, ref_t)
        assert errors[n] <= MLP_REL_TOL[name], f"{label}: {n} rel. error {errors[n]:.4f}"
    return errors


def mlp_worker(group, cases, compile_mode):
    for sp, name, activation in cases:
        mlp_case(group, torch.device("cpu"), sp, name, compile_mode, activation=activation)


# -- entry points ------------------------------------------------------------------------
def spawn_main(rank, world_size, store_path, fn, args):
    """``torch.multiprocessing.spawn`` target for the CPU tests (gloo): runs
    ``fn(group, *args)`` on every rank."""
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        fn(group, *args)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo group still referenced
    # (by a compiled graph's guards, a layer) is torn down there with its
    # worker threads, which can abort the process (SIGABRT, "terminate called
    # without an active exception") after the test passed.  Failures above
    # still propagate through spawn's own error path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args, world_size=2):
    """Run ``fn(group, *args)`` on ``world_size`` CPU processes; re-raises
    the first rank's exception."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(spawn_main, args=(world_size, os.path.join(d, "store"), fn, args),
                 nprocs=world_size, join=True)


def shared_gather_case(group, device, name, exact=True) -> None:
    """Two column-parallel SP layers reading one input (q and k), compiled
    with inductor (lowered): the second takes the first's gathered
    quantized input, so the forward holds one all-gather (and for FP8
    current scaling one amax all-reduce); the outputs and gradients equal
    eager's, bit for bit where ``exact`` (CUDA), else within FP8 rounding."""
    from torch._inductor.utils import run_and_get_code

    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    n, rec = 128 * tp, recipe_of(name)

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleList(
            te.Linear(n, n, bias=False, params_dtype=torch.bfloat16, parallel_mode="column",
                      sequence_parallel=True, tp_group=group, device=device) for _ in range(2))

    layers, copies = build(), build()
    torch.manual_seed(1)
    x_in = torch.randn(64, n, dtype=torch.bfloat16, device=device).chunk(tp)[rank]

    def fwd(mods, x):
        with te.autocast(recipe=rec):
            return mods[0](x) + mods[1](x)

    def step(mods, f):
        x = x_in.clone().requires_grad_()
        y = f(mods, x)
        y.float().square().sum().backward()
        return [y, x.grad, *[p.grad for p in mods.parameters()]]

    want = step(layers, fwd)
    compiled = torch.compile(fwd, fullgraph=True, backend="inductor")
    got, code = run_and_get_code(step, copies, compiled)
    for i, (a, b) in enumerate(zip(want, got)):
        if exact:
            assert torch.equal(a, b), f"{name} shared gather: compiled != eager (tensor {i})"
        else:
            assert rel_err(b, a) < 0.1, f"{name} shared gather: tensor {i} off by {rel_err(b, a)}"
    forward = code[0]
    assert forward.count("_c10d_functional.all_gather_into_tensor.default(") == 1, name
    # inductor runs the functional all-reduce in place where it may
    reduces = sum(forward.count(f"_c10d_functional.{op}.default(")
                  for op in ("all_reduce", "all_reduce_"))
    assert reduces == (1 if name == "fp8_current" else 0), (name, reduces)


def cases_worker(group, cases, compile_mode, seq=SEQ):
    run_cases(group, torch.device("cpu"), cases, compile_mode, seq=seq)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"])
    parser.add_argument("--recipes", nargs="+", default=[*RECIPES, "delayed"])
    parser.add_argument("--parallel", nargs="+", default=[f"{m}:{int(sp)}" for m, sp in
                                                           PARALLEL_CASES],
                        help="parallel_mode:sequence_parallel pairs, e.g. row:1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, nargs="+", default=[SEQ],
                        help=f"sequence lengths (x {BATCH} tokens; ragged counts welcome)")
    args = parser.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    fit_sizes(dist.get_world_size())
    group = dist.new_group(list(range(dist.get_world_size())))
    parallel = [(p.split(":")[0], bool(int(p.split(":")[1]))) for p in args.parallel]
    cases = [(m, sp, r) for m, sp in parallel for r in args.recipes]
    failures = 0
    for mode, seq in ((mode, seq) for mode in args.modes for seq in args.seq):
        for case in cases:
            try:
                (_, errs), = run_cases(group, device, [case], mode, args.steps, seq)
                status = "ok   " + " ".join(f"{k}={v:.4f}" for k, v in errs.items())
            except AssertionError as e:
                failures += 1
                status = f"FAIL {e}"
            if dist.get_rank() == 0 or status.startswith("FAIL"):
                m, sp, r = case
                print(f"rank {dist.get_rank()} {mode:16s} seq={seq:<4d} {m:6s} sp={int(sp)} "
                      f"{r:12s} {status}",
                      flush=True)
    if "default" in args.modes and ("column", True) in parallel:
        for name in ("fp8_current", "fp8_block"):
            if name not in args.recipes:
                continue
            try:
                shared_gather_case(group, device, name, exact=device.type == "cuda")
                status = "ok"
            except AssertionError as e:
                failures += 1
                status = f"FAIL {e}"
            if dist.get_rank() == 0 or status.startswith("FAIL"):
                print(f"rank {dist.get_rank()} default shared gather {name:12s} {status}",
                      flush=True)
    _log(f"rank {dist.get_rank()}: cases done")
    # drop the compiled functions and their CUDA graphs (which hold captured
    # NCCL kernels) before tearing the communicators down
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    _log(f"rank {dist.get_rank()}: barrier passed")
    dist.destroy_process_group()
    _log("process group destroyed")
    if failures:
        sys.exit(f"{failures} failing case(s)")


if __name__ == "__main__":
    main()
