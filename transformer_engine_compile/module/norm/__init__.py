"""``te.LayerNorm`` and ``te.RMSNorm`` (``layer.py``) and the norm ops the
fused layers share (``ops.py``)."""

from .layer import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
