"""Tensor / sequence-parallel te.Linear on CPU: 2 gloo processes per test.

The cases themselves live in tp_harness.py (shared with the 2-GPU NCCL run
in qa/L1_distributed).  Worker functions here are module level so that
``torch.multiprocessing.spawn`` can pickle them.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import distributed as D
from transformer_engine_compile.module.linear import compute as L
from transformer_engine_compile.module.linear.args import LinearFwdArgs, _grad_output_quantizer
from transformer_engine_compile.module.linear.ops import LINEAR_OPS

import tp_harness as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


# -- compiled TP == eager TP == single device ----------------------------------------------
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("parallel_mode", ["column", "row"])
def test_tp_compiled_equals_eager_and_single_device(parallel_mode, sp):
    """Every CPU recipe: fullgraph, one graph, compiled == eager TP bit for bit,
    TP == single-device layer (bf16 exactly, quantized within REL_TOL), and
    the compiled graphs hold the ops but no collective."""
    H.spawn(H.cases_worker, [(parallel_mode, sp, name) for name in H.RECIPES], "record")


@pytest.mark.parametrize("parallel_mode", ["column", "row"])
def test_tp_sp_ragged_token_count(parallel_mode):
    """Sequence parallel at 2 x 100 tokens (each rank's shard 100 tokens):
    not a multiple of any block, so the gathered (column) or reduce-scattered
    (row) copies of the block recipes are padded inside the ops."""
    H.spawn(H.cases_worker, [(parallel_mode, True, name) for name in H.RECIPES], "record", 100)


def test_tp_inductor():
    H.spawn(H.cases_worker, [("column", True, "bf16"), ("row", True, "fp8_current")],
            "default")


def lowered_worker(group):
    """Lowering on for the CPU (as CUDA has it): the harness's cases compiled
    with inductor equal eager bit for bit, and a layer without a bias
    (whose calls lower on the CPU) leaves no te op in the generated code,
    its collectives there as torch's functional ones."""
    from torch._inductor.utils import run_and_get_code

    from transformer_engine_compile.dynamo import lowering

    previous = lowering.set_lowered_devices({"cpu"})
    torch._dynamo.reset()
    try:
        H.cases_worker(group, [("column", True, "bf16"), ("column", True, "fp8_current"),
                               ("row", True, "fp8_current"), ("row", False, "fp8_current")],
                       "default")
        # te.LayerNormMLP's ops (the norm's weight-gradient all-reduce too)
        H.mlp_worker(group, [(True, "fp8_current", "swiglu"), (False, "bf16", "gelu")],
                     "default")
        rank, tp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        for parallel_mode in ("column", "row"):
            torch.manual_seed(0)
            layer = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16,
                              parallel_mode=parallel_mode, sequence_parallel=True,
                              tp_group=group)
            rec = te.recipe.Float8CurrentScaling()
            x_full = torch.randn(32, 64, dtype=torch.bfloat16)
            x_in = x_full.chunk(tp)[rank] if parallel_mode == "column" else \
                x_full[:, rank * 32:(rank + 1) * 32]

            def fwd(x):
                with te.autocast(recipe=rec):
                    return layer(x)

            compiled = torch.compile(fwd, fullgraph=True, backend="inductor")

            def step(x):
                y = compiled(x)
                y.float().square().sum().backward()  # the backward compiles here too

            _, code = run_and_get_code(step, x_in.clone().requires_grad_())
            text = "\n".join(code)
            left = re.findall(r"torch\.ops\.te_compile\.linear_\w+\.default\(", text)
            assert not left, (parallel_mode, left)
            wanted = ("all_gather_into_tensor", "reduce_scatter_tensor")
            assert all(f"_c10d_functional.{c}" in text for c in wanted), parallel_mode
        for name in ("fp8_current", "fp8_block"):
            # CPU lowering traces the reference casts, which inductor may fuse
            # otherwise than eager rounds: bit for bit on CUDA (qa/L1_distributed)
            H.shared_gather_case(group, torch.device("cpu"), name, exact=False)
    finally:
        lowering.set_lowered_devices(previous)
        torch._dynamo.reset()


def test_tp_lowered_into_inductor():
    H.spawn(lowered_worker)


def test_tp_calls_stay_ops_for_cuda_graphs(monkeypatch):
    """Under ``mode="reduce-overhead"`` a call with a process group stays an
    op (its collectives inside it); without one it lowers as before."""
    from transformer_engine_compile import compat
    from transformer_engine_compile.dynamo import lowering

    previous = lowering.set_lowered_devices({"cpu"})
    try:
        group = object()  # only its presence is read
        with_group = LinearFwdArgs(inp=torch.zeros(2, 4), weight=torch.zeros(4, 4),
                                   parallel_mode="column", tp_size=2, tp_group=group)
        plain = LinearFwdArgs(inp=torch.zeros(2, 4), weight=torch.zeros(4, 4))
        op, plan = LINEAR_OPS.fwd_op, LINEAR_OPS.fwd_plan
        for graphs, expected in ((False, True), (True, False)):
            monkeypatch.setattr(compat, "compiling_for_cuda_graphs", lambda: graphs)
            assert lowering.lowerable(op, with_group, plan, lambda a: True) is expected
            assert lowering.lowerable(op, plain, plan, lambda a: True)
    finally:
        lowering.set_lowered_devices(previous)


def delayed_worker(group):
    H.cases_worker(group, [(m, sp, "delayed") for m, sp in H.PARALLEL_CASES], "record")
    H.mlp_worker(group, [(sp, "delayed", "swiglu") for sp in (False, True)], "record")
    for parallel_mode, sp in H.PARALLEL_CASES:
        H.delayed_state_case(group, torch.device("cpu"), parallel_mode, sp)


def test_tp_delayed_scaling():
    """DelayedScaling with TP (amaxes reduced over the TP group): column /
    row x SP and LayerNormMLP x SP, compiled == eager TP bit for bit over 3
    steps, one graph, TP == single device at step 0 (scale 1 on both: the
    same FP8 values, other summation orders), and the amax histories and
    scales equal the single-device layer's after 2 steps."""
    H.spawn(delayed_worker)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_tp_layernorm_mlp(sp):
    """te.LayerNormMLP(set_parallel_mode=True): fc1 column-, fc2 row-parallel
    (SP: the normalised input all-gathered, the output reduce-scattered, the
    norm's gradients summed): compiled == eager TP bit for bit, one graph,
    and TP == the single-device module at step 0."""
    H.spawn(H.mlp_worker, [(sp, "bf16", "swiglu"), (sp, "mxfp8", "gelu"),
                           (sp, "fp8_current", "swiglu")], "record")


# -- fakes, opcheck -------------------------------------------------------------------------
def _tp_args(group, parallel_mode, sp, name, save_original_input=False):
    """LinearFwdArgs of rank's shard (shapes as in tp_harness) and a matching dy."""
    tp = torch.distributed.get_world_size(group)
    rec = H.RECIPES[name]
    local_seq = H.SEQ // tp if sp else H.SEQ
    if parallel_mode == "column":
        x_shape, w_shape, b_len = (local_seq, H.BATCH, H.IN), (H.OUT // tp, H.IN), H.OUT // tp
        dy_shape = (H.SEQ, H.BATCH, H.OUT // tp)
    else:
        x_shape, w_shape, b_len = (H.SEQ, H.BATCH, H.IN // tp), (H.OUT, H.IN // tp), H.OUT
        dy_shape = (local_seq, H.BATCH, H.OUT)
    args = LinearFwdArgs(
        inp=torch.randn(x_shape, dtype=torch.bfloat16),
        weight=torch.randn(w_shape, dtype=torch.bfloat16),
        bias=torch.randn(b_len, dtype=torch.bfloat16),
        input_requires_grad=True, weight_requires_grad=True, bias_requires_grad=True,
        save_original_input=save_original_input, parallel_mode=parallel_mode,
        sequence_parallel=sp, tp_size=tp, tp_group=group)
    if rec is not None:
        args.input_quantizer = te.quantizer_for(rec, "input", internal=True)
        args.weight_quantizer = te.quantizer_for(rec, "weight", internal=True)
        args.grad_output_quantizer = te.quantizer_for(rec, "grad_output", internal=True)
    return args, torch.randn(dy_shape, dtype=torch.bfloat16)


def parity_worker(group):
    from test_linear_ops import _assert_parity, _describe

    ops = LINEAR_OPS
    tp = torch.distributed.get_world_size(group)
    for parallel_mode, sp in H.PARALLEL_CASES:
        for name in H.RECIPES:
            for soi in (False, True):
                torch.manual_seed(0)
                args, dy = _tp_args(group, parallel_mode, sp, name, soi)
                protos = ops.fwd_plan.to_protos(args)
                real, fake = L.linear_forward(args), L.linear_forward_fake(protos)
                where = f"{parallel_mode} sp={sp} {name} save_original_input={soi}"
                _assert_parity(real, fake, args, protos, ops.fwd_plan.tensor_fields)
                # the leading dim: all-gather multiplies it, reduce-scatter divides it
                seq = args.inp.shape[0]
                want = {("column", True): seq * tp, ("row", True): seq // tp}.get(
                    (parallel_mode, sp), seq)
                assert fake.outputs["out"].shape[0] == want, where
                bwd = ops.make_bwd_args(real.saved, L.linear_setup_context(args),
                                        {"grad_output": dy})
                bwd_real = L.linear_backward(bwd)
                bwd_fake = L.linear_backward_fake(ops.bwd_plan.to_protos(bwd))
                for k in bwd_real:
                    assert _describe(bwd_real[k]) == _describe(bwd_fake[k]), (where, k)
                assert bwd_real["inp"].shape == args.inp.shape, where


def opcheck_worker(group):
    from test_linear_ops import opcheck

    ops = LINEAR_OPS
    for parallel_mode, sp in H.PARALLEL_CASES:
        for name in ("bf16", "fp8_current"):
            torch.manual_seed(0)
            args, dy = _tp_args(group, parallel_mode, sp, name)
            args.inp.requires_grad_()
            opcheck(ops.fwd_op, ops.fwd_plan.encode(args), name != "bf16")
            real = L.linear_forward(args)
            args.inp.requires_grad_(False)
            bwd = ops.make_bwd_args(real.saved, L.linear_setup_context(args), {"grad_output": dy})
            opcheck(ops.bwd_op, ops.bwd_plan.encode(bwd), name != "bf16")


def test_tp_fakes_match_the_real_layout():
    """Shapes, strides, dtypes and buffers of every output and saved tensor,
    for column/row x SP x every recipe x save_original_input."""
    H.spawn(parity_worker)


def test_tp_opcheck():
    H.spawn(opcheck_worker)


# -- FP8 current scaling: one scale for the whole gathered tensor ----------------------------
def fp8_gather_worker(group):
    rank = torch.distributed.get_rank(group)
    torch.manual_seed(0)
    full = torch.randn(64, 2, 32, dtype=torch.bfloat16)
    full[5, 1, 7] = 40.0  # the amax lives on rank 0's shard only
    q = te.Float8CurrentScalingQuantizer("e4m3", internal=True)
    total_hp, total_q = D.gather_and_quantize(full.chunk(2)[rank], q, group, 2)
    want = q.quantize(full)
    assert total_hp is None
    for name, buf in want.buffers().items():
        assert torch.equal(total_q.buffers()[name].view(torch.uint8)
                           if buf.element_size() == 1 else total_q.buffers()[name],
                           buf.view(torch.uint8) if buf.element_size() == 1 else buf), name


def test_fp8_current_gather_equals_quantizing_the_whole_tensor():
    """The amax is all-reduced before the shards are quantized, so the gathered
    bytes, transpose and scale equal single-device quantization exactly."""
    H.spawn(fp8_gather_worker)


# -- errors ------------------------------------------------------------------------------
def errors_worker(group):
    bf16 = dict(params_dtype=torch.bfloat16, tp_group=group)
    with pytest.raises(ValueError, match=r"sequence length 3 .* divisible by tp_size 2"):
        te.Linear(64, 64, parallel_mode="row", sequence_parallel=True, **bf16)(
            torch.randn(3, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"splits out_features \(63\) over tp_size 2"):
        te.Linear(64, 63, parallel_mode="column", **bf16)
    with pytest.raises(ValueError, match=r"splits in_features \(63\) over tp_size 2"):
        te.Linear(63, 64, parallel_mode="row", **bf16)
    with pytest.raises(ValueError, match="tp_size=4 but tp_group has 2 ranks"):
        te.Linear(64, 64, parallel_mode="row", tp_size=4, **bf16)
    with pytest.raises(ValueError, match="must end in 32 .this rank's shard of in_features"):
        te.Linear(64, 64, parallel_mode="row", **bf16)(torch.randn(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs a sequence dimension"):
        te.Linear(64, 64, parallel_mode="column", sequence_parallel=True, **bf16)(
            torch.randn(64, dtype=torch.bfloat16))
    # the gathered input (2 x 3 rows: any count) must fit the recipe's blocks in its columns
    layer = te.Linear(48, 64, parallel_mode="column", sequence_parallel=True, **bf16)
    with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
        with pytest.raises(ValueError, match="input as a 6 x 48 matrix .* needs the columns divisible by 32$"):
            layer(torch.randn(3, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a weight of shape"):
        layer.load_full_weight_(torch.randn(32, 64))


def test_tp_bad_input_errors():
    H.spawn(errors_worker)


# -- single process -----------------------------------------------------------------------
def test_shard_parameter():
    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(D.shard_parameter(w, "column", 1, 2), w[2:])
    assert torch.equal(D.shard_parameter(w, "row", 0, 2), w[:, :3])
    b = w[0]
    assert D.shard_parameter(b, "row", 1, 2, is_bias=True) is b
    assert D.shard_parameter(w, None, 1, 2) is w
    with pytest.raises(ValueError, match="not divisible by tp_size 4"):
        D.shard_parameter(w, "row", 0, 4)


def test_parallel_mode_without_a_group_is_a_plain_layer():
    """tp_size 1 (TE's default): no split, no collective, same numbers."""
    torch.manual_seed(0)
    plain = te.Linear(32, 16, params_dtype=torch.bfloat16)
    for mode in ("column", "row"):
        layer = te.Linear(32, 16, params_dtype=torch.bfloat16, parallel_mode=mode)
        layer.load_full_weight_(plain.weight, plain.bias)
        x = torch.randn(4, 32, dtype=torch.bfloat16)
        assert layer.weight.shape == (16, 32)
        assert torch.equal(layer(x), plain(x))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on GPU machines qa/L1_distributed runs the demo with NCCL")
def test_torchrun_example_runs():
    """docs/parallel.md's example, as written there, on 2 CPU processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on CPU
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "transformer_engine_compile.demos.parallel", "--steps", "3"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TP == single device: True" in proc.stdout, proc.stdout
