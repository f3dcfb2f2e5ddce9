"""FP8 blockwise: 1x128 tiles (activations, gradients) or 128x128 blocks
(weights) with fp32 scales, optionally powers of two.

Rowwise data keeps the logical shape; the columnwise copy is the (K, M)
transpose.  2D scales: rowwise (M/128, K/128), columnwise its transpose.
Scales are stored as the block-scaled GEMM reads them, so cuBLAS takes
them (or their transposed views) as they are instead of a copy per GEMM.
1D: one scale per (row, block of 128 along the reduced dim), blocks outer,
i.e. rowwise (K/128, M) and columnwise (Mp/128, K) (flat; Transformer
Engine pads these, we do not need to).  2D: rowwise (M/128, K/128) and
columnwise (K/128, M/128), each with its last dim padded with zeros to a
multiple of 4 (``reference.padded_blocks``), as cuBLAS requires and
Transformer Engine stores them.  1D tiles take any M: the columnwise
copy then holds Mp = M rounded up to 128 columns, the ones past M zero
(``Quantizer.column_block``).
"""

from __future__ import annotations

import torch

from .. import kernels
from .opaque import register_value_opaque_quantizer
from ..kernels import reference as ref
from .base import BufferSpec, Quantizer, QuantizedTensorStorage, flat_2d, padded_rows
from .float8 import fp8_format_name
from .wrapper import QuantizedTensor


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    _BUFFERS = (
        BufferSpec("rowwise_data", "rowwise", "FP8 values in the logical shape (..., K)"),
        BufferSpec("rowwise_scale_inv", "rowwise",
                   "fp32 (K/128, M) for 1D (blocks outer, as the GEMM reads it), "
                   "(M/128, K/128) for 2D, its last dim padded to a multiple of 4"),
        BufferSpec("columnwise_data", "columnwise", "FP8 values transposed: (K, Mp)"),
        BufferSpec("columnwise_scale_inv", "columnwise",
                   "fp32 (Mp/128, K) stored flat for 1D (blocks outer), (K/128, M/128) "
                   "for 2D, its last dim padded to a multiple of 4"),
    )
    _ROW_BUFFERS = ("rowwise_data", "rowwise_scale_inv")
    _ROWS_LAST = ("rowwise_scale_inv",)  # 1D: the rows are its last dim
    _EXTRAS = ("fp8_format", "block_scaling_dim")

    def _row_scales(self):
        """rowwise_scale_inv as (M, K/128) (1D: a view of the blocks-outer
        buffer) or (M/128, K/128 padded) (2D, as stored)."""
        s = self._rowwise_scale_inv
        return s if self._block_scaling_dim == 2 else s.t()

    def _rowwise_2d(self):
        m, k = flat_2d(self._te_shape)
        return ref.dequantize_fp8_blockwise(self._rowwise_data.reshape(m, k),
                                            self._row_scales(), self._block_scaling_dim == 2)

    def _column_scales(self):
        """columnwise_scale_inv as (K, Mp/128) (1D: a view of the flat
        blocks-outer buffer) or (K/128, M/128 padded) (2D, as stored)."""
        s = self._columnwise_scale_inv
        return s if self._block_scaling_dim == 2 else s.view(-1, self._te_shape[-1]).t()

    def _columnwise_2d(self):
        return ref.dequantize_fp8_blockwise(self._columnwise_data, self._column_scales(),
                                            self._block_scaling_dim == 2)

    def fp8_operand(self, usage: str):
        """(FP8 data reduced along its last dim, its fp32 block scale_inv) of one
        copy, without dequantizing: what a block-scaled GEMM takes.  1D
        scales come as (rows, blocks) views with stride (1, rows), 2D as
        stored (blocks padded to a multiple of 4): the layouts cuBLAS reads."""
        self.gemm_operand_check(usage)
        if usage == "rowwise":
            m, k = flat_2d(self._te_shape)
            return self._rowwise_data.reshape(m, k), self._row_scales()
        return self._columnwise_data, self._column_scales()


class Float8BlockwiseQTensor(Float8BlockwiseQTensorStorage, QuantizedTensor):
    """FP8 blockwise wrapper tensor."""


@register_value_opaque_quantizer
class Float8BlockQuantizer(Quantizer):
    format_name = "FP8 blockwise"
    storage_cls = Float8BlockwiseQTensorStorage
    tensor_cls = Float8BlockwiseQTensor
    _CONFIG_FIELDS = ("fp8_format", "rowwise_usage", "columnwise_usage", "internal",
                      "block_scaling_dim", "force_pow_2_scales", "amax_epsilon")

    def __init__(self, fp8_format="e4m3", *, rowwise_usage=True, columnwise_usage=True,
                 internal=False, block_scaling_dim=2, force_pow_2_scales=True, amax_epsilon=0.0):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 (1x128) or 2 (128x128), "
                             f"got {block_scaling_dim}")
        self.fp8_format = fp8_format_name(fp8_format)
        self.block_scaling_dim = int(block_scaling_dim)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def divisibility(self):
        b = ref.FP8_BLOCK
        two_d = self.block_scaling_dim == 2
        tile = "128x128" if two_d else "1x128"
        return (b if self.rowwise_usage or two_d else 1, b if two_d else 1,
                f"FP8 blockwise ({tile})")

    def column_block(self):
        one_d = self.block_scaling_dim == 1 and self.columnwise_usage
        return ref.FP8_BLOCK if one_d else 1

    def _layout(self, shape, m, k):
        dt = ref.FP8_DTYPE[self.fp8_format]
        b = ref.FP8_BLOCK
        mp = padded_rows(m, self.column_block())
        if self.block_scaling_dim == 2:
            row_s = (m // b, ref.padded_blocks(k // b))
            col_s = (k // b, ref.padded_blocks(m // b))
        else:
            row_s, col_s = (k // b, m), ((mp // b) * k,)
        return {
            "rowwise_data": (shape, dt),
            "rowwise_scale_inv": (row_s, torch.float32),
            "columnwise_data": ((k, mp), dt),
            "columnwise_scale_inv": (col_s, torch.float32),
        }

    def _storage_extras(self):
        return (("fp8_format", self.fp8_format), ("block_scaling_dim", self.block_scaling_dim))

    def pairs_with(self, other) -> bool:
        return (type(other) is Float8BlockQuantizer and other.fp8_format == self.fp8_format
                and other.force_pow_2_scales == self.force_pow_2_scales
                and other.amax_epsilon == self.amax_epsilon)

    def _quantize_pair_2d(self, other, x2d, w2d):  # x's tiles may be 1x128, W's 128x128
        return kernels.get("quantize_fp8_blockwise_pair", x2d)(
            x2d, w2d, self.fp8_format, self.force_pow_2_scales, self.amax_epsilon,
            (self.block_scaling_dim == 2, self.rowwise_usage, self.columnwise_usage),
            (other.block_scaling_dim == 2, other.rowwise_usage, other.columnwise_usage))

    def _quantize_2d(self, x2d):
        fn = kernels.get("quantize_fp8_blockwise", x2d)
        return fn(x2d, self.fp8_format, self.block_scaling_dim == 2, self.force_pow_2_scales,
                  self.amax_epsilon, self.rowwise_usage, self.columnwise_usage)
