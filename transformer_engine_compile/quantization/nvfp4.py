"""NVFP4: E2M1 values packed two per byte, one E4M3 decode scale per 16
elements, and a per-tensor fp32 amax that sets the second-level scale.

Rowwise data is (..., K/2) uint8; the columnwise copy is the (K, M)
transpose packed as (K, M/2).  Decode scales are (rows, cols/16)
float8_e4m3fn in each copy's orientation; with 2D (16x16) scaling every row
of a 16-row tile repeats the tile's scale.  With the random Hadamard
transform (RHT) the columnwise copy holds T·x per 16 elements along M (T
orthogonal), which leaves the wgrad GEMM dy^T x unchanged.  1D blocks take
any M: the columnwise copy then holds Mp = M rounded up to 16 columns, the
ones past M zero before the transform.
"""

from __future__ import annotations

import torch

from .. import kernels
from .opaque import register_value_opaque_quantizer
from ..kernels import reference as ref
from .base import BufferSpec, Quantizer, QuantizedTensorStorage, flat_2d, padded_rows
from .wrapper import QuantizedTensor


class NVFP4TensorStorage(QuantizedTensorStorage):
    _BUFFERS = (
        BufferSpec("rowwise_data", "rowwise", "uint8 (..., K/2): two E2M1 codes per byte"),
        BufferSpec("rowwise_scale_inv", "rowwise", "float8_e4m3fn (M, K/16) decode scales"),
        BufferSpec("rowwise_amax", "rowwise", "fp32 (1,) amax of the tensor"),
        BufferSpec("columnwise_data", "columnwise", "uint8 (K, Mp/2): transposed, packed along M"),
        BufferSpec("columnwise_scale_inv", "columnwise",
                   "float8_e4m3fn (K, Mp/16) decode scales, stored flat for 1D blocks"),
        BufferSpec("columnwise_amax", "columnwise", "fp32 (1,) amax of the (transformed) transpose"),
    )
    _ROW_BUFFERS = ("rowwise_data", "rowwise_scale_inv")
    _EXTRAS = ("with_rht",)

    def copy_parts(self, usage: str) -> tuple:
        """``(packed, block scales, amax)`` of one copy as a 2-D GEMM operand
        reduced along its last dim: rowwise (M, K/2), (M, K/16); columnwise
        (K, Mp/2), (K, Mp/16)."""
        if usage == "rowwise":
            m, k = flat_2d(self._te_shape)
            return (self._rowwise_data.reshape(m, k // 2), self._rowwise_scale_inv,
                    self._rowwise_amax)
        return self._columnwise_data, self._column_scales(), self._columnwise_amax

    def _rowwise_2d(self):
        return ref.dequantize_nvfp4(*self.copy_parts("rowwise"))

    def _columnwise_2d(self):
        # in the RHT basis when with_rht: both wgrad operands share it, so the
        # GEMM dy^T x is unchanged; dequantize() undoes it
        return ref.dequantize_nvfp4(*self.copy_parts("columnwise"))

    def _column_scales(self):
        """columnwise_scale_inv as (K, Mp/16) (stored flat for 1D blocks)."""
        return self._columnwise_scale_inv.view(self._te_shape[-1], -1)

    def _columnwise_to_values(self, xt):
        return ref.apply_rht(xt, inverse=True) if self._with_rht else xt


class NVFP4Tensor(NVFP4TensorStorage, QuantizedTensor):
    """NVFP4 wrapper tensor."""


def _config(q) -> tuple:
    """``kernels.quantize_nvfp4``'s arguments after the matrix, for quantizer
    ``q`` (a module function: Dynamo calls only a value-opaque quantizer's
    registered members)."""
    return (q.with_2d_quantization, q.with_rht, q.stochastic_rounding, q.rowwise_usage,
            q.columnwise_usage)


@register_value_opaque_quantizer
class NVFP4Quantizer(Quantizer):
    format_name = "NVFP4"
    storage_cls = NVFP4TensorStorage
    tensor_cls = NVFP4Tensor
    _CONFIG_FIELDS = ("rowwise_usage", "columnwise_usage", "internal", "with_rht",
                      "with_2d_quantization", "stochastic_rounding")

    def __init__(self, *, rowwise_usage=True, columnwise_usage=True, internal=False,
                 with_rht=False, with_2d_quantization=False, stochastic_rounding=False):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        if with_rht and with_2d_quantization:
            raise ValueError("NVFP4: with_rht (activations/gradients) and with_2d_quantization "
                             "(weights) cannot be combined in one quantizer")
        self.with_rht = bool(with_rht)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)

    def divisibility(self):
        b = ref.NVFP4_BLOCK
        two_d = self.with_2d_quantization
        return (b if self.rowwise_usage or two_d else 1, b if two_d else 1,
                "NVFP4 (16x16)" if two_d else "NVFP4")

    def column_block(self):
        one_d = not self.with_2d_quantization and self.columnwise_usage
        return ref.NVFP4_BLOCK if one_d else 1

    def _layout(self, shape, m, k):
        b = ref.NVFP4_BLOCK
        mp = padded_rows(m, self.column_block())
        return {
            "rowwise_data": ((*shape[:-1], k // 2), torch.uint8),
            "rowwise_scale_inv": ((m, k // b), torch.float8_e4m3fn),
            "rowwise_amax": ((1,), torch.float32),
            "columnwise_data": ((k, mp // 2), torch.uint8),
            "columnwise_scale_inv": (((k * (mp // b),) if self.column_block() > 1 else
                                      (k, m // b)), torch.float8_e4m3fn),
            "columnwise_amax": ((1,), torch.float32),
        }

    def _storage_extras(self):
        return (("with_rht", self.with_rht),)

    def pairs_with(self, other) -> bool:
        return type(other) is NVFP4Quantizer

    def _quantize_pair_2d(self, other, x2d, w2d):
        return kernels.get("quantize_nvfp4_pair", x2d)(x2d, w2d, _config(self), _config(other))

    def _quantize_2d(self, x2d):
        return kernels.get("quantize_nvfp4", x2d)(x2d, *_config(self))
