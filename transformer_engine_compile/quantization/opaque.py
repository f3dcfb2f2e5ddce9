"""Value-opaque registration of quantizers.

A value-opaque quantizer is pure configuration.  Dynamo bakes it into the
graph as a constant and guards on ``__eq__``, so an equal instance reuses the
compiled graph and a changed configuration recompiles.  Mutable state (amax
history, scales) must never live in such an object.

Rules this module enforces (see docs/value_opaque.md):

* ``__eq__`` / ``__hash__`` cover the class and its ``_CONFIG_FIELDS`` only.
* ``__fx_repr__`` rebuilds the object from those fields as keyword arguments.
  Only ``None``, ``bool``, ``int``, ``float`` and ``str`` values are allowed:
  anything else (a ``torch.dtype``, the ``torch`` module) would break the FX
  graph cache, so formats are stored as strings.
* Every attribute and method that compiled code may read is listed as a
  ``USE_REAL`` member (torch 2.11 needs the list; 2.13 tolerates it).
  ``@property`` is not allowed on these classes (2.13 cannot trace it).
"""

from __future__ import annotations

import operator
import warnings

from .. import compat

_ALLOWED_VALUE_TYPES = (type(None), bool, int, float, str)
_unavailable_reported = False


def _config_key(obj) -> tuple:
    # one C call (operator.attrgetter, made at registration): Dynamo's guards
    # compare the quantizers of every quantized tensor a compiled call takes
    fields, get = obj._te_config_key
    if fields is not obj._CONFIG_FIELDS:  # a subclass with fields of its own
        return tuple(getattr(obj, name) for name in obj._CONFIG_FIELDS)
    return get(obj)


def _key_getter(fields):
    """``obj -> tuple of obj's fields``."""
    if len(fields) == 1:
        get = operator.attrgetter(fields[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*fields)


def _value_eq(self, other) -> bool:
    return self is other or (type(self) is type(other) and _config_key(self) == _config_key(other))


def _value_hash(self) -> int:
    return hash((type(self).__qualname__, _config_key(self)))


def _fx_repr(self):
    cls = type(self)
    parts = []
    for name in cls._CONFIG_FIELDS:
        value = getattr(self, name)
        if not isinstance(value, _ALLOWED_VALUE_TYPES):
            raise TypeError(
                f"{cls.__name__}.{name}={value!r}: value-opaque config fields must be "
                "None, bool, int, float or str to keep the FX graph cache working"
            )
        parts.append(f"{name}={value!r}")
    return f"{cls.__name__}({', '.join(parts)})", {cls.__name__: cls}


def _report_unavailable_once() -> None:
    global _unavailable_reported
    if not _unavailable_reported:
        _unavailable_reported = True
        warnings.warn(
            "transformer_engine_compile: torch.compile support is off "
            f"({compat.OPAQUE_UNAVAILABLE_REASON}); eager mode works as usual.",
            RuntimeWarning,
            stacklevel=3,
        )


def register_value_opaque_quantizer(cls):
    """Class decorator: give ``cls`` value semantics and register it as opaque.

    ``cls`` declares ``_CONFIG_FIELDS`` (constructor keyword names stored as
    attributes of the same name), ``_COMPILE_MEMBERS`` (other attributes and
    methods compiled code may read; evaluated on the real object) and
    ``_INLINED_MEMBERS`` (methods that compute on tensors; traced).  Each concrete class must be
    registered itself: torch 2.11 matches the exact class.
    """
    if not hasattr(cls, "_CONFIG_FIELDS"):
        raise TypeError(f"{cls.__name__} declares no _CONFIG_FIELDS")
    if cls.__qualname__ != cls.__name__:
        raise TypeError(f"{cls.__qualname__}: value-opaque classes must be module-level")
    for name, attr in vars(cls).items():
        if isinstance(attr, property):
            raise TypeError(
                f"{cls.__name__}.{name} is a @property; torch 2.13 cannot read properties "
                "of opaque objects, use a plain attribute or method"
            )
    cls._te_config_key = (cls._CONFIG_FIELDS, _key_getter(tuple(cls._CONFIG_FIELDS)))
    cls.__eq__ = _value_eq
    cls.__hash__ = _value_hash
    cls.__fx_repr__ = _fx_repr
    # torch refuses members the class lacks (e.g. _scale_for on non-FP8 formats)
    inlined = tuple(m for m in getattr(cls, "_INLINED_MEMBERS", ()) if hasattr(cls, m))
    members = tuple(m for m in dict.fromkeys(tuple(cls._CONFIG_FIELDS) + tuple(cls._COMPILE_MEMBERS))
                    if m not in inlined)
    registered = compat.register_value_type(cls, members, inlined)
    cls._te_value_opaque = registered
    if not registered:
        _report_unavailable_once()
    return cls


def is_value_opaque(obj) -> bool:
    """True when ``obj``'s exact class was registered as value-opaque.

    Reads a class attribute (compile-safe) that ``Quantizer.__init_subclass__``
    resets to False on every subclass, so registration is never inherited.
    """
    return bool(getattr(obj, "_te_value_opaque", False))


def compile_support() -> tuple[bool, str | None]:
    """``(available, reason)`` for the opaque-object API on this torch."""
    return compat.OPAQUE_UNAVAILABLE_REASON is None, compat.OPAQUE_UNAVAILABLE_REASON
