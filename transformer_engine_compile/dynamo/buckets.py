"""How each field of an argument dataclass crosses a custom-op boundary.

A custom-op schema only knows tensors, tensor lists, scalars, strings and
registered opaque objects.  :func:`bucket_for` reads one field annotation
(once, at registration) and returns the bucket that encodes it:

============================  =====================================================
annotation                    crosses as
============================  =====================================================
``Tensor``                    ``Tensor f``
``Optional[Tensor]``          ``Tensor? f``
``TensorOrQuantized``         ``Tensor[] f`` (the tensor, a wrapper tensor, or a
                              storage's inner buffers), ``SymInt[] f__shape``, a
                              quantizer slot, and metadata in the simple values
simple (bool, int, float,     one entry of the single value-opaque
str, Enum, dtype, Size,       :class:`SimpleValues` argument shared by all fields
tuples, Optional of these)
``[Optional[]]Quantizer``     ``QuantizerSlot? f`` (value-opaque, nullable)
``[Optional[]]ProcessGroup``  ``str? f``: the group's name, resolved inside the op
anything else                 nothing; the value must be None at call time
============================  =====================================================

``encode`` runs in traced code (Dynamo inlines it), ``decode`` inside the op
impls and the autograd formula.  Shapes never enter value-opaque objects;
they travel as ``SymInt[]`` arguments.
"""

from __future__ import annotations

import enum
import typing
from typing import Union

import torch

from ..quantization.base import (QuantizedMeta, QuantizedTensorStorage, Quantizer, class_key,
                                 storage_parts)
from ..quantization.wrapper import QuantizedTensor
from .. import compat
from ..quantization.opaque import is_value_opaque

TensorOrQuantized = Union[torch.Tensor, QuantizedTensorStorage, None]
"""Annotation of a field holding a plain tensor, a quantized tensor or None."""

_DTYPE_NAMES = {v: k for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
_SCALARS = (bool, int, float, str)


# -- value-opaque carriers ---------------------------------------------------------
class SimpleValues(compat.OpaqueBase):
    """All simple field values of one op call: ``((name, primitive), ...)``.

    Only None/bool/int/float/str and nested tuples of them, so equality,
    hashing and ``__fx_repr__`` are plain Python (FX graph cache safe)."""

    def __init__(self, items: tuple):
        self.items = items

    def __eq__(self, other):
        return type(other) is SimpleValues and self.items == other.items

    def __hash__(self):
        # cached: the op impls look their decoder up by this value on every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(self.items)
        return h

    def __getstate__(self):
        # pickled (torch.export.save) without the cached hash: str hashes
        # differ between processes
        return {"items": self.items}

    def __fx_repr__(self):
        return f"SimpleValues({self.items!r})", {"SimpleValues": SimpleValues}

    def as_dict(self) -> dict:
        return dict(self.items)

    def __repr__(self):
        return f"SimpleValues({self.items!r})"


class QuantizerSlot(compat.OpaqueBase):
    """One schema type for every value-opaque quantizer class (a schema slot
    is typed by exact class, and a field may hold any format's quantizer)."""

    def __init__(self, quantizer):
        self.quantizer = quantizer

    def __eq__(self, other):
        return type(other) is QuantizerSlot and self.quantizer == other.quantizer

    def __hash__(self):
        return hash(self.quantizer)

    def __fx_repr__(self):
        expr, glb = self.quantizer.__fx_repr__()
        return f"QuantizerSlot({expr})", {"QuantizerSlot": QuantizerSlot, **glb}

    def __repr__(self):
        return f"QuantizerSlot({self.quantizer!r})"


CARRIERS_REGISTERED = (compat.register_value_type(SimpleValues, ("items", "as_dict"))
                       and compat.register_value_type(QuantizerSlot, ("quantizer",)))


def _slot_type() -> str:
    return compat.opaque_type_name(QuantizerSlot)


def simple_values_type() -> str:
    return compat.opaque_type_name(SimpleValues)


# -- buckets -----------------------------------------------------------------------
class Bucket:
    """Encoding of one field.  ``encode(value, name)`` returns the op
    arguments and the simple-values entry (or ``_NO_SIMPLE``)."""

    kind = "abstract"
    n_args = 0

    def schema(self, name: str) -> list:
        return []

    def encode(self, value, name):
        raise NotImplementedError

    def decode(self, op_args: list, simple):
        raise NotImplementedError


_NO_SIMPLE = object()


class TensorBucket(Bucket):
    kind, n_args = "tensor", 1

    def schema(self, name):
        return [f"Tensor {name}"]

    def encode(self, value, name):
        if not isinstance(value, torch.Tensor) or isinstance(value, QuantizedTensorStorage):
            raise TypeError(f"field {name!r} must be a plain torch.Tensor, got {type(value).__name__}")
        return [value], _NO_SIMPLE

    def decode(self, op_args, simple):
        return op_args[0]


class OptionalTensorBucket(TensorBucket):
    kind = "optional_tensor"

    def schema(self, name):
        return [f"Tensor? {name}"]

    def encode(self, value, name):
        if value is None:
            return [None], _NO_SIMPLE
        return super().encode(value, name)


class TensorOrQuantizedBucket(Bucket):
    """Plain tensor ``[t]``; wrapper tensor ``[w]`` (a torch-dispatch rule
    swaps it for its buffers below autograd, so its gradient survives);
    storage: its present buffers.  Metadata goes into the simple values."""

    kind, n_args = "tensor_or_quantized", 3

    def schema(self, name):
        return [f"Tensor[] {name}", f"SymInt[] {name}__shape", f"{_slot_type()}? {name}__quantizer"]

    def encode(self, value, name):
        if value is None:
            return [[], [], None], ("none",)
        if isinstance(value, QuantizedTensorStorage):
            names, buffers, extras, q = storage_parts(value)
            if q is not None and not is_value_opaque(q):
                raise TypeError(f"field {name!r}: the quantizer of {type(value).__name__} "
                                f"({type(q).__name__}) is not value-opaque")
            tensors = [value] if isinstance(value, torch.Tensor) else buffers
            meta = ("quantized", class_key(type(value)), _DTYPE_NAMES[value.dtype], extras, names)
            slot = QuantizerSlot(q) if q is not None else None
            return [tensors, list(value.shape), slot], meta
        if isinstance(value, torch.Tensor):
            return [[value], [], None], ("tensor",)
        raise TypeError(f"field {name!r} must be a tensor, a quantized tensor or None, "
                        f"got {type(value).__name__}")

    def decode(self, op_args, simple):
        tensors, shape, slot = op_args
        if simple[0] == "none":
            return None
        if simple[0] == "tensor" or isinstance(tensors[0], QuantizedTensor):
            return tensors[0]  # a wrapper: only above the unwrap rule (autograd setup)
        _, cls_name, dtype_name, extras, names = simple
        meta = QuantizedMeta(cls_name, getattr(torch, dtype_name),
                             None if slot is None else slot.quantizer, extras)
        return meta.build(tuple(shape), dict(zip(names, tensors)))

    @staticmethod
    def unwrap(op_args):
        """Replace a wrapper tensor by its buffers (the torch-dispatch rule)."""
        tensors = op_args[0]
        if len(tensors) == 1 and isinstance(tensors[0], QuantizedTensor):
            return [list(tensors[0].buffers().values())] + list(op_args[1:])
        return list(op_args)


class QuantizerBucket(Bucket):
    kind, n_args = "quantizer", 1

    def schema(self, name):
        return [f"{_slot_type()}? {name}"]

    def encode(self, value, name):
        if value is None:
            return [None], _NO_SIMPLE
        if not isinstance(value, Quantizer):
            raise TypeError(f"field {name!r} must be a Quantizer or None, got {type(value).__name__}")
        if not is_value_opaque(value):
            raise TypeError(f"field {name!r}: {type(value).__name__} is not a value-opaque "
                            "quantizer and cannot cross a custom-op boundary")
        return [QuantizerSlot(value)], _NO_SIMPLE

    def decode(self, op_args, simple):
        return None if op_args[0] is None else op_args[0].quantizer


class ProcessGroupBucket(Bucket):
    """A process group crosses as its name (a string works as a schema slot
    on every supported torch; the opaque ProcessGroup type does not on 2.11)."""

    kind, n_args = "process_group", 1

    def schema(self, name):
        return [f"str? {name}"]

    def encode(self, value, name):
        return [None if value is None else value.group_name], _NO_SIMPLE

    def decode(self, op_args, simple):
        if op_args[0] is None:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(op_args[0])


class SimpleBucket(Bucket):
    """A simple value, stored in the shared :class:`SimpleValues` argument."""

    kind = "simple"

    def __init__(self, spec, optional: bool):
        self.spec, self.optional = spec, optional

    def encode(self, value, name):
        if value is None:
            if not self.optional:
                raise TypeError(f"field {name!r} is not Optional but got None")
            return [], None
        return [], _encode_simple(self.spec, value, name)

    def decode(self, op_args, simple):
        return None if simple is None else _decode_simple(self.spec, simple)


class UnsupportedBucket(Bucket):
    """A field no bucket encodes: allowed only when None at call time."""

    kind = "unsupported"

    def __init__(self, annotation):
        self.annotation = annotation

    def encode(self, value, name):
        if value is not None:
            raise TypeError(f"field {name!r} (annotated {self.annotation!r}) cannot cross a "
                            f"custom-op boundary; it must be None, got {type(value).__name__}")
        return [], _NO_SIMPLE

    def decode(self, op_args, simple):
        return None


# -- simple values -----------------------------------------------------------------
def _encode_simple(spec, value, name):
    kind = spec[0]
    if kind == "scalar":
        typ = spec[1]
        if typ is float:  # an int is a fine float
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, typ)
        if not ok:
            raise TypeError(f"field {name!r} must be {typ.__name__}, got {type(value).__name__}")
        return value
    if kind == "enum":
        if not isinstance(value, spec[1]):
            raise TypeError(f"field {name!r} must be {spec[1].__name__}, got {type(value).__name__}")
        return value.name
    if kind == "dtype":
        if not isinstance(value, torch.dtype):
            raise TypeError(f"field {name!r} must be a torch.dtype, got {type(value).__name__}")
        return _DTYPE_NAMES[value]
    # tuple or Size
    if not isinstance(value, (tuple, list, torch.Size)):
        raise TypeError(f"field {name!r} must be a tuple, got {type(value).__name__}")
    elems = spec[1]
    if elems is None:  # variadic
        return tuple(_encode_simple(spec[2], v, name) for v in value)
    if len(elems) != len(value):
        raise TypeError(f"field {name!r} must have {len(elems)} elements, got {len(value)}")
    return tuple(_encode_simple(s, v, name) for s, v in zip(elems, value))


def _decode_simple(spec, value):
    kind = spec[0]
    if kind == "scalar":
        return value
    if kind == "enum":
        return spec[1][value]
    if kind == "dtype":
        return getattr(torch, value)
    if spec[1] is None:
        out = tuple(_decode_simple(spec[2], v) for v in value)
    else:
        out = tuple(_decode_simple(s, v) for s, v in zip(spec[1], value))
    return torch.Size(out) if kind == "size" else out


def _simple_spec(ann):
    """Spec of a simple annotation, or None when it is not simple."""
    if ann in _SCALARS:
        return ("scalar", ann)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return ("enum", ann)
    if ann is torch.dtype:
        return ("dtype",)
    if ann is torch.Size:
        return ("size", None, ("scalar", int))
    if typing.get_origin(ann) is tuple:
        args = typing.get_args(ann)
        if len(args) == 2 and args[1] is Ellipsis:
            elem = _simple_spec(args[0])
            return None if elem is None else ("tuple", None, elem)
        elems = tuple(_simple_spec(a) for a in args)
        return None if any(e is None for e in elems) else ("tuple", elems)
    return None


def _is_process_group(ann) -> bool:
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(ann, type) and issubclass(ann, ProcessGroup)


def bucket_for(annotation) -> Bucket:
    """The bucket of one field annotation (see the module docstring)."""
    if annotation == TensorOrQuantized:
        return TensorOrQuantizedBucket()
    optional = False
    ann = annotation
    if typing.get_origin(ann) is Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        if len(args) == 1:
            ann = args[0]
    if ann is torch.Tensor:
        return OptionalTensorBucket() if optional else TensorBucket()
    if isinstance(ann, type) and issubclass(ann, Quantizer):
        return QuantizerBucket()
    if _is_process_group(ann):
        return ProcessGroupBucket()
    spec = _simple_spec(ann)
    if spec is not None:
        return SimpleBucket(spec, optional)
    return UnsupportedBucket(annotation)

