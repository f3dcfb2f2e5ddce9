"""The eager layers' argument memo and the native eager path's entry.

An eager layer called again in a configuration it ran recently (the memo
key: ``te.Linear._memo_key``, ``te.LayerNormMLP._memo_key``) reuses the
arguments it checked and built then, skipping the checks and the
dataclass; an entry also carries the configuration's native plan (the
layer's ``_native_plan``: module/linear/native.py,
layernorm/linear_native.py, layernorm/mlp_native.py), asked for at the
entry's second call.  The memo lives in the layer's ``__dict__`` as
``(parameters, {key: ArgsTemplate})``: the parameter objects it was made
for (the layer's ``_memo_parameters()``) and the last
:data:`MEMO_ENTRIES` configurations.  Copies and pickles of a layer leave
it behind (the layers' ``__getstate__``).
"""

from __future__ import annotations

import operator

from ..dynamo import arg_views
from ..kernels import native
from ..quantization.base import storage_parts

# configurations the argument memo keeps per layer (the oldest goes first): a
# reentrant checkpoint's no-grad forward and its recomputation, training and
# evaluation steps, two input shapes, each keep their entry
MEMO_ENTRIES = 4

_STATE_FIELDS = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")


class ArgsTemplate:
    """The arguments of an eager call, less the tensors each call supplies
    (``names``: the input, and the parameters as the GEMMs take them, which
    torch.autocast casts anew every call): what the layer's ``_make_args``
    worked out (checks passed, quantizers, flags, and under DelayedScaling
    the layer's state buffers it bound; with ``is_first_microbatch`` its
    FP8 weight cache; with ``fuse_wgrad_accumulation`` the weights'
    ``main_grad``).  Holds no activation; the buffers it holds are the
    layer's own, and serve only while they still are (``state``: their
    names and objects; ``grads``: the weights' names and their
    ``main_grad`` objects)."""

    __slots__ = ("cls", "fields", "names", "native", "state", "grads")

    def __init__(self, args, names: tuple, state: tuple, grads: tuple = ()):
        self.cls, self.names = type(args), names
        self.fields = {**args.__dict__, **dict.fromkeys(names)}
        # the native plan: None not asked yet, False none for this configuration
        self.native = None
        self.state = state
        self.grads = grads

    def state_current(self, buffers: dict) -> bool:
        """Whether the bound state buffers are still the layer's (a
        ``module.to()`` or a re-allocation replaces them)."""
        return all(buffers.get(name) is t for name, t in self.state)

    def grads_current(self, parameters: dict) -> bool:
        """Whether each bound ``main_grad`` is still its weight's (a
        training loop may give a weight a new one)."""
        return all(getattr(parameters.get(name), "main_grad", None) is g
                   for name, g in self.grads)

    def with_tensors(self, *tensors):
        """The arguments with this call's tensors (in ``names``' order)."""
        fields = self.fields.copy()
        fields.update(zip(self.names, tensors))
        return arg_views.instance(self.cls, fields)


def bound_buffers(args, prefix: str = "") -> tuple:
    """``(buffer name, tensor)`` of the layer buffers ``args`` bound for the
    GEMM ``prefix``: its DelayedScaling state and, with
    ``is_first_microbatch``, its FP8 weight cache (the names
    ``linear.gemm_state`` gives them); () where none."""
    pairs = ()
    if getattr(args, prefix + _STATE_FIELDS[0]) is not None:
        pairs = tuple((f"{prefix}fp8_{f}", getattr(args, prefix + f)) for f in _STATE_FIELDS)
    ws = getattr(args, prefix + "weight_workspace")
    if ws is not None:
        names, buffers, _, _ = storage_parts(ws)
        pairs += tuple((f"{prefix}fp8_weight_{n}", b) for n, b in zip(names, buffers))
    return pairs


def bound_main_grads(args, prefix: str = "") -> tuple:
    """``(weight name, main_grad)`` of GEMM ``prefix`` where ``args`` add its
    weight's gradient into ``main_grad`` (``fuse_wgrad_accumulation``); ()
    where not."""
    g = getattr(args, prefix + "main_grad")
    return () if g is None else ((prefix + "weight", g),)


def _current(memo, layer) -> bool:
    """Whether ``memo`` was made for the layer's current parameter objects."""
    return memo is not None and all(map(operator.is_, memo[0], layer._memo_parameters()))


def template(layer, key):
    """The entry made for ``key`` and the layer's current parameter objects
    (and state buffers), else None."""
    memo = layer.__dict__.get("_args_memo")
    if key is None or not _current(memo, layer):
        return None
    entry = memo[1].get(key)
    if entry is None or (entry.state and not entry.state_current(layer._buffers)) or (
            entry.grads and not entry.grads_current(layer._parameters)):
        return None
    return entry


def remember(layer, key, args, names: tuple, state: tuple, grads: tuple = ()) -> None:
    """Keep ``args`` as the entry of ``key`` (the oldest entry goes when
    full); ``names``, ``state`` and ``grads``: :class:`ArgsTemplate`'s."""
    memo = layer.__dict__.get("_args_memo")
    if not _current(memo, layer):
        memo = layer.__dict__["_args_memo"] = (layer._memo_parameters(), {})
    entries = memo[1]
    entries.pop(key, None)
    if len(entries) >= MEMO_ENTRIES:
        del entries[next(iter(entries))]
    entries[key] = ArgsTemplate(args, names, state, grads)


def native_forward(layer, key, call, *tensors):
    """The outputs (``{"out": y, ...}``) of the native eager path
    (kernels/native.py) for a call whose memo entry holds a native plan,
    else None; ``tensors``: the entry's ``names``, as this call has them.
    Inside activation checkpointing (``call``) a recomputation takes the
    path its forward took (the record says which: torch's non-reentrant
    checkpoint checks that a recomputation saves the same tensors); under
    DelayedScaling the forward records its scales and the recomputation runs
    on copies of them and of the forward history, whose update it discards
    (checkpointing._Call.bind, as on the Python path).  With the FP8
    weight cache the recomputation repeats its forward's use of it, as the
    Python path does: ``is_first_microbatch=True`` quantizes the unchanged
    weight again (under DelayedScaling with the recorded scale) and writes
    the same bytes into the cache, False reads it."""
    out = _native_call(layer, key, call, tensors)
    if call is not None and not call.replay:
        call.rec.native = out is not None
    return out


def _native_call(layer, key, call, tensors):
    entry = template(layer, key)
    if entry is None or entry.native is False:
        return None
    if call is not None and call.replay:
        if not call.rec.native:  # a recomputation takes its forward's path
            return None
    elif not native.ENABLED:  # switched off after the plan was made
        return None
    plan = entry.native
    if plan is None:
        plan = layer._native_plan(entry.with_tensors(*tensors))
        if plan is ...:  # the extension is still being built
            return None
        entry.native = plan = plan or False
        if plan is False:
            return None
    if call is not None and _delayed(entry):
        return _checkpointed(plan, layer, call, tensors)
    return plan(layer, *tensors)


def _delayed(entry) -> bool:
    """Whether the entry bound DelayedScaling state (bound_buffers' names)."""
    return any(name.endswith("fp8_" + _STATE_FIELDS[1]) for name, _ in entry.state)


def _checkpointed(plan, layer, call, tensors):
    """A native call under DelayedScaling inside activation checkpointing:
    the forward records each GEMM's scales (``plan.gemms()``: its prefix and
    native linear call) before they are updated; the recomputation runs on
    a copy of the recorded scales and of the forward history, so the update
    it makes is discarded and the backward state stays the layer's.  The
    plans' state lists are swapped for this one call and restored before it
    returns (the recomputation runs while its caller waits in backward, so
    no other call of the layer sees them)."""
    gemms = plan.gemms()
    if not call.replay:
        for prefix, linear in gemms:
            call.rec.scale_fwd[prefix] = linear.state[1].clone()
        return plan(layer, *tensors)
    kept = [linear.state for _, linear in gemms]
    try:
        for prefix, linear in gemms:
            state = list(linear.state)
            state[0], state[1] = state[0].clone(), call.rec.scale_fwd[prefix].clone()
            linear.state = state
        return plan(layer, *tensors)
    finally:
        for (_, linear), state in zip(gemms, kept):
            linear.state = state
