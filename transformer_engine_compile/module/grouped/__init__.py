"""Mixtures of experts: ``te.GroupedLinear`` (``layer.py``), its ops'
arguments (``args.py``), impls (``compute.py``) and registration
(``ops.py``); ``te.GroupedExperts`` (``experts.py``), SwiGLU experts over
routed tokens on two grouped GEMMs."""

from .args import GroupedLinearBwdArgs, GroupedLinearFwdArgs
from .experts import GroupedExperts
from .layer import GroupedLinear, grouped_linear
from .ops import GROUPED_LINEAR_OPS

__all__ = ["GroupedExperts", "GroupedLinear", "grouped_linear", "GroupedLinearFwdArgs", "GroupedLinearBwdArgs", "GROUPED_LINEAR_OPS"]
