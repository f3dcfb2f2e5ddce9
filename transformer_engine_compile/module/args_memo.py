"""te.Linear's argument memo and the native eager path's entry (issue 14).

An eager layer called again in a configuration it ran recently (the memo
key, :meth:`Linear._memo_key`) reuses the arguments it checked and built
then, skipping the checks and the dataclass; an entry also carries the
configuration's native plan (module/linear_native.py, and
module/layernorm_linear_native.py for ``te.LayerNormLinear``), asked for at
the entry's second call.  The memo lives in the layer's ``__dict__`` as
``(weight, bias, {key: ArgsTemplate}, others)``: the parameter objects it
was made for (``others``: the layer's further ones, e.g. the norm's), and
the last :data:`MEMO_ENTRIES` configurations.  Copies and pickles
of a layer leave it behind (``Linear.__getstate__``).
"""

from __future__ import annotations

from ..dynamo import arg_views
from .linear_ops import LinearFwdArgs

# configurations the argument memo keeps per layer (the oldest goes first): a
# reentrant checkpoint's no-grad forward and its recomputation, training and
# evaluation steps, two input shapes, each keep their entry
MEMO_ENTRIES = 4


class ArgsTemplate:
    """The arguments of an eager call, less its input and parameters: what
    ``Linear._make_args`` worked out (checks passed, quantizers, flags, and
    under DelayedScaling the layer's state buffers it bound).  Holds no
    activation; the state buffers it holds are the layer's own, and serve
    only while they still are (``state``: their names and objects)."""

    __slots__ = ("fields", "native", "state")

    def __init__(self, args: LinearFwdArgs, state_names: tuple):
        self.fields = {**args.__dict__, "inp": None, "weight": None, "bias": None}
        # the native plan (module/linear_native.py): None not asked yet,
        # False none for this configuration
        self.native = None
        self.state = () if args.amax_history_fwd is None else tuple(
            zip(state_names, (args.amax_history_fwd, args.scale_fwd, args.amax_history_bwd,
                              args.scale_bwd)))

    def state_current(self, buffers: dict) -> bool:
        """Whether the bound state buffers are still the layer's (a
        ``module.to()`` or a re-allocation replaces them)."""
        return all(buffers.get(name) is t for name, t in self.state)

    def with_tensors(self, inp, weight, bias) -> LinearFwdArgs:
        return arg_views.instance(LinearFwdArgs, {**self.fields, "inp": inp, "weight": weight,
                                                  "bias": bias})


def _current(memo, layer) -> bool:
    """Whether ``memo`` was made for the layer's current parameter objects."""
    if memo is None or memo[0] is not layer.weight or memo[1] is not layer.bias:
        return False
    others = memo[3]  # () for te.Linear: nothing more to ask on its hot path
    return not others or all(a is b for a, b in zip(others, layer._memo_parameters()))


def template(layer, key):
    """The entry made for ``key`` and the layer's current parameter objects
    (and state buffers), else None."""
    memo = layer.__dict__.get("_args_memo")
    if key is None or not _current(memo, layer):
        return None
    entry = memo[2].get(key)
    if entry is None or (entry.state and not entry.state_current(layer._buffers)):
        return None
    return entry


def remember(layer, key, args: LinearFwdArgs, state_names: tuple) -> None:
    """Keep ``args`` as the entry of ``key`` (the oldest entry goes when full)."""
    memo = layer.__dict__.get("_args_memo")
    if not _current(memo, layer):
        memo = layer.__dict__["_args_memo"] = (layer.weight, layer.bias, {},
                                               layer._memo_parameters())
    entries = memo[2]
    entries.pop(key, None)
    if len(entries) >= MEMO_ENTRIES:
        del entries[next(iter(entries))]
    entries[key] = ArgsTemplate(args, state_names)


def native_forward(layer, inp, weight, bias, key, call=None):
    """The outputs (``{"out": y, ...}``) of the native eager path
    (kernels/native.py) for a call whose memo entry holds a native plan,
    else None.  Inside activation checkpointing (``call``) a recomputation
    takes the path its forward took (the record says which: torch's
    non-reentrant checkpoint checks that a recomputation saves the same
    tensors), and nothing under DelayedScaling runs natively there: its
    recomputation must run on the recorded scales (checkpointing.py), which
    only the Python path takes."""
    out = _native_call(layer, inp, weight, bias, key, call)
    if call is not None and not call.replay:
        call.rec.native = out is not None
    return out


def _native_call(layer, inp, weight, bias, key, call):
    entry = template(layer, key)
    if entry is None or entry.native is False:
        return None
    if call is not None and (entry.state or (call.replay and not call.rec.native)):
        return None
    bias = None if layer.return_bias else bias
    plan = entry.native
    if plan is None:
        plan = layer._native_plan(entry.with_tensors(inp, weight, bias))
        if plan is ...:  # the extension is still being built
            return None
        entry.native = plan = plan or False
        if plan is False:
            return None
    return plan(layer, inp, weight, bias)
