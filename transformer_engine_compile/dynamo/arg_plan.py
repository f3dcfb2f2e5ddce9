"""How one argument dataclass becomes a custom op's flat arguments and back:
:class:`ArgPlan` (built once per dataclass from its fields' buckets,
``buckets.py``) encodes a call's arguments in traced code and decodes them
inside the op impls and the autograd formula."""

from __future__ import annotations

import dataclasses

import torch

from ..quantization.base import storage_registry
from ..quantization.wrapper import QuantizedTensor
from .. import compat
from . import arg_views
from . import buckets as B
from . import lowering
from .tensor_proto import to_tensor_proto


# -- argument plans ------------------------------------------------------------------
class ArgPlan:
    """The buckets of one dataclass's fields, computed once at registration."""

    def __init__(self, cls):
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        hints = B.typing.get_type_hints(cls)
        self.cls = cls
        self.fields = tuple((f.name, B.bucket_for(hints[f.name])) for f in dataclasses.fields(cls))
        arg_views.FIELD_NAMES[cls] = tuple(n for n, _ in self.fields)  # views before a trace
        self.tensor_fields = tuple(n for n, b in self.fields if b.kind in
                                   ("tensor", "optional_tensor", "tensor_or_quantized"))
        self._decoders: dict = {}  # SimpleValues -> _Decoder
        self.lowered = False  # an inductor decomposition exists: encode its cache token

    def schema_args(self) -> str:
        args = [a for name, b in self.fields for a in b.schema(name)]
        args.append(f"{B.simple_values_type()} simple_values")
        names = [a.split()[-1] for a in args]
        clashes = sorted({n for n in names if names.count(n) > 1})
        if clashes:
            raise TypeError(f"{self.cls.__name__}: schema argument names clash: {clashes}")
        return ", ".join(args)

    def buckets(self) -> dict:
        return {name: b.kind for name, b in self.fields}

    def encode(self, args) -> list:
        """Flat op arguments for ``args`` (runs under Dynamo)."""
        flat, simple = [], []
        for name, bucket in self.fields:
            op_args, entry = bucket.encode(getattr(args, name), name)
            flat.extend(op_args)
            if entry is not B._NO_SIMPLE:
                simple.append((name, entry))
        if self.lowered:  # in the graph, so in the compile caches' keys
            simple.append(("~lowering", lowering.cache_token()))
            device = self.device_of(args)
            if device is not None and device.type == "cuda":
                simple.append(("~pool", lowering.pool_token(device.type, device.index)))
        flat.append(B.SimpleValues(tuple(simple)))
        return flat

    def device_of(self, args):
        """The device of the call's first tensor argument, else None."""
        for name in self.tensor_fields:
            value = getattr(args, name)
            if isinstance(value, torch.Tensor):
                return value.device
        return None

    def _split(self, flat):
        simple = flat[-1].as_dict()
        pos = 0
        for name, bucket in self.fields:
            yield name, bucket, list(flat[pos:pos + bucket.n_args]), simple.get(name)
            pos += bucket.n_args

    def decode(self, flat):
        """Rebuild the dataclass from flat op arguments.  What depends only on
        the simple values (a trace-time constant of the call site) is worked
        out once per distinct value, see :class:`_Decoder`."""
        return self.decoder(flat[-1])(flat)

    def decoder(self, simple) -> "_Decoder":
        """The :class:`_Decoder` of one :class:`SimpleValues`."""
        decoder = self._decoders.get(simple)
        if decoder is None:
            decoder = self._decoders[simple] = _Decoder(self, simple)
        return decoder

    def decode_slow(self, flat):
        """Field by field through the buckets (the definition ``decode`` caches)."""
        return self.cls(**{name: bucket.decode(op_args, entry)
                           for name, bucket, op_args, entry in self._split(flat)})

    def unwrap_wrappers(self, flat) -> list:
        """Flat arguments with each wrapper tensor replaced by its buffers."""
        out = []
        for name, bucket, op_args, _ in self._split(flat):
            out.extend(bucket.unwrap(op_args) if bucket.kind == "tensor_or_quantized" else op_args)
        out.append(flat[-1])
        return out

    def with_fixed_layouts(self, flat, skip=()) -> list:
        """``flat`` with each plain tensor argument, except those of the
        fields in ``skip``, through :func:`compat.fixed_layout` (a lowered
        call's inputs, so inductor realizes each once; lowering.py)."""
        out = []
        for name, bucket, op_args, entry in self._split(flat):
            if name not in skip:
                if bucket.kind in ("tensor", "optional_tensor") and isinstance(
                        op_args[0], torch.Tensor):
                    op_args = [compat.fixed_layout(op_args[0])]
                elif bucket.kind == "tensor_or_quantized" and entry[0] == "tensor":
                    op_args = [[compat.fixed_layout(op_args[0][0])], *op_args[1:]]
            out.extend(op_args)
        out.append(flat[-1])
        return out

    def grad_template(self, flat) -> tuple:
        """What ``grads`` needs to know about one call's arguments (no tensors)."""
        out = []
        for name, bucket, op_args, entry in self._split(flat):
            if bucket.kind == "tensor_or_quantized":
                tensors = op_args[0]
                gradable = entry[0] == "tensor" or (
                    len(tensors) == 1 and isinstance(tensors[0], QuantizedTensor))
                # torch/_library/autograd.py treats a non-empty list of
                # non-tensors as a leaf (grad None) and an empty list as a list
                shape_grad = [] if len(op_args[1]) == 0 else None
                out.append((name, "list", (len(tensors), shape_grad), gradable))
            else:
                out.append((name, bucket.kind, bucket.n_args, None))
        return tuple(out)

    @staticmethod
    def grads(template, grads_by_field: dict) -> tuple:
        """Per-op-argument gradients from ``{field: grad}``."""
        out = []
        for name, kind, n, gradable in template:
            grad = grads_by_field.get(name)
            if kind in ("tensor", "optional_tensor"):
                out.append(grad)
            elif kind == "list":  # tensors, shape, quantizer slot
                out.extend([[grad] if gradable else [None] * n[0], n[1], None])
            else:
                out.extend([None] * n)
        return tuple(out) + (None,)  # the simple values

    def to_protos(self, args):
        """``args`` with every tensor field replaced by its TensorProto."""
        # with_fields, not dataclasses.replace: traced, replace reads every
        # field's private _field_type, and Dynamo then guards that they are one
        # object, in a Python guard run on every call of the compiled function
        return arg_views.with_fields(args, **{n: _proto(getattr(args, n))
                                              for n in self.tensor_fields})


def _proto(value):
    return None if value is None else to_tensor_proto(value)


class _Decoder:
    """Decoding of one call site's flat arguments, for one :class:`SimpleValues`.

    The simple fields, the unsupported ones (None) and the structure of
    every tensor-or-quantized field are constants of the call site: they
    are decoded once here.  A call then only places its tensors (and
    builds storages from buffers) into a dataclass made without running
    its ``__init__`` (the same fields, all given).  ``native``: what an op's
    native impl keeps for the call sites of these simple values (see
    :class:`CustomOpPair`)."""

    def __init__(self, plan: ArgPlan, simple):
        self.native = {}
        entries = simple.as_dict()
        self.cls = plan.cls
        self.constants = {}
        self.readers = []  # (field, position, how, extra)
        pos = 0
        for name, bucket in plan.fields:
            kind = bucket.kind
            if kind in ("simple", "unsupported"):
                self.constants[name] = bucket.decode([], entries.get(name))
            elif kind in ("tensor", "optional_tensor"):
                self.readers.append((name, pos, "plain", None))
            elif kind == "quantizer":
                self.readers.append((name, pos, "quantizer", None))
            elif kind == "process_group":
                self.readers.append((name, pos, "group", bucket))
            elif kind == "tensor_or_quantized":
                entry = entries[name]
                if entry[0] == "none":
                    self.constants[name] = None
                elif entry[0] == "tensor":
                    self.readers.append((name, pos, "first", None))
                else:
                    _, cls_name, dtype_name, extras, names = entry
                    storage = storage_registry()[cls_name]
                    self.readers.append((name, pos, "quantized",
                                         (storage, getattr(torch, dtype_name), extras, names)))
            else:  # pragma: no cover - bucket_for returns only the kinds above
                raise TypeError(f"no decoder for bucket kind {kind!r}")
            pos += bucket.n_args
        self.direct = plan.cls.__dict__.get("__post_init__") is None

    def __call__(self, flat):
        values = dict(self.constants)
        for name, pos, how, extra in self.readers:
            if how == "plain":
                values[name] = flat[pos]
            elif how == "first":
                values[name] = flat[pos][0]
            elif how == "quantizer":
                slot = flat[pos]
                values[name] = None if slot is None else slot.quantizer
            elif how == "group":
                values[name] = extra.decode([flat[pos]], None)
            else:
                tensors = flat[pos]
                if isinstance(tensors[0], QuantizedTensor):  # above the unwrap rule
                    values[name] = tensors[0]
                    continue
                storage, dtype, extras, names = extra
                slot = flat[pos + 2]
                values[name] = storage._assemble(
                    flat[pos + 1], dtype, None if slot is None else slot.quantizer, extras,
                    dict(zip(names, tensors)))
        if not self.direct:
            return self.cls(**values)
        args = object.__new__(self.cls)
        args.__dict__.update(values)
        return args
