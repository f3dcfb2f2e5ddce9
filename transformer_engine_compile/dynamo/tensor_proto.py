"""TensorProto: a data-free prototype of a plain or quantized tensor.

A proto knows shape, dtype, quantizer (a private copy), requires_grad and
device.  It names the inner buffers in flatten order, builds the flatten
metadata, and materialises the tensor in pure Python (``torch.empty`` per
buffer, then the storage constructor), so it traces under
``torch.compile(fullgraph=True)`` and works under ``FakeTensorMode``: fake
impls of custom ops compute on protos.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..quantization.base import QuantizedTensorStorage, Quantizer, storage_parts, usages_of


def contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclasses.dataclass
class TensorProto:
    shape: tuple
    dtype: torch.dtype
    quantizer: Any = None
    requires_grad: bool = False
    device: Any = None

    def __post_init__(self):
        self.shape = tuple(self.shape)
        if self.quantizer is not None:
            if not isinstance(self.quantizer, Quantizer):
                raise TypeError(f"TensorProto.quantizer must be a Quantizer, "
                                f"got {type(self.quantizer).__name__}")
            self.quantizer = self.quantizer.copy()  # never mutate the caller's

    @property
    def is_quantized(self) -> bool:
        return self.quantizer is not None

    def stride(self) -> tuple:
        return contiguous_stride(self.shape)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None):
        """Change which copies the quantized tensor has (private quantizer only)."""
        if self.quantizer is None:
            raise ValueError("update_usage on a non-quantized TensorProto")
        self.quantizer = self.quantizer.with_usage(rowwise=rowwise, columnwise=columnwise)
        return self

    def buffer_layout(self) -> tuple:
        """``((name, shape, dtype), ...)`` in flatten order, validated against
        the storage's declaration (raises ValueError if they disagree)."""
        if self.quantizer is None:
            raise ValueError("buffer_layout on a non-quantized TensorProto")
        return self.quantizer.flatten_layout(self.shape)

    def inner_names(self) -> list:
        """Inner tensor names exactly as ``__tensor_flatten__`` reports them
        (``_<buffer>``, flatten order); ``[]`` for a plain tensor."""
        return [] if self.quantizer is None else ["_" + n for n, _, _ in self.buffer_layout()]

    def create_metadata(self):
        """Flatten ctx (QuantizedMeta) of the tensor this proto describes."""
        if self.quantizer is None:
            raise ValueError("create_metadata on a non-quantized TensorProto")
        return self.quantizer.create_metadata(self.shape, self.dtype, self.requires_grad)

    def create_tensor(self):
        """Allocate the tensor (uninitialised buffers); traceable, fake-safe."""
        if self.quantizer is None:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device,
                               requires_grad=self.requires_grad)
        buffers = {
            name: torch.empty(shape, dtype=dtype, device=self.device)
            for name, shape, dtype in self.buffer_layout()
        }
        return self.create_metadata().build(self.shape, buffers)


def to_tensor_proto(t) -> TensorProto:
    """Proto of a plain tensor, a quantized storage or a quantized wrapper."""
    if isinstance(t, QuantizedTensorStorage):
        names, _, _, quantizer = storage_parts(t)  # traceable on wrapper tensors too
        if quantizer is None:
            raise ValueError(f"{type(t).__name__} carries no quantizer; cannot describe it")
        usages = usages_of(type(t), names)
        wrapper = isinstance(t, torch.Tensor)
        q = quantizer.with_usage(rowwise=usages["rowwise"], columnwise=usages["columnwise"],
                                 internal=not wrapper)
        requires_grad = wrapper and t.requires_grad
        return TensorProto(tuple(t.shape), t.dtype, q, requires_grad, t.device)
    if isinstance(t, torch.Tensor):
        return TensorProto(tuple(t.shape), t.dtype, None, t.requires_grad, t.device)
    raise TypeError(f"to_tensor_proto: expected a tensor or quantized storage, got {type(t).__name__}")
