"""The generated ops' schemas in torch.compile's on-disk cache keys.

Inductor's FX graph cache and AOTAutograd's cache key a compiled graph on
its traced code, which names each custom op but not its schema.  A graph
cached under one version of this library would be replayed against a
regenerated op with another argument list and fail (``missing value for
argument``).  So every schema the generator defines is folded into
``torch.compiler.config.cache_key_tag``, after whatever tag the user set:
a changed schema misses the cache instead.  The digest does not depend on
the order the ops were defined in.
"""

from __future__ import annotations

import hashlib

from ..compat import compile_cache_config

MARK = "|te_compile:"
_SCHEMAS: dict = {}


def note_schema(schema: str) -> None:
    """Record a generated op's schema and retag the compile caches."""
    _SCHEMAS[schema.split("(", 1)[0]] = schema
    config = compile_cache_config()
    if config is None:
        return
    digest = hashlib.sha256("\n".join(sorted(_SCHEMAS.values())).encode()).hexdigest()[:16]
    user = config.cache_key_tag.split(MARK, 1)[0]
    config.cache_key_tag = f"{user}{MARK}{digest}"
