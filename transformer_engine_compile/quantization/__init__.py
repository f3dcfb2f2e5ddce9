"""Quantized formats: one module per format (quantizer, storage, wrapper)."""

from .base import (BufferDesc, BufferSpec, QuantizedMeta, QuantizedTensorStorage, Quantizer,
                   storage_registry)
from .blockwise import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .float8 import (Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer,
                     Float8Quantizer, Float8Tensor, Float8TensorStorage, delayed_scaling_step,
                     update_delayed_scaling)
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage
from .wrapper import QuantizedTensor
from . import cuda_gemm  # noqa: F401  (registers the CUDA GEMM with kernels)

__all__ = [
    "BufferDesc", "BufferSpec", "QuantizedMeta", "QuantizedTensorStorage", "QuantizedTensor",
    "Quantizer", "storage_registry",
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8DelayedScalingQuantizer",
    "Float8TensorStorage", "Float8Tensor",
    "update_delayed_scaling", "delayed_scaling_step",
    "MXFP8Quantizer", "MXFP8TensorStorage", "MXFP8Tensor",
    "Float8BlockQuantizer", "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensor",
    "NVFP4Quantizer", "NVFP4TensorStorage", "NVFP4Tensor",
]
