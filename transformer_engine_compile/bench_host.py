"""Old path of :mod:`transformer_engine_compile.benchmarks.host`, kept for one release:
importing it gives that module, ``python -m`` on it runs that module's main."""

import sys

from .benchmarks import host as _moved

sys.modules[__name__] = _moved
