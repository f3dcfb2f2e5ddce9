"""``te.GroupedLinear`` for mixtures of experts: the layer (``layer.py``), its
ops' arguments (``args.py``), impls (``compute.py``) and registration
(``ops.py``)."""

from .args import GroupedLinearBwdArgs, GroupedLinearFwdArgs
from .layer import GroupedLinear
from .ops import GROUPED_LINEAR_OPS

__all__ = ["GroupedLinear", "GroupedLinearFwdArgs", "GroupedLinearBwdArgs", "GROUPED_LINEAR_OPS"]
