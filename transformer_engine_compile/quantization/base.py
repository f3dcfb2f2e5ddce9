"""Quantizer, storage and wrapper-tensor base classes shared by every format.

A format is three classes:

* a **quantizer** (configuration: format options and which usages to make),
* a **storage** (plain Python object holding the inner buffers), whose class
  declares its buffers once in ``_BUFFERS``; allocation, flatten order, fake
  layouts and the docs all read that declaration,
* a **wrapper tensor** (``torch.Tensor`` subclass with the storage's buffers)
  for tensors that live in user code, e.g. FP8 parameters.

Usages: the *rowwise* copy feeds GEMMs that reduce over the last dimension
(``y = x W^T``), the *columnwise* copy feeds GEMMs that reduce over the
flattened leading dimensions (wgrad, dgrad's weight).  See docs/formats.md.
"""

from __future__ import annotations

import copy as _copy
import math
from typing import Any, ClassVar, NamedTuple

import torch

from ..compat import OpaqueBase

HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# storage / wrapper classes by "module.QualName", filled by __init_subclass__
_STORAGE_REGISTRY: dict[str, type] = {}


class BufferSpec(NamedTuple):
    """One inner buffer of a storage class: name, the usage it serves, meaning."""

    name: str
    usage: str  # "rowwise", "columnwise" or "both"
    doc: str


class BufferDesc(NamedTuple):
    """Shape and dtype of one inner buffer, known without data.

    A NamedTuple (not a dataclass) so Dynamo can hold it as a constant when a
    value-opaque quantizer returns it from a ``USE_REAL`` method."""

    shape: tuple
    dtype: torch.dtype


class QuantizedMeta(NamedTuple):
    """The non-tensor half of a quantized tensor (its flatten ctx).

    ``quantizer`` is a private copy of the quantizer that made the tensor; in
    a flatten ctx a stateful quantizer is replaced by None, so no tensor
    hides in the ctx.  ``extras``
    holds the storage's non-tensor constructor arguments as name/value pairs.
    """

    cls_name: str
    dtype: torch.dtype
    quantizer: Any
    extras: tuple
    requires_grad: bool = False

    def storage_class(self) -> type:
        return _STORAGE_REGISTRY[self.cls_name]

    def build(self, shape, buffers: dict):
        """Construct the tensor/storage from its buffers (pure Python, traceable)."""
        cls = _STORAGE_REGISTRY[self.cls_name]
        return cls(
            shape,
            self.dtype,
            quantizer=self.quantizer,
            requires_grad=self.requires_grad,
            **dict(self.extras),
            **buffers,
        )


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def padded_rows(m, block: int):
    """``m`` rounded up to a multiple of ``block`` (works on SymInts)."""
    return m if block == 1 else (m + block - 1) // block * block


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """The detached (M, K) view of ``x`` the kernels quantize."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def flat_column_scales(out: dict, column_block: int) -> dict:
    """A kernel's buffers with the columnwise scales (one per block of rows)
    stored flat where the format pads rows (``Quantizer.column_block`` > 1,
    see there).  A function, not a quantizer method: Dynamo traces
    ``quantize`` and may only call a value-opaque quantizer's registered
    members."""
    scales = out.get("columnwise_scale_inv")
    if scales is not None and column_block != 1:
        out["columnwise_scale_inv"] = scales.reshape(-1)
    return out


def flat_2d(shape) -> tuple:
    """(M, K): rows = product of leading dims, K = last dim."""
    return math.prod(shape[:-1]), shape[-1]


def _cut_rows(t: torch.Tensor, m: int, name: str, storage_cls) -> torch.Tensor:
    """Buffer ``name`` of a matrix quantized with padding rows, cut back to
    its first ``m`` rows (contiguous, with the strides the fakes give: a
    row-last buffer is copied, which only a ragged row count pays)."""
    if name in storage_cls._ROWS_LAST:
        return t[..., :m].clone(memory_format=torch.contiguous_format)
    return t[:m] if name in storage_cls._ROW_BUFFERS else t


def _usage_on(spec_usage: str, rowwise: bool, columnwise: bool) -> bool:
    if spec_usage == "both":
        return rowwise or columnwise
    return rowwise if spec_usage == "rowwise" else columnwise


class Quantizer(OpaqueBase):
    """Base quantizer: usage flags plus the layout hooks every format implements.

    Subclasses set ``format_name``, ``storage_cls``, ``tensor_cls``,
    ``_CONFIG_FIELDS`` and implement ``_layout``, ``_check_dims`` and
    ``_quantize_2d``.  No ``@property`` here: opaque classes can't use them.
    """

    format_name: ClassVar[str] = "abstract"
    storage_cls: ClassVar[type]
    tensor_cls: ClassVar[type]
    _CONFIG_FIELDS: ClassVar[tuple] = ("rowwise_usage", "columnwise_usage", "internal")
    # read by compiled code: evaluated on the real object (USE_REAL)
    _COMPILE_MEMBERS: ClassVar[tuple] = (
        "format_name", "storage_cls", "tensor_cls", "copy", "with_usage", "describe_buffers",
        "flatten_layout", "create_metadata", "check_shape", "divisibility", "is_stateful",
        "_te_value_opaque", "gathers_quantized", "usage_variant", "column_block",
    )
    # compute on tensors: traced by Dynamo (INLINED)
    _INLINED_MEMBERS: ClassVar[tuple] = (
        "quantize", "__call__", "_check_input", "_quantize_2d", "_quantize_rows", "_scale_for",
        "_build",
    )
    _te_value_opaque: ClassVar[bool] = False
    # tensor parallelism may quantize shards and gather the quantized bytes
    # (needs one scale per tensor and quantize_with_amax; see distributed.py)
    gathers_quantized: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._te_value_opaque = False  # registration is per concrete class

    def __init__(self, *, rowwise_usage: bool = True, columnwise_usage: bool = True,
                 internal: bool = False):
        self.rowwise_usage = bool(rowwise_usage)
        self.columnwise_usage = bool(columnwise_usage)
        self.internal = bool(internal)

    # -- configuration -------------------------------------------------------
    def is_stateful(self) -> bool:
        """True when the quantizer holds tensors (delayed scaling)."""
        return False

    def pairs_with(self, other) -> bool:
        """Whether this quantizer and ``other`` quantize a layer's x and W in
        one kernel (``quantize_pair_unchecked(x, other, w)``; under delayed
        scaling ``quantize_stepped``); formats that support it override."""
        return False

    def quantize_pair_unchecked(self, x: torch.Tensor, other, w: torch.Tensor) -> tuple:
        """``(self.quantize_unchecked(x), other.quantize_unchecked(w))`` for a
        quantizer ``other`` that :meth:`pairs_with` this one: the same
        buffers, on the GPU from one launch (``_quantize_pair_2d``) instead
        of two, unless a row count needs the padding of
        :meth:`_quantize_rows` (then one quantization each)."""
        x2d, w2d = rows_2d(x), rows_2d(w)
        xb, wb = self.column_block(), other.column_block()
        if x2d.shape[0] % xb or w2d.shape[0] % wb:
            return self.quantize_unchecked(x), other.quantize_unchecked(w)
        bx, bw = self._quantize_pair_2d(other, x2d, w2d)
        return (self._from_buffers(x.shape, x.dtype, flat_column_scales(bx, xb)),
                other._from_buffers(w.shape, w.dtype, flat_column_scales(bw, wb)))

    def _quantize_pair_2d(self, other, x2d: torch.Tensor, w2d: torch.Tensor) -> tuple:
        """``(self._quantize_2d(x2d), other._quantize_2d(w2d))`` in one kernel
        call; formats whose :meth:`pairs_with` pairs override."""
        raise NotImplementedError

    def copy(self):
        q = _copy.copy(self)
        q.__dict__.pop("_variants", None)  # the copy memoizes its own
        return q

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None):
        """Change which copies ``quantize`` makes (mutates; eager code only)."""
        self.__dict__.pop("_variants", None)
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def usage_variant(self, rowwise: bool, columnwise: bool):
        """Like ``with_usage(rowwise=..., columnwise=...)``, but memoized on
        this object: the op impls ask for the same few variants on every
        call.  The result is shared, so callers must never mutate it."""
        variants = self.__dict__.get("_variants")
        if variants is None:
            variants = self.__dict__["_variants"] = {}
        key = (bool(rowwise), bool(columnwise))
        q = variants.get(key)
        if q is None:
            q = variants[key] = (self if (self.rowwise_usage, self.columnwise_usage) == key
                                 else self.with_usage(rowwise=key[0], columnwise=key[1]))
        return q

    def with_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None,
                   internal: bool | None = None):
        """A copy with changed usage (and ``internal`` flag); safe inside compiled code."""
        q = self.copy()
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        if internal is not None:
            q.internal = bool(internal)
        return q

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._CONFIG_FIELDS)
        return f"{type(self).__name__}({fields})"

    # -- layout ----------------------------------------------------------------
    def check_shape(self, shape) -> None:
        """Raise ValueError if this format/usage cannot hold a tensor of ``shape``."""
        if len(shape) == 0:
            raise ValueError(f"{self.format_name}: cannot quantize a 0-dim tensor")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{self.format_name}: quantizer has neither rowwise nor columnwise usage")
        m, k = flat_2d(shape)
        self._check_dims(m, k)

    def divisibility(self) -> tuple:
        """``(last-dim multiple, leading-dims multiple, label)`` the format's
        blocks need under the current usages (1 = any size).  Takes no
        shape, so compiled code can read it and test symbolic sizes itself."""
        raise NotImplementedError

    def column_block(self) -> int:
        """Rows one block of the columnwise copy spans, where the format
        pads the row count up to it (1: no padding).  Formats whose
        columnwise blocks run along the rows (1x128 FP8 blockwise, MXFP8,
        NVFP4) take any row count: their columnwise buffers hold the rows
        padded with zeros to a multiple of the block, which leaves every
        block's amax and the wgrad GEMM over the rows unchanged.  Their
        ``columnwise_scale_inv`` (one scale per block of rows) is then
        declared and stored 1-D: a dim counting row blocks is 1 for short
        inputs, and torch's tracing guards on a size-1 dim (a second graph
        for counts below one block); readers view it 2-D."""
        return 1

    def _check_dims(self, m: int, k: int) -> None:
        k_mult, m_mult, label = self.divisibility()
        if k % k_mult:
            raise ValueError(f"{label} needs the last dim divisible by {k_mult}, got {k}")
        if m % m_mult:
            raise ValueError(f"{label} needs the flattened leading dims divisible by "
                             f"{m_mult}, got {m}")

    def _layout(self, shape, m: int, k: int) -> dict:
        """All buffers of the format: name -> (shape, dtype), both usages;
        columnwise buffers count ``padded_rows(m, column_block())`` rows."""
        raise NotImplementedError

    def describe_buffers(self, shape) -> dict:
        """Buffers ``quantize`` makes for ``shape``, in the storage's flatten order."""
        self.check_shape(shape)
        m, k = flat_2d(shape)
        layout = self._layout(tuple(shape), m, k)
        declared = [s.name for s in self.storage_cls._BUFFERS]
        if sorted(layout) != sorted(declared):
            raise RuntimeError(
                f"{type(self).__name__}._layout names {sorted(layout)} but "
                f"{self.storage_cls.__name__} declares {declared}"
            )
        return {
            s.name: BufferDesc(tuple(layout[s.name][0]), layout[s.name][1])
            for s in self.storage_cls._BUFFERS
            if _usage_on(s.usage, self.rowwise_usage, self.columnwise_usage)
        }

    def flatten_layout(self, shape) -> tuple:
        """``((name, shape, dtype), ...)`` of ``describe_buffers``, checked
        against the storage's declared flatten order.  Runs on the real
        object under compile (USE_REAL): torch 2.11 cannot iterate the
        declaration inside a trace."""
        descs = self.describe_buffers(shape)
        declared = [s.name for s in self.storage_cls._BUFFERS]
        names = list(descs)
        if any(n not in declared for n in names) or [n for n in declared if n in names] != names:
            raise ValueError(
                f"{type(self).__name__} describes buffers {names}, which are not in "
                f"{self.storage_cls.__name__}'s declared flatten order {declared}")
        return tuple((n, tuple(d.shape), d.dtype) for n, d in descs.items())

    def alloc_tensors(self, shape, device=None) -> dict:
        """Uninitialised inner buffers for ``shape`` (no data, any device)."""
        return {name: torch.empty(size, dtype=dtype, device=device)
                for name, size, dtype in self.flatten_layout(shape)}

    def _storage_extras(self) -> tuple:
        """Non-tensor constructor arguments of the storage, as name/value pairs."""
        return ()

    def create_metadata(self, shape=None, dtype=torch.float32, requires_grad: bool = False):
        """Everything but the buffers needed to build the quantized tensor."""
        cls = self.storage_cls if self.internal else self.tensor_cls
        return QuantizedMeta(class_key(cls), dtype, self.copy(), self._storage_extras(),
                             bool(requires_grad))

    # -- numerics ----------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedTensorStorage):
            raise TypeError(f"{self.format_name}: expected a high-precision torch.Tensor, "
                            f"got {type(x).__name__}")
        if x.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{self.format_name}: input dtype must be one of "
                            f"{HIGH_PRECISION_DTYPES}, got {x.dtype}")
        self.check_shape(tuple(x.shape))

    def _quantize_2d(self, x2d: torch.Tensor) -> dict:
        """Format numerics on the (M, K) view: name -> buffer for enabled usages."""
        raise NotImplementedError

    def _quantize_rows(self, x2d: torch.Tensor) -> dict:
        """``_quantize_2d`` for any row count: a matrix whose rows are not a
        multiple of :meth:`column_block` is quantized with zero rows
        appended (one copy of ``x``, the cost of a ragged count), and the
        rowwise buffers are cut back to the real rows."""
        b = self.column_block()
        m = x2d.shape[0]
        if b == 1:
            return self._quantize_2d(x2d)
        if m % b == 0:
            out = self._quantize_2d(x2d)
        else:
            out = self._quantize_2d(torch.nn.functional.pad(x2d, (0, 0, 0, b - m % b)))
            out = {name: _cut_rows(t, m, name, self.storage_cls) for name, t in out.items()}
        return flat_column_scales(out, b)

    def quantize(self, x: torch.Tensor):
        """Quantize ``x`` (shape ``(..., K)``) into this format's tensor."""
        self._check_input(x)
        m, k = flat_2d(x.shape)
        return self._build(x.shape, x.dtype, self._quantize_rows(x.detach().reshape(m, k)))

    def _build(self, shape, dtype, buffers: dict):
        """The quantized tensor from kernel buffers made on the (M, K) view."""
        expected = self.describe_buffers(tuple(shape))
        if sorted(buffers) != sorted(expected):
            raise RuntimeError(f"{type(self).__name__} made buffers {sorted(buffers)}, "
                               f"its layout declares {list(expected)}")
        # kernels work on the (M, K) view; give each buffer its declared shape
        buffers = {name: buffers[name].view(desc.shape) for name, desc in expected.items()}
        return self.create_metadata(shape, dtype).build(shape, buffers)

    def __call__(self, x: torch.Tensor):
        return self.quantize(x)

    # -- lean path of the op impls -------------------------------------------------
    def quantize_unchecked(self, x: torch.Tensor):
        """``quantize`` without input validation or layout checks, for the op
        impls: the layer validated the shapes before the ops, and the
        layout-parity tests hold kernels to the declared buffers.  Never
        traced by Dynamo (op impls run at run time)."""
        return self._from_buffers(x.shape, x.dtype, self._quantize_rows(rows_2d(x)))

    def from_buffers(self, shape, dtype, buffers: dict):
        """The quantized tensor from buffers a fused kernel made in this
        quantizer's layout on the (M, K) view (the normalisation that writes
        FP8 directly), unchecked like :meth:`quantize_unchecked`."""
        return self._from_buffers(shape, dtype, buffers)

    def _from_buffers(self, shape, dtype, buffers: dict):
        """The quantized tensor from kernel buffers made on the (M, K) view,
        without re-deriving the layout: only the rowwise data buffer carries
        the leading dims of an N-D ``shape``."""
        cls = self.storage_cls if self.internal else self.tensor_cls
        logical = cls._LOGICAL_BUFFER
        if len(shape) != 2 and logical in buffers:
            data = buffers[logical]
            buffers = {**buffers, logical: data.view(*shape[:-1], data.shape[-1])}
        return cls._assemble(shape, dtype, self, self._storage_extras(), buffers)


class QuantizedTensorStorage:
    """Holder of a quantized tensor's inner buffers (no autograd, no dispatch).

    Subclasses declare ``_BUFFERS`` (flatten order) and ``_EXTRAS`` (names of
    non-tensor constructor arguments) and implement ``_dequantize_2d``.
    Buffers are stored as ``self._<name>``; absent usages hold None.  No
    other attribute holds a tensor: the eager path saves a storage for
    backward as its buffers plus a copy of its other attributes
    (``dynamo.flat_result.pack_saved``), and only the buffers pass through
    saved-tensor hooks.
    """

    _BUFFERS: ClassVar[tuple] = ()
    _EXTRAS: ClassVar[tuple] = ()
    # the rowwise data buffer, the one buffer in the logical (..., K) shape
    _LOGICAL_BUFFER: ClassVar[str | None] = None
    # buffers with one row per row of the (M, K) matrix (cut back after padding)
    _ROW_BUFFERS: ClassVar[tuple] = ()
    # those of them whose last dim counts the rows (FP8 blockwise 1D scales)
    _ROWS_LAST: ClassVar[tuple] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _STORAGE_REGISTRY[class_key(cls)] = cls
        cls._LOGICAL_BUFFER = next((s.name for s in cls._BUFFERS if s.usage == "rowwise"), None)
        cls._BUFFER_ATTRS = tuple((s.name, "_" + s.name) for s in cls._BUFFERS)
        cls._USAGE_ATTRS = {usage: tuple("_" + s.name for s in cls._BUFFERS if s.usage == usage)
                            for usage in ("rowwise", "columnwise")}
        cls._EMPTY_ATTRS = {"_" + s.name: None for s in cls._BUFFERS}

    @classmethod
    def _assemble(cls, shape, dtype, quantizer, extras: tuple, buffers: dict):
        """Construct from parts without ``__init__``'s argument checks (the
        op impls' hot path; ``buffers`` holds declared names only).  Wrapper
        tensors need their constructor."""
        if issubclass(cls, torch.Tensor):
            return cls(shape, dtype, quantizer=quantizer, **dict(extras), **buffers)
        obj = object.__new__(cls)
        attrs = obj.__dict__
        attrs["_te_shape"] = shape if type(shape) is torch.Size else torch.Size(shape)
        attrs["_te_dtype"] = dtype
        attrs["_quantizer"] = quantizer
        attrs.update(cls._EMPTY_ATTRS)
        for name, t in buffers.items():
            attrs["_" + name] = t
        for name, value in extras:
            attrs["_" + name] = value
        return obj

    def __init__(self, shape, dtype, *, quantizer=None, requires_grad=False, **kwargs):
        self._te_shape = torch.Size(shape)
        self._te_dtype = dtype
        self._quantizer = quantizer
        for spec in self._BUFFERS:
            setattr(self, "_" + spec.name, kwargs.pop(spec.name, None))
        for name in self._EXTRAS:
            setattr(self, "_" + name, kwargs.pop(name))
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(kwargs)}")
        if all(getattr(self, "_" + s.name) is None for s in self._BUFFERS):
            raise ValueError(f"{type(self).__name__}: no inner buffer given")

    # plain-storage view of the logical tensor (wrappers use torch.Tensor's own)
    @property
    def shape(self) -> torch.Size:
        return self._te_shape

    @property
    def dtype(self) -> torch.dtype:
        return self._te_dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers().values())).device

    def size(self, dim=None):
        return self._te_shape if dim is None else self._te_shape[dim]

    # -- buffers -----------------------------------------------------------------
    def buffers(self) -> dict:
        """Present inner buffers, in declaration (flatten) order."""
        attrs = self.__dict__
        return {name: t for name, attr in self._BUFFER_ATTRS if (t := attrs[attr]) is not None}

    def extras(self) -> tuple:
        return tuple((name, getattr(self, "_" + name)) for name in self._EXTRAS)

    def has_usage(self, usage: str) -> bool:
        """Whether this tensor holds its ``usage`` copy (``"rowwise"`` or
        ``"columnwise"``): a buffer of that usage is present.  Attribute reads
        only; the GEMMs ask this of every operand."""
        for attr in self._USAGE_ATTRS[usage]:
            if getattr(self, attr) is not None:
                return True
        return False

    def get_usages(self) -> dict:
        return {"rowwise": self.has_usage("rowwise"), "columnwise": self.has_usage("columnwise")}

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> None:
        """Drop copies that are no longer needed. Creating a missing copy is not
        supported: the data it would be made from may already be gone."""
        usages = self.get_usages()
        for usage, want in (("rowwise", rowwise_usage), ("columnwise", columnwise_usage)):
            if want and not usages[usage]:
                raise RuntimeError(f"{type(self).__name__} has no {usage} copy to keep; "
                                   "quantize again with that usage")
        keep_row = usages["rowwise"] if rowwise_usage is None else rowwise_usage
        keep_col = usages["columnwise"] if columnwise_usage is None else columnwise_usage
        if not (keep_row or keep_col):
            raise ValueError("update_usage would drop every copy of the data")
        for spec in self._BUFFERS:
            if not _usage_on(spec.usage, keep_row, keep_col):
                setattr(self, "_" + spec.name, None)

    # -- flatten protocol -------------------------------------------------------
    def _meta(self) -> QuantizedMeta:
        requires_grad = isinstance(self, torch.Tensor) and self.requires_grad
        q = self._quantizer
        if q is not None and q.is_stateful():
            q = None  # tensors inside a flatten ctx would escape the graph
        return QuantizedMeta(class_key(type(self)), self.dtype, q, self.extras(), requires_grad)

    def __tensor_flatten__(self):
        """Attribute names of the present buffers (``_<name>``, declaration
        order) and the metadata; torch reads the buffers with ``getattr``."""
        return ["_" + name for name in self.buffers()], self._meta()

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return meta.build(outer_size, {k[1:]: v for k, v in inner_tensors.items()})

    # -- numerics ----------------------------------------------------------------
    def _rowwise_2d(self) -> torch.Tensor:
        """fp32 values of the rowwise copy as the (M, K) matrix."""
        raise NotImplementedError

    def _columnwise_2d(self) -> torch.Tensor:
        """fp32 values of the columnwise copy as the (K, M) matrix, in the
        copy's own basis (formats may transform it, see NVFP4's RHT)."""
        raise NotImplementedError

    def _columnwise_to_values(self, xt: torch.Tensor) -> torch.Tensor:
        return xt

    def gemm_operand_check(self, usage: str) -> None:
        """Raise unless this tensor holds the ``usage`` copy."""
        if not self.has_usage(usage):
            raise RuntimeError(f"{type(self).__name__} has no {usage} copy; the quantizer "
                               f"that made it did not enable {usage} usage")

    def gemm_operand(self, usage: str) -> torch.Tensor:
        """fp32 2-D GEMM operand reduced along its last dim: the rowwise copy
        as (M, K) or the columnwise copy as (K, M).  Raises if that copy is absent."""
        self.gemm_operand_check(usage)
        return self._rowwise_2d() if usage == "rowwise" else self._columnwise_2d()

    def _dequantize_2d(self) -> torch.Tensor:
        if self.has_usage("rowwise"):
            return self._rowwise_2d()
        m = flat_2d(self._te_shape)[0]  # the columnwise copy may hold padding rows
        return self._columnwise_to_values(self._columnwise_2d()).t()[:m]

    def dequantize(self, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision copy of the values, in ``dtype`` (default: logical dtype)."""
        out = self._dequantize_2d().reshape(self._te_shape)
        return out.to(dtype or self._te_dtype)

    def __repr__(self):
        usages = self.get_usages()
        return (f"{type(self).__name__}(shape={tuple(self._te_shape)}, dtype={self._te_dtype}, "
                f"rowwise={usages['rowwise']}, columnwise={usages['columnwise']}, "
                f"extras={dict(self.extras())})")


def storage_parts(t) -> tuple:
    """``(names, buffers, extras, quantizer)`` of a storage or wrapper tensor,
    from attribute reads only: Dynamo can trace those on a wrapper tensor,
    but not a call to one of its methods that returns non-tensors."""
    cls = type(t)
    names = tuple(s.name for s in cls._BUFFERS if getattr(t, "_" + s.name) is not None)
    buffers = [getattr(t, "_" + n) for n in names]
    extras = tuple((n, getattr(t, "_" + n)) for n in cls._EXTRAS)
    return names, buffers, extras, t._quantizer


def usages_of(cls, names) -> dict:
    """Which copies the buffers ``names`` of storage class ``cls`` make up."""
    present = {s.usage for s in cls._BUFFERS if s.name in names}
    return {"rowwise": "rowwise" in present, "columnwise": "columnwise" in present}


def storage_registry() -> dict:
    """Read-only view of the class registry used by ``__tensor_unflatten__``."""
    return dict(_STORAGE_REGISTRY)
