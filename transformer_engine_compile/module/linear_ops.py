"""Old path of :mod:`transformer_engine_compile.module.linear.ops`, kept for one
release (pickles of whole models name it): importing it gives that module."""

import sys

from .linear import ops as _moved

sys.modules[__name__] = _moved
