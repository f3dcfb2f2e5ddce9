"""``python -m transformer_engine_compile.benchmarks``: :mod:`.compare`'s main."""

import sys

from .compare import main

sys.exit(main())
