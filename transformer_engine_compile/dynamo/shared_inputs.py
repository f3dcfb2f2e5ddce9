"""One input quantized once for every lowered call that reads it (q, k, v; gate, up).

In a lowered trace (``lowering.py``) each te.Linear forward runs its impl on
traced tensors.  Layers that read one activation with equal quantizers (q,
k and v on the normalised hidden state, gate and up on the next one) would
each quantize it: the same bytes, read and written once per layer.  The
first call records its quantized input's buffers here, keyed by the traced
value (the graph node, seen through its functionalization and the layout
fix ``lowering.py`` adds) and the quantizer.  A later call of the same
trace takes them and quantizes only its weight, in as many launches as
before.  The backwards then share one saved columnwise copy too.  Under
column-parallel sequence parallelism the value shared is the input
gathered over the group and quantized (tagged with the group): the later
layers skip the gather and its amax all-reduce as well.

Eager calls quantize their input each, to the same bytes (the format
depends on the values only), so compiled still equals eager bit for bit.
Stateful quantizers (delayed scaling: each layer has its own scale) and
stochastic rounding never share.

The memo is held per make_fx tracer, weakly: it lives as long as the
trace, and no two traces see each other's values.
"""

from __future__ import annotations

import weakref
from typing import Optional

from ..kernels import tracing
from .. import compat

_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tracer -> {key: buffers}


def _shareable(quantizer) -> bool:
    return (quantizer is not None and not quantizer.is_stateful()
            and not getattr(quantizer, "stochastic_rounding", False))


def _slot(x, quantizer, tag):
    """(memo of the trace, key) for ``x`` quantized with ``quantizer`` (and
    ``tag``: what else made the value, e.g. a gather over a process group),
    or None outside a lowered trace or for a quantizer that must not share."""
    if not (tracing.functional(x) and _shareable(quantizer)):  # functional: traced first
        return None
    traced = compat.traced_node(x)
    if traced is None:
        return None
    tracer, node = traced
    memo = _MEMO.get(tracer)
    if memo is None:
        memo = _MEMO[tracer] = {}
    return memo, (compat.unfixed_node(node), quantizer, tag)


def lookup(x, quantizer, tag=None) -> Optional[dict]:
    """Buffers (of the functionalization session in progress) of ``x``
    quantized with ``quantizer`` by an earlier call of this trace (recorded
    with the same ``tag``), else None."""
    slot = _slot(x, quantizer, tag)
    if slot is None:
        return None
    memo, key = slot
    plain = memo.get(key)
    if plain is None:
        return None
    return {name: compat.functional_of_plain(t) for name, t in plain.items()}


def record(x, quantizer, quantized, tag=None) -> None:
    """Offer ``quantized`` (``x`` quantized with ``quantizer``, in this
    session; ``tag``: what else made it from ``x``) to the later calls of
    this trace; a no-op outside one.  Call it before dropping any of its
    copies."""
    slot = _slot(x, quantizer, tag)
    if slot is None:
        return
    memo, key = slot
    memo.setdefault(key, {name: compat.plain_of_functional(t)
                          for name, t in quantized.buffers().items()})
