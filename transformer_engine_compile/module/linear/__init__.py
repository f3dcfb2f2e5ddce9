"""``te.Linear``: the layer (``layer.py``, which picks each call's path), its
ops' arguments (``args.py``), impls (``compute.py``), lowering rules
(``lowering.py``) and registration (``ops.py``), the plain path without a
recipe (``plain.py``) and the eager native plans (``native*.py``)."""

from .args import LinearBwdArgs, LinearFwdArgs
from .layer import Linear
from .ops import LINEAR_OPS

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs", "LINEAR_OPS"]
