"""The fused norm layers: ``te.LayerNormLinear`` (``linear.py``, ops in
``linear_ops.py`` built on te.Linear's) and ``te.LayerNormMLP`` (``mlp.py``,
ops in ``mlp_ops.py``, both GEMMs te.Linear's), with their eager native
plans (``*_native.py``)."""

from .linear import LayerNormLinear
from .linear_ops import LayerNormLinearBwdArgs, LayerNormLinearFwdArgs
from .mlp import LayerNormMLP
from .mlp_ops import LayerNormMLPBwdArgs, LayerNormMLPFwdArgs

__all__ = ["LayerNormLinear", "LayerNormLinearFwdArgs", "LayerNormLinearBwdArgs",
           "LayerNormMLP", "LayerNormMLPFwdArgs", "LayerNormMLPBwdArgs"]
