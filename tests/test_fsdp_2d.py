"""2-D parallelism on CPU: tensor parallel (``te.Linear`` column -> row over
``mesh["tp"]``) x FSDP2 (``te.fsdp.fully_shard`` over ``mesh["dp"]``), 4 gloo
processes as a 2 x 2 ``(dp, tp)`` DeviceMesh.

The cases live in fsdp2d_harness.py.  Every recipe and SP setting runs in
one spawn (starting 4 processes costs ~18 s on a 2-core machine; the whole
test 37-63 s there).  Worker functions are module level so that
``torch.multiprocessing.spawn`` can pickle them.
"""

import pytest
import torch

import transformer_engine_compile as te

import fsdp2d_harness as F2
import tp_harness as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")

CASES = [(name, sp) for name in F2.NAMES for sp in (False, True)]


def cases_worker(group, cases, backend):
    mesh = F2.make_mesh("cpu", 2, 2)
    # the 2-D mesh itself is refused: torch's fully_shard would take it for HSDP
    with pytest.raises(ValueError, match=r"pass mesh\['dp'\]"):
        te.fsdp.fully_shard(F2.build("cpu", mesh["tp"].get_group()), mesh=mesh)
    F2.run_cases(mesh, cases, torch.device("cpu"), backend)


def test_fsdp_2d_training_equals_single_process():
    """bf16, FP8 current scaling, FP8 blockwise and DelayedScaling, with and
    without sequence parallelism: quantized dp gather == bf16 dp gather and
    compiled (per layer, fullgraph, aot_eager) == eager, bit for bit; the
    full model on one process within the format's error; FP8 gathers ~0.5x
    of bf16's bytes over the dp group; DelayedScaling scales identical on
    all 4 ranks (amaxes reduced over every rank)."""
    H.spawn(cases_worker, CASES, "aot_eager", world_size=4)


def checkpoint_worker(group, path):
    mesh = F2.make_mesh("cpu", 2, 2)
    for name in ("fp8_current", "delayed"):
        F2.run_checkpoint(mesh, name, torch.device("cpu"), f"{path}-{name}")
    F2.run_layernorm_checkpoint(mesh, torch.device("cpu"), f"{path}-ln")


def test_fsdp_2d_distributed_checkpoint(tmp_path):
    """DCP save / load of the 2 x 2 model restores every TP shard (a fresh
    2-D model, then one more step bit-identical; the full model sharded over
    4 ranks; the full state dict), FP8 current scaling with its quantized
    gather and DelayedScaling with its layer state; the LayerNorm modules'
    shards; a gated LayerNormMLP refused."""
    H.spawn(checkpoint_worker, str(tmp_path / "ckpt"), world_size=4)
