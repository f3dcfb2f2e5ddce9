"""MXFP8 (OCP MX v1.0): blocks of 32 elements share one E8M0 scale.

Rowwise blocks run along K, columnwise blocks along M; both copies keep the
(M, K) orientation (as Blackwell's MX GEMMs take them), each with its own
scales: ``rowwise_scale_inv`` (M, K/32) and ``columnwise_scale_inv``
(Mp/32, K) stored flat, uint8 biased exponents (255 = NaN).  Any M: the columnwise
copy holds Mp = M rounded up to 32 rows, the ones past M zero.
"""

from __future__ import annotations

from .. import kernels
from .opaque import register_value_opaque_quantizer
from ..kernels import reference as ref
from .base import BufferSpec, Quantizer, QuantizedTensorStorage, flat_2d, padded_rows
from .float8 import fp8_format_name
from .wrapper import QuantizedTensor

import torch


class MXFP8TensorStorage(QuantizedTensorStorage):
    _BUFFERS = (
        BufferSpec("rowwise_data", "rowwise", "FP8 values in the logical shape (..., K)"),
        BufferSpec("rowwise_scale_inv", "rowwise", "uint8 E8M0 (M, K/32): one per 32 along K"),
        BufferSpec("columnwise_data", "columnwise", "FP8 values of the (Mp, K) view"),
        BufferSpec("columnwise_scale_inv", "columnwise",
                   "uint8 E8M0 (Mp/32, K) stored flat: one per 32 along M"),
    )
    _ROW_BUFFERS = ("rowwise_data", "rowwise_scale_inv")
    _EXTRAS = ("fp8_format",)

    def _rowwise_2d(self):
        m, k = flat_2d(self._te_shape)
        return ref.dequantize_mxfp8(self._rowwise_data.reshape(m, k), self._rowwise_scale_inv, True)

    def _columnwise_2d(self):
        k = self._te_shape[-1]
        return ref.dequantize_mxfp8(self._columnwise_data.reshape(-1, k),
                                    self._column_scales(), False).t()

    def _column_scales(self):
        """columnwise_scale_inv (stored flat) as (Mp/32, K)."""
        return self._columnwise_scale_inv.view(-1, self._te_shape[-1])


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """MXFP8 wrapper tensor."""


@register_value_opaque_quantizer
class MXFP8Quantizer(Quantizer):
    format_name = "MXFP8"
    storage_cls = MXFP8TensorStorage
    tensor_cls = MXFP8Tensor
    _CONFIG_FIELDS = ("fp8_format", "rowwise_usage", "columnwise_usage", "internal")

    def __init__(self, fp8_format="e4m3", *, rowwise_usage=True, columnwise_usage=True,
                 internal=False):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        self.fp8_format = fp8_format_name(fp8_format)

    def divisibility(self):
        b = ref.MX_BLOCK
        return (b if self.rowwise_usage else 1, 1, "MXFP8")

    def column_block(self):
        return ref.MX_BLOCK if self.columnwise_usage else 1

    def _layout(self, shape, m, k):
        dt = ref.FP8_DTYPE[self.fp8_format]
        b = ref.MX_BLOCK
        mp = padded_rows(m, self.column_block())
        return {
            "rowwise_data": (shape, dt),
            "rowwise_scale_inv": ((m, k // b), torch.uint8),
            "columnwise_data": ((mp, k), dt),
            "columnwise_scale_inv": ((mp // b * k,), torch.uint8),
        }

    def _storage_extras(self):
        return (("fp8_format", self.fp8_format),)

    def pairs_with(self, other) -> bool:
        return type(other) is MXFP8Quantizer and other.fp8_format == self.fp8_format

    def _quantize_pair_2d(self, other, x2d, w2d):
        return kernels.get("quantize_mxfp8_pair", x2d)(
            x2d, w2d, self.fp8_format, (self.rowwise_usage, self.columnwise_usage),
            (other.rowwise_usage, other.columnwise_usage))

    def _quantize_2d(self, x2d):
        fn = kernels.get("quantize_mxfp8", x2d)
        return fn(x2d, self.fp8_format, self.rowwise_usage, self.columnwise_usage)
