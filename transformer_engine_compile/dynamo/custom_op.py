"""Generate a forward and a backward custom op from two argument dataclasses.

``register_custom_op`` takes a forward impl + fake, a backward impl + fake,
the forward/backward argument dataclasses and a setup-context hook, and
returns a :class:`CustomOpPair`:

* ``pair(args)`` (compiled path) encodes ``args`` into the forward op's
  arguments, calls the op, and rebuilds the outputs;
* ``pair.eager(args)`` runs the same impls under a ``torch.autograd.Function``.

Contract of the impls (see docs/custom_ops.md):

* ``forward(args) -> OpResult(outputs, saved)``: two ordered dicts of plain
  tensors, quantized storages/wrappers or None.  A saved value that *is* a
  forward argument or an output (identity) is an alias: it is not returned
  again but resolved by name.  Outputs must not alias arguments.
* ``forward_fake(args)`` gets the arguments with every tensor field turned
  into a :class:`TensorProto` and returns the same structure in protos,
  following the impl's control flow (the layout-parity test checks it).
* ``setup_context(args) -> dict``: the backward dataclass's non-tensor fields.
  The backward dataclass gets the saved values by name, those fields, and
  the output gradients named by ``grad_fields`` (backward field -> output).
  A gradient field is None when its output is None (not produced by this
  call); the backward runs when at least one of them is given.
* ``backward(bwd_args) -> dict``: forward-field name -> gradient (or None);
  ``backward_fake`` returns protos.

State the ops update in place (module buffers, ``weight.main_grad``) is
never mutated inside an op: ops with an autograd formula must be
functional, and a mutating op cannot return ``Tensor[]``.  An impl returns
the new value as an output instead, and ``forward_updates`` /
``backward_updates`` (output name -> :class:`Update`) name the argument
field it is written into, by ``copy_`` or ``add_``, right after the op, in
eager and traced code alike.  The write is then an ordinary mutation of a
graph input that PyTorch sees (AOTAutograd keeps it; a write in the
backward is allowed on inputs that do not require grad).  The eager path
calls the impls themselves, not the ops, under
``kernels.tracing.eager_buffers_in_place``: an impl may then write such
state itself and leave its update output out (the delayed-scaling step
does: module/delayed_step.py, ``delayed_updates``).

The fakes are the single source of truth for the flat layout: the op
returns ``Tensor[]``, and whoever reads it (the traced caller, the autograd
formula, the fake kernel) splits it by the fake's structure.

``native_forward`` / ``native_backward`` (optional, ``(pair, decoder,
flat, args) -> list or None``): a faster real impl the op's kernel tries
first, given the flat arguments, their decoder and the decoded arguments
(decoded once for it and the impl); it returns the flat outputs (the
fake's layout, no views) or None for the impl.  Never traced: lowering
and fakes use the impls.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from ..kernels.tracing import eager_buffers_in_place
from ..quantization.wrapper import QuantizedTensor
from .. import compat
from . import buckets as B
from . import export, lowering
from .arg_plan import ArgPlan
from .cache_key import note_schema
from .flat_result import (Layout, OpResult, entry_count, flatten_result, layout_of, pack_saved,
                          unflatten_result, unpack_saved)
from .updates import _check_updates, apply_updates


NAMESPACE = "te_compile"


_LIB = None


_REGISTERED: dict[str, "CustomOpPair"] = {}


# -- the op pair -------------------------------------------------------------------------
class CustomOpPair:
    """A generated forward op, backward op and their autograd wiring."""

    def __init__(self, name, fwd_args, bwd_args, forward, forward_fake, backward,
                 backward_fake, setup_context, grad_fields, forward_updates=None,
                 backward_updates=None, lower_forward=None, lower_backward=None,
                 native_forward=None, native_backward=None):
        self.name = name
        self.native_forward, self.native_backward = native_forward, native_backward
        self.fwd_plan, self.bwd_plan = ArgPlan(fwd_args), ArgPlan(bwd_args)
        self.forward, self.forward_fake = forward, forward_fake
        self.backward, self.backward_fake = backward, backward_fake
        self.setup_context = setup_context
        self.grad_fields = dict(grad_fields)
        bwd_names = {n for n, _ in self.bwd_plan.fields}
        missing = set(self.grad_fields) - bwd_names
        if missing:
            raise TypeError(f"grad_fields {sorted(missing)} are not fields of {bwd_args.__name__}")
        self.forward_updates = _check_updates(forward_updates, self.fwd_plan, "forward_updates")
        self.backward_updates = _check_updates(backward_updates, self.bwd_plan, "backward_updates")
        self.update_targets = tuple(u.field for u in self.backward_updates.values())
        self._grad_positions: dict = {}
        self.available = B.CARRIERS_REGISTERED
        self.fwd_op = self.bwd_op = None
        if not self.available:  # eager() still works
            return
        self.fwd_schema = f"{name}_fwd({self.fwd_plan.schema_args()}) -> Tensor[]"
        self.bwd_schema = f"{name}_bwd({self.bwd_plan.schema_args()}) -> Tensor[]"
        self.fwd_op = _define(f"{name}_fwd", self.fwd_schema, self.fwd_plan,
                              self._fwd_real, self._fwd_fake,
                              self._autograd_backward, self._autograd_setup)
        self.bwd_op = _define(f"{name}_bwd", self.bwd_schema, self.bwd_plan,
                              self._bwd_kernel, self._bwd_fake, self._no_double_backward)
        # buffers the ops update keep their identity in a lowered trace
        written = {u.field for u in (*self.forward_updates.values(),
                                     *self.backward_updates.values())}
        self.fwd_plan.lowered = lowering.register(self.fwd_op, self.fwd_plan, lower_forward,
                                                  self._fwd_flat, written)
        self.bwd_plan.lowered = lowering.register(self.bwd_op, self.bwd_plan, lower_backward,
                                                  self._bwd_real, written)

    # -- layouts (run the fakes on protos) --------------------------------------------------
    def fwd_layout(self, args) -> Layout:
        protos = self.fwd_plan.to_protos(args)
        return layout_of(self.forward_fake(protos), protos, self.fwd_plan.tensor_fields)

    def bwd_layout(self, args) -> Layout:
        protos = self.bwd_plan.to_protos(args)
        grads = self.backward_fake(protos)
        return layout_of(OpResult(grads), protos, ())

    # -- op kernels ----------------------------------------------------------------
    def _fwd_real(self, *flat):
        decoder = self.fwd_plan.decoder(flat[-1])
        args = decoder(flat)
        if self.native_forward is not None:
            out = self.native_forward(self, decoder, flat, args)
            if out is not None:
                return out
        return [_owning(t) for t in self._fwd_result(args)]

    def _fwd_flat(self, *flat):
        return self._fwd_result(self.fwd_plan.decode(flat))

    def _fwd_result(self, args):
        return flatten_result(self.forward(args), args, self.fwd_plan.tensor_fields)

    def _fwd_fake(self, *flat):
        args = self.fwd_plan.decode(flat)
        protos = self.fwd_plan.to_protos(args)
        return flatten_result(self.forward_fake(protos), protos, self.fwd_plan.tensor_fields)

    def _bwd_kernel(self, *flat):
        decoder = self.bwd_plan.decoder(flat[-1])
        args = decoder(flat)
        if self.native_backward is not None:
            out = self.native_backward(self, decoder, flat, args)
            if out is not None:
                return out
        return self._bwd_result(args)

    def _bwd_real(self, *flat):
        return self._bwd_result(self.bwd_plan.decode(flat))

    def _bwd_result(self, args):
        return flatten_result(OpResult(self.backward(args)), args, ())

    def _bwd_fake(self, *flat):
        protos = self.bwd_plan.to_protos(self.bwd_plan.decode(flat))
        return flatten_result(OpResult(self.backward_fake(protos)), protos, ())

    # -- autograd ----------------------------------------------------------------------
    def _autograd_setup(self, ctx, inputs, output):
        args = self.fwd_plan.decode(inputs)
        layout = self.fwd_layout(args)
        _, saved = unflatten_result(layout, output, args)
        tensors, spec, ctx.te_state = pack_saved(saved, self.update_targets)
        # traced: hand them to the compiled backward as eager does (no version check)
        compat.save_without_version_check(pack_saved(ctx.te_state)[0])
        ctx.save_for_backward(*tensors)
        ctx.te_spec = spec
        ctx.te_values = self.setup_context(args)
        ctx.te_template = self.fwd_plan.grad_template(inputs)
        index, pos = {}, 0
        for name, kind, proto in layout.outputs:
            index[name] = pos if kind != "none" else None
            pos += entry_count(proto)
        ctx.te_grad_index = {f: index[o] for f, o in self.grad_fields.items()}

    def _autograd_backward(self, ctx, grads):
        grads_by_output = {f: (None if i is None else grads[i]) for f, i in ctx.te_grad_index.items()}
        if all(g is None for g in grads_by_output.values()):
            return self.fwd_plan.grads(ctx.te_template, {})
        saved = {**unpack_saved(ctx.saved_tensors, ctx.te_spec), **ctx.te_state}
        bwd_args = self.make_bwd_args(saved, ctx.te_values, grads_by_output)
        grads = apply_updates(self.backward_updates, bwd_args, self.call_backward(bwd_args))
        return self.fwd_plan.grads(ctx.te_template, grads)

    def _no_double_backward(self, ctx, grads):
        raise NotImplementedError(f"{self.name}: double backward (create_graph=True through "
                                  "the backward op) is not supported")

    # -- entry points -------------------------------------------------------------------
    def __call__(self, args) -> dict:
        """Compiled path: run the forward op, apply the forward updates;
        returns the other outputs."""
        export.warn_if_unlifted()
        flat = self.fwd_op(*self.fwd_plan.encode(args))
        outputs, _ = unflatten_result(self.fwd_layout(args), flat, outputs_only=True)
        return apply_updates(self.forward_updates, args, outputs)

    def call_backward(self, bwd_args) -> dict:
        flat = self.bwd_op(*self.bwd_plan.encode(bwd_args))
        outputs, _ = unflatten_result(self.bwd_layout(bwd_args), flat, outputs_only=True)
        return outputs

    def eager(self, args) -> dict:
        """Eager path: the same impls under a ``torch.autograd.Function``."""
        diff_fields, diff = [], []
        if torch.is_grad_enabled():
            for name in self.fwd_plan.tensor_fields:
                value = getattr(args, name)
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    diff_fields.append(name)
                    diff.append(value)
        if not diff:
            with eager_buffers_in_place():
                outputs = self.forward(args).outputs
            return apply_updates(self.forward_updates, args, outputs)
        names = []  # the output names, filled by the Function's forward
        values = _EagerFunction.apply(self, args, diff_fields, names, *diff)
        return apply_updates(self.forward_updates, args, dict(zip(names, values)))

    def grad_positions(self, names: tuple) -> tuple:
        """``((backward field, index of its output in names), ...)`` for a
        forward that returned the outputs ``names`` (cached: the names
        depend only on the call's configuration)."""
        positions = self._grad_positions.get(names)
        if positions is None:
            positions = self._grad_positions[names] = tuple(
                (f, names.index(o)) for f, o in self.grad_fields.items())
        return positions

    def make_bwd_args(self, saved: dict, values: dict, grads: dict):
        return self.bwd_plan.cls(**saved, **values, **grads)


def _owning(t):
    """``t``, or for a view (``y.view(shape)``) a tensor on the same
    storage that is no view: a module output that is a view is refused
    in-place ops by autograd, and FSDP2 warns that such an op would skip its
    hooks.  ``detach()`` makes a non-differentiable alias, which autograd
    does not track as a view (``_base`` None), at a sixth of the cost of a
    ``set_`` onto the storage."""
    if type(t) is not torch.Tensor or t._base is None:
        return t
    return t.detach()


class _EagerFunction(torch.autograd.Function):
    """The eager path's autograd node.  Kept lean: every eager layer call
    runs its forward and backward, so each Python step here is host time
    per layer."""

    @staticmethod
    def forward(ctx, pair, args, diff_fields, names, *diff_tensors):
        with eager_buffers_in_place():
            result = pair.forward(args)
        tensors, ctx.te_spec, ctx.te_state = pack_saved(result.saved, pair.update_targets)
        ctx.save_for_backward(*tensors)
        ctx.te_pair, ctx.te_fields = pair, diff_fields
        ctx.te_values = pair.setup_context(args)
        outputs = result.outputs
        names.extend(outputs)
        ctx.te_out_grad = pair.grad_positions(tuple(names))
        return tuple([_owning(v) for v in outputs.values()])

    @staticmethod
    @once_differentiable  # the impls are not differentiable: refuse double backward
    def backward(ctx, *grads):
        pair = ctx.te_pair
        grads_by_output = {f: grads[i] for f, i in ctx.te_out_grad}
        if all(g is None for g in grads_by_output.values()):
            return (None,) * (4 + len(ctx.te_fields))
        saved = unpack_saved(ctx.saved_tensors, ctx.te_spec)
        saved.update(ctx.te_state)
        bwd_args = pair.make_bwd_args(saved, ctx.te_values, grads_by_output)
        with eager_buffers_in_place():
            grads = pair.backward(bwd_args)
        result = apply_updates(pair.backward_updates, bwd_args, grads)
        return (None,) * 4 + tuple([result.get(f) for f in ctx.te_fields])


# -- registration -------------------------------------------------------------------------
def _library():
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _LIB


def _define(op_name, schema, plan, real, fake, backward, setup_context=None):
    lib = _library()
    lib.define(schema)
    note_schema(schema)
    qualname = f"{NAMESPACE}::{op_name}"
    lib.impl(op_name, real, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    op = getattr(getattr(torch.ops, NAMESPACE), op_name).default
    lib.impl(op_name, _autograd_kernel(op, real, backward, setup_context), "Autograd",
             with_keyset=True)

    def unwrap_rule(mode, func, types, args, kwargs):
        return func(*plan.unwrap_wrappers(list(args)), **(kwargs or {}))

    for cls in _wrapper_classes():
        torch.library.register_torch_dispatch(qualname, cls, unwrap_rule, lib=lib)
    return op


def _autograd_kernel(op, real, backward, setup_context):
    """torch.library's autograd kernel for ``op``, with a short cut: where no
    gradient is recorded (a compiled graph's runtime calls the forward op
    inside AOTAutograd's forward, and the engine runs the backward op, both
    without grad mode) and nothing sits between Autograd and the CPU/CUDA
    kernel, call the impl here instead of redispatching to it.  That saves
    one Python<->C++ round trip per call (docs/custom_ops.md); tracing
    (fake or functional tensors, proxy modes) always takes the full path."""
    generated = compat.library_autograd_kernel(op, backward, setup_context)
    below_autograd = torch._C._AutoDispatchBelowAutograd
    is_grad_enabled = torch.is_grad_enabled
    plain = compat.below_autograd_is_plain

    def kernel(keyset, *args):
        if not is_grad_enabled() and plain(keyset):
            with below_autograd():
                return real(*args)
        return generated(keyset, *args)

    return kernel


def _wrapper_classes():
    from ..quantization.base import storage_registry
    return [c for c in storage_registry().values() if issubclass(c, QuantizedTensor)]


def register_custom_op(name: str, *, fwd_args: type, bwd_args: type, forward: Callable,
                       forward_fake: Callable, backward: Callable, backward_fake: Callable,
                       setup_context: Callable, grad_fields: dict, forward_updates=None,
                       backward_updates=None, lower_forward: Callable | None = None,
                       lower_backward: Callable | None = None,
                       native_forward: Callable | None = None,
                       native_backward: Callable | None = None) -> CustomOpPair:
    """Generate ``te_compile::<name>_fwd`` / ``<name>_bwd`` and their autograd.

    ``forward_updates`` / ``backward_updates``: output name -> field name or
    :class:`Update`; see the module docstring.  ``lower_forward`` /
    ``lower_backward``: ``args -> bool``, whether inductor may replace a
    call by its impl's kernels (dynamo/lowering.py); None: never.
    ``native_forward`` / ``native_backward``: see the module docstring.

    Raises ``RuntimeError`` if ``name`` is taken and ``TypeError`` for a bad
    declaration; see the module docstring for the impl contract.  On a torch
    without the opaque-object API no ops are defined (``pair.available`` is
    False) and only ``pair.eager`` works.
    """
    if name in _REGISTERED:
        raise RuntimeError(f"custom op {name!r} is already registered")
    pair = CustomOpPair(name, fwd_args, bwd_args, forward, forward_fake, backward,
                        backward_fake, setup_context, grad_fields, forward_updates,
                        backward_updates, lower_forward, lower_backward, native_forward,
                        native_backward)
    _REGISTERED[name] = pair
    return pair
