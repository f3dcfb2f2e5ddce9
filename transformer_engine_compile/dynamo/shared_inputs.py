"""One input quantized once for every call that reads it (q, k, v; gate, up).

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

Eager calls share too, by one entry per thread: the last input an eager
call quantized, held weakly, with its version counter and quantizer.  The
next call that reads that same tensor, unwritten, with an equal quantizer
takes its buffers.  q, k and v (gate and up) run one after another on one
tensor, so one entry catches them; it is replaced by the next quantizing
call and dropped with its input.  The native eager path keeps the same
entry in C++ (``kernels/native_linear.cpp``, ``shared_x``).  The format
depends on the values only, so a shared copy is the bytes the call would
have made, and compiled equals eager bit for bit either way.

Stateful quantizers (delayed scaling: each layer has its own scale) and
stochastic rounding never share.  ``TE_COMPILE_SHARE_INPUTS=0`` (or
``EAGER = False`` before a layer's first call) turns eager sharing off.

The traced memo is held per make_fx tracer, weakly: it lives as long as
the trace, and no two traces see each other's values.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Optional

import torch

from ..kernels import tracing
from .. import compat

_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tracer -> {key: buffers}
EAGER = os.environ.get("TE_COMPILE_SHARE_INPUTS", "1") != "0"


class _LastInput(threading.local):
    """The last input an eager call offered on this thread: ``cell`` holds
    (weakref to it, its version, quantizer, tag, buffers), or nothing.  The
    weakref's callback empties the cell from whichever thread frees the
    input (the autograd engine's, when a saved input goes)."""
    cell: list = []


_LAST = _LastInput()


@contextlib.contextmanager
def eager_sharing(enabled: bool):
    """Eager input sharing on or off (``EAGER``) for the block: a benchmark
    that calls a layer on the same input again and again times each call
    quantizing its own input with it off."""
    global EAGER
    previous, EAGER = EAGER, enabled
    try:
        yield
    finally:
        EAGER = previous


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


def _eager(x, quantizer) -> bool:
    """Whether an eager call (the ops' impls under their autograd.Function)
    shares ``x``'s quantization: a plain tensor with a version counter, a
    quantizer that may share, no functorch transform, no CUDA graph capture."""
    return (EAGER and tracing.eager_in_place() and type(x) is torch.Tensor
            and _shareable(quantizer) and not x.is_inference()
            and not torch._C._are_functorch_transforms_active()
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def lookup(x, quantizer, tag=None) -> Optional[dict]:
    """Buffers of ``x`` quantized with ``quantizer`` (and ``tag``) by an
    earlier call: of this trace (in its functionalization session), or the
    eager call just before on this thread; else None."""
    if not tracing.active:
        cell = _LAST.cell
        if not cell or not _eager(x, quantizer):
            return None
        ref, version, q, entry_tag, buffers = cell[0]
        if ref() is not x or version != x._version or entry_tag != tag or q != quantizer:
            return None
        return dict(buffers)
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
    this trace, or to the next eager call on this thread.  Call it before
    dropping any of its copies."""
    if not tracing.active:
        if _eager(x, quantizer):
            # the replaced entry goes now: its list, weakref and callback form
            # a cycle, which would hold its buffers until Python's cyclic
            # collection (that training loops schedule rarely)
            _LAST.cell.clear()
            cell: list = []
            cell.append((weakref.ref(x, lambda _, cell=cell: cell.clear()), x._version,
                         quantizer, tag, dict(quantized.buffers())))
            _LAST.cell = cell
        return
    slot = _slot(x, quantizer, tag)
    if slot is None:
        return
    memo, key = slot
    memo.setdefault(key, {name: compat.plain_of_functional(t)
                          for name, t in quantized.buffers().items()})

