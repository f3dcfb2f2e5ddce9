"""Old path of :mod:`transformer_engine_compile.module.layernorm.linear`, kept for one
release (pickles of whole models name it): importing it gives that module."""

import sys

from .layernorm import linear as _moved

sys.modules[__name__] = _moved
