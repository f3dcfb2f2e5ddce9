"""transformer_engine_compile: quantized training layers that run under
``torch.compile(fullgraph=True)``.

Public API: recipes (``recipe``), ``autocast`` / ``fp8_autocast``, the
quantizers and quantized tensors of every format, ``TensorProto``, and the
layers (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``LayerNorm``, ``RMSNorm``,
``GroupedLinear``, ``GroupedExperts``), and ``export`` (``torch.export.export`` whose program
``torch.export.save`` can store).
"""

from .parallel import fsdp
from . import recipe
from .autocast import (autocast, fp8_autocast, get_autocast_recipe, is_autocast_enabled)
from .checkpointing import checkpoint
from .convert import convert
from .dynamo.export import export, lift_value_opaque
from .quantization.opaque import compile_support, is_value_opaque, register_value_opaque_quantizer
from .dynamo.tensor_proto import TensorProto, to_tensor_proto
from .quantization import (Float8BlockQuantizer, Float8BlockwiseQTensor,
                           Float8BlockwiseQTensorStorage, Float8CurrentScalingQuantizer,
                           Float8DelayedScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage, MXFP8Quantizer,
                           MXFP8Tensor, MXFP8TensorStorage, NVFP4Quantizer, NVFP4Tensor,
                           NVFP4TensorStorage, QuantizedTensor, QuantizedTensorStorage, Quantizer,
                           delayed_scaling_step, update_delayed_scaling)
from .quantization.factory import quantizer_for
from .module import (GroupedExperts, GroupedLinear, GroupedLinearBwdArgs, GroupedLinearFwdArgs,
                     LayerNorm, LayerNormLinear, LayerNormLinearBwdArgs, LayerNormLinearFwdArgs,
                     LayerNormMLP, LayerNormMLPBwdArgs, LayerNormMLPFwdArgs, Linear,
                     LinearBwdArgs, LinearFwdArgs, RMSNorm)
from .dynamo.fallback import fallback_report
from .cuda_graphs import prepare_cuda_graphs

__version__ = "0.1.0"

__all__ = [
    "Linear", "LinearFwdArgs", "LinearBwdArgs", "LayerNormLinear", "LayerNormLinearFwdArgs",
    "LayerNormLinearBwdArgs", "LayerNormMLP", "LayerNormMLPFwdArgs", "LayerNormMLPBwdArgs",
    "LayerNorm", "RMSNorm", "GroupedLinear", "GroupedLinearFwdArgs", "GroupedLinearBwdArgs",
    "GroupedExperts", "fallback_report", "prepare_cuda_graphs",
    "recipe", "autocast", "fp8_autocast", "checkpoint", "convert", "get_autocast_recipe", "is_autocast_enabled",
    "compile_support", "export", "lift_value_opaque", "is_value_opaque", "register_value_opaque_quantizer",
    "TensorProto", "to_tensor_proto", "quantizer_for",
    "Quantizer", "QuantizedTensorStorage", "QuantizedTensor",
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8DelayedScalingQuantizer",
    "Float8TensorStorage", "Float8Tensor", "update_delayed_scaling", "delayed_scaling_step",
    "MXFP8Quantizer", "MXFP8TensorStorage", "MXFP8Tensor",
    "Float8BlockQuantizer", "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensor",
    "NVFP4Quantizer", "NVFP4TensorStorage", "NVFP4Tensor",
]
