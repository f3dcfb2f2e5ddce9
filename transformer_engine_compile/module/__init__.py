"""Layers: ``Linear``."""

from .linear import Linear, LinearBwdArgs, LinearFwdArgs

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs"]
