"""The flat ``Tensor[]`` an op returns, and what its autograd saves.

An op impl returns an :class:`OpResult` (outputs and values
saved for backward, tensors or quantized storages).  The op's schema can
only return a flat list of tensors: :func:`flatten_result` lays the result
out (each storage as its buffers, aliases of arguments or outputs left
out), :func:`layout_of` records that structure from the fake's protos, and
:func:`unflatten_result` rebuilds the dicts from the list.  ``pack_saved``
/ ``unpack_saved`` do the same for ``ctx.save_for_backward``, keeping the
layer state the backward updates off it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quantization.base import QuantizedTensorStorage
from .tensor_proto import TensorProto


class OpResult(NamedTuple):
    """What a forward impl/fake returns: outputs and tensors saved for backward."""

    outputs: dict
    saved: dict = {}


# -- flat layouts --------------------------------------------------------------------
def entry_count(value) -> int:
    if value is None:
        return 0
    if isinstance(value, TensorProto):
        return len(value.inner_names()) if value.is_quantized else 1
    if isinstance(value, QuantizedTensorStorage):
        return len(value.buffers())
    return 1


def _alias_names(args, outputs: dict, arg_fields) -> dict:
    """id(value) -> ``"arg:<field>"`` / ``"out:<name>"`` for alias resolution."""
    names = {id(getattr(args, f)): f"arg:{f}" for f in arg_fields if getattr(args, f) is not None}
    for name, value in outputs.items():
        if value is not None:
            if id(value) in names:
                raise RuntimeError(f"output {name!r} is the same object as {names[id(value)]!r}; "
                                   "a custom op may not return an input or one tensor twice")
            names[id(value)] = f"out:{name}"
    return names


def flatten_result(result: OpResult, args, arg_fields) -> list:
    """The op's ``Tensor[]`` return: outputs, then saved values that are not
    aliases (the same object as an argument or an output).  For a proto
    result (the fake kernel) the protos are materialised."""
    taken = {id(getattr(args, f)) for f in arg_fields}
    flat = []
    for name, value in result.outputs.items():
        if value is None:
            continue
        if id(value) in taken:
            _alias_names(args, result.outputs, arg_fields)  # raises, naming the alias
            raise RuntimeError(f"output {name!r} aliases an argument or another output")
        taken.add(id(value))
        _append_flat(flat, value)
    for value in result.saved.values():
        if value is not None and id(value) not in taken:
            _append_flat(flat, value)
    return flat


def _append_flat(flat: list, value) -> None:
    if isinstance(value, TensorProto):
        value = value.create_tensor()
    if isinstance(value, QuantizedTensorStorage):
        flat.extend(value.buffers().values())
    else:
        flat.append(value)


class Layout(NamedTuple):
    """Structure of a fake result: per entry ``(name, kind, proto_or_alias)``."""

    outputs: tuple
    saved: tuple


def layout_of(proto_result: OpResult, proto_args, arg_fields) -> Layout:
    aliases = _alias_names(proto_args, proto_result.outputs, arg_fields)

    def entries(d, allow_alias):
        out = []
        for name, value in d.items():
            if value is None:
                out.append((name, "none", None))
            elif allow_alias and id(value) in aliases:
                out.append((name, "alias", aliases[id(value)]))
            else:
                out.append((name, "value", value))
        return tuple(out)

    return Layout(entries(proto_result.outputs, False), entries(proto_result.saved, True))


def _rebuild(proto: TensorProto, tensors: list):
    if not proto.is_quantized:
        return tensors[0]
    buffers = {name[1:]: t for name, t in zip(proto.inner_names(), tensors)}
    return proto.create_metadata().build(proto.shape, buffers)


def unflatten_result(layout: Layout, flat, args=None, outputs_only=False):
    """Inverse of :func:`flatten_result`: ``(outputs, saved)`` dicts."""
    pos = 0
    outputs = {}
    for name, kind, proto in layout.outputs:
        n = entry_count(proto)
        outputs[name] = None if kind == "none" else _rebuild(proto, flat[pos:pos + n])
        pos += n
    if outputs_only:
        return outputs, {}
    saved = {}
    for name, kind, ref in layout.saved:
        if kind == "none":
            saved[name] = None
        elif kind == "alias":
            where, target = ref.split(":", 1)
            saved[name] = getattr(args, target) if where == "arg" else outputs[target]
        else:
            n = entry_count(ref)
            saved[name] = _rebuild(ref, flat[pos:pos + n])
            pos += n
    return outputs, saved


# -- saving for backward ---------------------------------------------------------------
def pack_saved(saved: dict, state_names=()) -> tuple:
    """``(tensors, spec, state)``: what ``ctx.save_for_backward`` can hold,
    how to rebuild the values from it, and the saved values named in
    ``state_names``, kept apart.

    Those are live state the backward writes into (``main_grad``,
    delayed-scaling buffers).  They travel on ``ctx`` by reference, not
    through ``save_for_backward``: the backward must read them as they are
    when it runs, and a layer applied twice before backward updates them in
    between, which the saved tensors' version check would refuse.  Traced by
    AOTAutograd, the compiled forward hands them over the same way (no
    version check, ``compat.save_without_version_check``), so two compiled
    calls before one backward work too.  One pass over ``saved``: the eager
    path runs this on every layer call."""
    tensors, spec, state = [], [], {}
    for name, value in saved.items():
        if name in state_names:
            state[name] = value
        elif value is None:
            spec.append((name, None))
        elif isinstance(value, QuantizedTensorStorage) and not isinstance(value, torch.Tensor):
            # the storage's attributes with its buffers left out: unpack_saved
            # puts the saved tensors back into a copy of them
            shell, attrs, start = dict(value.__dict__), [], len(tensors)
            for _, attr in value._BUFFER_ATTRS:
                t = shell[attr]
                if t is not None:
                    attrs.append(attr)
                    tensors.append(t)
                    shell[attr] = None
            spec.append((name, (type(value), shell, tuple(attrs), start)))
        else:
            spec.append((name, len(tensors)))
            tensors.append(value)
    return tensors, tuple(spec), state


def unpack_saved(tensors, spec) -> dict:
    out = {}
    for name, s in spec:
        if s is None:
            out[name] = None
        elif isinstance(s, int):
            out[name] = tensors[s]
        else:
            cls, shell, attrs, start = s
            storage = object.__new__(cls)
            fields = storage.__dict__
            fields.update(shell)
            for i, attr in enumerate(attrs, start):
                fields[attr] = tensors[i]
            out[name] = storage
    return out
