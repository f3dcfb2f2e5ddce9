"""Layers: ``Linear`` (module in ``linear.py``, its custom ops in ``linear_ops.py``)."""

from .linear import Linear
from .linear_ops import LinearBwdArgs, LinearFwdArgs

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs"]
