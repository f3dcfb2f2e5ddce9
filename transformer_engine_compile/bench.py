"""Old path of :mod:`transformer_engine_compile.benchmarks.compare`, kept for one release:
importing it gives that module, ``python -m`` on it runs that module's main."""

import sys

from .benchmarks import compare as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
