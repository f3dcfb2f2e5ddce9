"""``te.Linear``'s two custom ops (``te_compile::linear_fwd`` / ``linear_bwd``).

The generator (``dynamo/custom_op.py``) flattens the arguments
(``linear/args.py``) into the ops' schemas and runs the impls of
``linear/compute.py``; here they are registered with their fakes, the
lowering rules (``linear/lowering.py``) and the ops' short paths: without a
recipe the plain path (``linear/plain.py``), with one the native plan
(``linear/native_ops.py``).
"""

from __future__ import annotations

from ...dynamo.custom_op import register_custom_op
from . import plain as linear_plain_ops
from .args import LinearBwdArgs, LinearFwdArgs
from .lowering import _lowers_backward, _lowers_forward
from .compute import (BACKWARD_UPDATES, FORWARD_UPDATES, linear_backward, linear_backward_fake,
                      linear_forward, linear_forward_fake, linear_setup_context)


def _native_forward(pair, decoder, flat, args):
    """The forward op's short paths: without a recipe linear/plain.py,
    with one the native impl (linear/native_ops.py, imported on first use:
    it builds the native extension's plans); None runs the Python impl."""
    out = linear_plain_ops.forward(args) if args.input_quantizer is None else None
    return out if out is not None else _native_ops().forward(pair, decoder, flat, args)


def _native_backward(pair, decoder, flat, args):
    """The backward op's: without a recipe the native impl only where the
    bias takes a gradient (its two launches from C++; the rest costs the
    same either way, ``benchmarks --configs host`` on an H200), else
    linear/plain.py."""
    plain = args.grad_output_quantizer is None and args.input_quantizer is None
    if plain and not args.bias_requires_grad:
        return linear_plain_ops.backward(args)
    out = _native_ops().backward(pair, decoder, flat, args)
    return out if out is not None or not plain else linear_plain_ops.backward(args)


_NATIVE_OPS = []


def _native_ops():
    if not _NATIVE_OPS:
        from . import native_ops as linear_native_ops
        _NATIVE_OPS.append(linear_native_ops)
    return _NATIVE_OPS[0]


LINEAR_OPS = register_custom_op(
    "linear",
    fwd_args=LinearFwdArgs, bwd_args=LinearBwdArgs,
    forward=linear_forward, forward_fake=linear_forward_fake,
    backward=linear_backward, backward_fake=linear_backward_fake,
    setup_context=linear_setup_context,
    grad_fields={"grad_output": "out"},
    forward_updates=FORWARD_UPDATES, backward_updates=BACKWARD_UPDATES,
    lower_forward=_lowers_forward, lower_backward=_lowers_backward,
    native_forward=_native_forward, native_backward=_native_backward,
)
