"""Layers: ``Linear`` (module in ``linear.py``, its custom ops in
``linear_ops.py``) and ``LayerNormLinear`` (``layernorm_linear.py``, ops in
``layernorm_linear_ops.py`` built on Linear's), ``LayerNormMLP``
(``layernorm_mlp.py``, ops in ``layernorm_mlp_ops.py``, both GEMMs Linear's);
``LayerNorm`` and ``RMSNorm`` (``norm.py``, plain torch code)."""

from .layernorm_linear import LayerNormLinear
from .layernorm_linear_ops import LayerNormLinearBwdArgs, LayerNormLinearFwdArgs
from .layernorm_mlp import LayerNormMLP
from .layernorm_mlp_ops import LayerNormMLPBwdArgs, LayerNormMLPFwdArgs
from .linear import Linear
from .linear_args import LinearBwdArgs, LinearFwdArgs
from .norm import LayerNorm, RMSNorm

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs", "LayerNormLinear",
           "LayerNormLinearFwdArgs", "LayerNormLinearBwdArgs", "LayerNormMLP",
           "LayerNormMLPFwdArgs", "LayerNormMLPBwdArgs", "LayerNorm", "RMSNorm"]
