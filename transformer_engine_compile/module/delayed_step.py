"""Delayed scaling's step inside the ops: this call's amax vector, the
update of a GEMM's amax history and scale (run after the call's last cast,
or launched on its own, the amaxes reduced over the amax group first), and
the update outputs that write them back into the module buffers
(``dynamo/custom_op.py``'s updates).  Shared by ``te.Linear``'s and
``te.GroupedLinear``'s ops."""

from __future__ import annotations

import torch

from .. import distributed as D
from .. import kernels
from ..dynamo.tensor_proto import TensorProto
from ..kernels import tracing
from ..kernels.reference import STEP_COUNTER


def zero_amaxes(history):
    """This step's amaxes, zeroed: one per history column, and at
    ``STEP_COUNTER`` the counter of a step the last quantization runs
    (``StepAfter``); None without state."""
    return None if history is None else torch.zeros(STEP_COUNTER + 1, dtype=torch.float32,
                                                    device=history.device)


def delayed_updates(q, history, scale, amaxes, prefix: str, group=None, step=None) -> dict:
    """Outputs that update the delayed-scaling buffers ``history`` and
    ``scale`` (the ops' ``*_updates``): those of ``step`` when a
    quantization ran it (:func:`step_after_last_cast`), else of a step
    launched here, with the amaxes reduced over ``group`` first.  New
    objects (an op returns none of its inputs; inside a lowered trace the
    step writes over the buffers themselves, see the quantizer's
    ``step_after``); none in the eager path,
    where the step wrote the buffers themselves."""
    if history is None:
        return {}
    if step is None:
        amaxes = amaxes[:history.shape[1]]
        if group is not None:
            amaxes = D.all_reduce_max(amaxes, group)
        step = q.step_after(history, scale)
        kernels.get("run_step", history)(step, amaxes)
    if tracing.eager_in_place():
        return {}
    return {f"amax_history_{prefix}": step.new_history.view(step.history.shape),
            f"scale_{prefix}": step.new_scale.view(step.new_scale.shape)}


def delayed_updates_fake(history, prefix: str) -> dict:
    if history is None:
        return {}
    return {f"amax_history_{prefix}": TensorProto(history.shape, history.dtype,
                                                  device=history.device),
            f"scale_{prefix}": TensorProto(history.shape[1:], history.dtype,
                                           device=history.device)}


def step_after_last_cast(q, history, scale, group):
    """The delayed-scaling step for the op call's last quantization to run
    (``StepAfter``, one launch fewer), or None: without state, with an amax
    group (the amaxes are all-reduced between the two), or while a CUDA
    graph is captured (a replay costs no launches, and on the GPU the fused
    step is the slower, measured on an H200)."""
    if history is None or group is not None or (
            history.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return q.step_after(history, scale)
