"""Old path of :mod:`transformer_engine_compile.parallel.fsdp_weight`, kept for one
release: importing it gives that module."""

import sys

from .parallel import fsdp_weight as _moved

sys.modules[__name__] = _moved
