"""Activation checkpointing: ``te.checkpoint``, and how ``te.Linear`` repeats
a checkpointed forward exactly.

A recomputation must compute what the forward it replaces computed: with the
same recipe (``te.autocast`` may be outside the checkpointed function, hence
no longer active when the backward recomputes) and, under
``DelayedScaling``, with the same scales and without recording the amaxes a
second time.  So each ``te.Linear`` call in a checkpointed forward appends a
record (the layer, the ``te.autocast`` state, the forward scales it used) to
its region's :class:`Recording`, and the recomputation replays the records
in call order.  A region is ``te.checkpoint``'s own (passed to torch through
the public ``context_fn``) or, for a direct ``torch.utils.checkpoint`` call,
the one :func:`~.compat.checkpoint_region` finds; its records live
and die with it.

Compiled code records nothing: under ``torch.compile`` the checkpointed
function is traced once and the recomputation is a copy of its graph nodes
(AOTAutograd's partitioner), with the recipe of the trace.  But a copy of a
``DelayedScaling`` forward op would read the scale buffers after the
forward's update; so compiled ``te.checkpoint`` passes torch a selective
checkpointing policy that saves those ops' outputs instead of recomputing
them (everything else in the region is recomputed), and a compiled
recomputation of such an op that reaches the op anyway (a direct
``torch.utils.checkpoint`` call) is refused (:func:`check_forward_op_in_backward`).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint as _torch_checkpoint,
                                    create_selective_checkpoint_contexts)

from .autocast import _set_state, current_state
from . import compat


class _Record:
    """One ``te.Linear`` call of a checkpointed forward.  ``native``: whether
    the forward ran on the native eager path (kernels/native.py), which the
    recomputation repeats: torch's non-reentrant checkpoint requires the
    recomputation to save the very tensors the forward saved."""

    __slots__ = ("layer", "state", "scale_fwd", "native")

    def __init__(self, layer, state):
        self.layer, self.state, self.scale_fwd = layer, state, {}  # GEMM prefix -> scales
        self.native = False


class Recording:
    """The records of one checkpointed region, and a replay cursor that
    restarts with each recomputation pass (``token``)."""

    def __init__(self):
        self.records: list[_Record] = []
        self._pass, self._next = None, 0

    def record(self, layer) -> "_Call":
        rec = _Record(layer, current_state())
        self.records.append(rec)
        return _Call(rec, replay=False)

    def replay(self, layer, token) -> "_Call":
        if token is not self._pass:
            self._pass, self._next = token, 0
        if self._next >= len(self.records) or self.records[self._next].layer is not layer:
            raise RuntimeError(
                "te.Linear: the checkpointed function's recomputation called the te layers "
                "in a different order (or more often) than its forward; activation "
                "checkpointing needs a forward that repeats itself")
        rec = self.records[self._next]
        self._next += 1
        return _Call(rec, replay=True)


class _Call:
    """Context of one layer call in a region: on a replay it restores the
    recorded ``te.autocast`` state, and :meth:`bind` gives the op the
    recorded forward scales and a scratch amax history."""

    def __init__(self, rec: _Record, replay: bool):
        self.rec, self.replay, self._saved = rec, replay, None

    def __enter__(self):
        if self.replay:
            self._saved = current_state()
            _set_state(self.rec.state)
            _REPLAYING.append(self)
        return self

    def __exit__(self, *exc):
        if self.replay:
            _REPLAYING.pop()
            _set_state(self._saved)
        return False

    def bind(self, args, prefixes=("",)) -> None:
        """Called with the forward op's arguments once the layer state is
        bound; ``prefixes``: of each GEMM's ``scale_fwd`` / ``amax_history_fwd``
        fields (``("fc1_", "fc2_")`` for LayerNormMLP)."""
        for p in prefixes:
            scale = getattr(args, p + "scale_fwd")
            if scale is None:
                continue
            if not self.replay:
                self.rec.scale_fwd[p] = scale.clone()  # the op updates it in place
                continue
            # scratch copies: the op writes its (discarded) update into them
            setattr(args, p + "scale_fwd", self.rec.scale_fwd[p].clone())
            setattr(args, p + "amax_history_fwd", getattr(args, p + "amax_history_fwd").clone())


class _RegionContext:
    """``te.checkpoint``'s forward or recomputation context (re-enterable:
    a backward with ``retain_graph=True`` recomputes again)."""

    def __init__(self, recording: Recording, phase: str):
        self.recording, self.phase = recording, phase

    def __enter__(self):
        _ACTIVE.append((self.recording, self.phase, object()))
        return self

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return False


# te.checkpoint regions being run, innermost last (a stack, as autocast's state),
# and the layer calls being replayed
_ACTIVE: list = []
_REPLAYING: list = []


def check_forward_op_in_backward(args) -> None:
    """Refuse a ``DelayedScaling`` forward op run inside a backward pass
    other than by a replay: a compiled recomputation (``torch.utils.checkpoint``
    under ``torch.compile``) or a reentrant checkpoint's, which would quantize
    with the scales the forward has since updated and record the amaxes twice."""
    if args.scale_fwd is None or _REPLAYING or not compat.in_backward_pass():
        return
    raise RuntimeError(
        "te.Linear: a DelayedScaling forward is being recomputed inside a backward without "
        "the scales of the forward it repeats (torch.utils.checkpoint under torch.compile, or "
        "use_reentrant=True), which would quantize with the scales the forward has since "
        "updated; use te.checkpoint (which saves these ops' outputs under torch.compile), or "
        "a recipe without delayed scaling")


def layer_call(layer):
    """The checkpointing context of a ``te.Linear`` call: a ``_Call`` inside
    an eager checkpointed forward or recomputation, else None."""
    if torch.compiler.is_compiling():
        return None
    if not torch.is_grad_enabled():
        # a reentrant checkpoint runs its forward under no_grad (a walk up
        # the stack, a few us, in eager no_grad calls only)
        found = compat.reentrant_checkpoint_region()
        if found is None or found[1] != "forward":
            return None
    elif _ACTIVE:
        found = _ACTIVE[-1]
    else:
        found = compat.checkpoint_region()
        if found is None and compat.in_backward_pass():
            found = compat.reentrant_checkpoint_region()
        if found is None:
            return None
    owner, phase, token = found
    recording = owner if isinstance(owner, Recording) else _recording_of(owner)
    return recording.record(layer) if phase == "forward" else recording.replay(layer, token)


def _recording_of(region) -> Recording:
    """The recording kept on a torch checkpoint's frame or autograd context."""
    recording = getattr(region, "_te_compile_recording", None)
    if recording is None:
        recording = region._te_compile_recording = Recording()
    return recording


def _contexts():
    recording = Recording()
    return _RegionContext(recording, "forward"), _RegionContext(recording, "recompute")


def _stateful_forward_op(op, args) -> bool:
    """A generated forward op (``te_compile::*_fwd``) called with a
    ``DelayedScaling`` quantizer: its state updates make it unsafe to repeat."""
    from .dynamo.buckets import QuantizerSlot
    from .dynamo.custom_op import NAMESPACE
    from .quantization.float8 import Float8DelayedScalingQuantizer

    if getattr(op, "namespace", None) != NAMESPACE or not op._opname.endswith("_fwd"):
        return False
    return any(isinstance(a, QuantizerSlot)
               and isinstance(a.quantizer, Float8DelayedScalingQuantizer) for a in args)


def _compiled_policy(ctx, op, *args, **kwargs):
    if _stateful_forward_op(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_COMPILED_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, _compiled_policy)


def checkpoint(function, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True,
               **kwargs):
    """Activation checkpointing (Transformer Engine's ``te.checkpoint``):
    run ``function(*args, **kwargs)`` keeping only its inputs, and recompute
    it in the backward with the recipe and ``DelayedScaling`` scales of this
    forward (``te.autocast`` inside or outside ``function``).

    Always torch's non-reentrant checkpoint: ``use_reentrant`` is accepted
    for Transformer Engine's signature (gradients are the same either way).
    ``distribute_saved_activations`` and ``get_rng_state_tracker`` (Megatron's
    CUDA RNG tracker) are not supported; ``tp_group`` is only used by them.
    """
    del use_reentrant, tp_group
    if distribute_saved_activations:
        raise NotImplementedError("te.checkpoint: distribute_saved_activations=True is not "
                                  "supported")
    if get_rng_state_tracker is not None:
        raise NotImplementedError("te.checkpoint: get_rng_state_tracker is not supported; "
                                  "torch's RNG state is restored for the recomputation")
    if torch.compiler.is_compiling():  # torch.compile takes only selective-checkpoint contexts
        return _torch_checkpoint(function, *args, use_reentrant=False,
                                 context_fn=_COMPILED_CONTEXTS, **kwargs)
    return _torch_checkpoint(function, *args, use_reentrant=False, context_fn=_contexts,
                             **kwargs)
