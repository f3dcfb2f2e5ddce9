"""Views of op argument dataclasses, for ops built from other ops' impls.

``te.LayerNormLinear`` runs Linear's impls on its own arguments with the
input replaced (:func:`with_fields`); ``te.LayerNormMLP`` holds two GEMMs'
fields under ``fc1_`` / ``fc2_`` (:func:`prefixed_fields`), runs Linear's
impls on a view of each (:func:`field_view`) and builds its arguments from
per-GEMM ones (:func:`merge_views`).  Views share the values (no copies).

Building an instance: at run time without ``__init__`` (these argument
classes have no ``__post_init__``; a few us less per op call); traced (the
fakes run under Dynamo) through ``__init__``, which torch 2.11's Dynamo can
follow (it cannot follow ``__dict__`` updates).
"""

from __future__ import annotations

import dataclasses
import typing

import torch

from .updates import Update

FIELD_NAMES: dict = {}  # dataclass -> its field names (ArgPlan fills it; read when traced)


def field_names(cls) -> tuple:
    names = FIELD_NAMES.get(cls)
    if names is None:
        names = FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def instance(cls, values: dict):
    """An instance of the argument dataclass ``cls`` with every field in
    ``values`` (see the module docstring for how it is built)."""
    if torch.compiler.is_compiling():
        return cls(**values)
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def with_fields(args, **changes):
    """A shallow copy of a dataclass instance with ``changes``."""
    cls = type(args)
    return instance(cls, {**{n: getattr(args, n) for n in field_names(cls)}, **changes})


def prefixed_fields(cls, prefix: str, exclude=()) -> list:
    """``dataclasses.make_dataclass`` specs of ``cls``'s fields renamed
    ``prefix + name`` (resolved type hints; a field without a default gets
    None), leaving out ``exclude``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        out.append((prefix + f.name, hints[f.name], dataclasses.field(default=default)))
    return out


def field_view(args, cls, prefix: str, **overrides):
    """A ``cls`` instance of ``args``' fields ``prefix + name``, with
    ``overrides`` for the fields left out by :func:`prefixed_fields`."""
    return instance(cls, {name: overrides[name] if name in overrides
                           else getattr(args, prefix + name) for name in field_names(cls)})


def merge_views(cls, views: dict, **fields):
    """A ``cls`` instance from ``fields`` and, for each ``prefix -> view`` of
    ``views``, the view's fields that ``cls`` has as ``prefix + name``: the
    inverse of :func:`field_view`."""
    names = set(field_names(cls))
    for prefix, view in views.items():
        for name in field_names(type(view)):
            if prefix + name in names:
                fields[prefix + name] = getattr(view, name)
    return cls(**fields)


def prefixed(values: dict, prefix: str, exclude=()) -> dict:
    """``values`` with ``prefix`` before each key (``exclude`` left out); an
    :class:`Update`'s field is prefixed too."""
    return {prefix + k: (Update(prefix + v.field, v.how) if isinstance(v, Update) else v)
            for k, v in values.items() if k not in exclude}
