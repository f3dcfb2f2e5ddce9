"""The generated ops' schemas and the library's code in torch.compile's
on-disk cache keys.

Inductor's FX graph cache and AOTAutograd's cache key a compiled graph on
its traced code, which names each custom op but neither its schema nor its
fake.  A graph cached under one version of this library would be replayed
against a regenerated op with another argument list (``missing value for
argument``), or against outputs laid out as another version's fake said
(inductor's size and stride asserts fail).  So every schema the generator
defines, and a digest of the package's source, are folded into
``torch.compiler.config.cache_key_tag``, after whatever tag the user set: a
changed op misses the cache instead.  The digest does not depend on the
order the ops were defined in.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

from ..compat import compile_cache_config

MARK = "|te_compile:"
_SCHEMAS: dict = {}


def note_schema(schema: str) -> None:
    """Record a generated op's schema and retag the compile caches."""
    _SCHEMAS[schema.split("(", 1)[0]] = schema
    config = compile_cache_config()
    if config is None:
        return
    digest = hashlib.sha256("\n".join([_source_digest(), *sorted(_SCHEMAS.values())])
                            .encode()).hexdigest()[:16]
    user = config.cache_key_tag.split(MARK, 1)[0]
    config.cache_key_tag = f"{user}{MARK}{digest}"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """sha256 of the package's Python sources (the fakes and the helpers
    they call live across it), read once."""
    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
