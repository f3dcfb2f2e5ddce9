"""``te.GroupedLinear``'s two custom ops (``te_compile::grouped_linear_fwd`` /
``grouped_linear_bwd``), generated from its arguments (``args.py``) with the
impls and fakes of ``compute.py``."""

from __future__ import annotations

from ...dynamo.custom_op import register_custom_op
from .args import GroupedLinearBwdArgs, GroupedLinearFwdArgs
from .compute import (BACKWARD_UPDATES, FORWARD_UPDATES, grouped_linear_backward, grouped_linear_backward_fake,
                      grouped_linear_forward, grouped_linear_forward_fake,
                      grouped_linear_setup_context)

GROUPED_LINEAR_OPS = register_custom_op(
    "grouped_linear",
    fwd_args=GroupedLinearFwdArgs, bwd_args=GroupedLinearBwdArgs,
    forward=grouped_linear_forward, forward_fake=grouped_linear_forward_fake,
    backward=grouped_linear_backward, backward_fake=grouped_linear_backward_fake,
    setup_context=grouped_linear_setup_context,
    grad_fields={"grad_output": "out"},
    forward_updates=FORWARD_UPDATES, backward_updates=BACKWARD_UPDATES,
)
