"""Old path of :mod:`transformer_engine_compile.module.layernorm.mlp`, kept for one
release (pickles of whole models name it): importing it gives that module."""

import sys

from .layernorm import mlp as _moved

sys.modules[__name__] = _moved
