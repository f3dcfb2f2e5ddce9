"""Layers, one subpackage per family: ``linear/`` (``te.Linear``),
``layernorm/`` (``te.LayerNormLinear``, ``te.LayerNormMLP``), ``norm/``
(``te.LayerNorm``, ``te.RMSNorm``), ``grouped/`` (``te.GroupedLinear``);
the files here are what they share
(the argument memo, extra state, parameter splits, the gathered weight's
format check)."""

from .grouped import GroupedExperts, GroupedLinear, GroupedLinearBwdArgs, GroupedLinearFwdArgs
from .layernorm import (LayerNormLinear, LayerNormLinearBwdArgs, LayerNormLinearFwdArgs,
                        LayerNormMLP, LayerNormMLPBwdArgs, LayerNormMLPFwdArgs)
from .linear import Linear, LinearBwdArgs, LinearFwdArgs
from .norm import LayerNorm, RMSNorm

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs", "LayerNormLinear",
           "LayerNormLinearFwdArgs", "LayerNormLinearBwdArgs", "LayerNormMLP",
           "LayerNormMLPFwdArgs", "LayerNormMLPBwdArgs", "LayerNorm", "RMSNorm",
           "GroupedExperts", "GroupedLinear", "GroupedLinearFwdArgs", "GroupedLinearBwdArgs"]
