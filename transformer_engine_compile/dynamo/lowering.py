"""Lowering the generated ops into inductor: their kernels without their Python.

Under ``torch.compile`` the forward and backward ops stay opaque to Dynamo
and AOTAutograd: the graph holds one node per op, traced through the fakes,
exactly as with ``backend="aot_eager"``.  Inductor, however, gets a
decomposition for each op: when it traces the joint graph it runs the op's
own impl on the traced tensors with the fast kernels traced
(``kernels/tracing.py``), so the op is replaced by its Triton kernels (as
``wrap_triton`` nodes) and its cuBLAS calls.  Inductor then launches those
from its generated code, and a layer call costs a few launches of host time
instead of the op's Python (decoding arguments, building storages, the
dispatcher round trip; ``benchmarks --configs llama-a``).  The kernels are the
eager op's kernels, so compiled still equals eager bit for bit.

A call is lowered only where that holds (otherwise the op node stays and
runs its impl at run time, as before):

* the op pair declares a predicate for the call (``lower_forward`` /
  ``lower_backward`` of ``register_custom_op``), e.g. te.Linear refuses a
  bias where no kernel adds it and sums its gradient (as torch ops,
  inductor would round and order them otherwise than eager; the full
  list: docs/linear.md, "What runs where");
* a call with a process group (tensor parallelism, DelayedScaling's
  amax reduction) traces its collectives as torch's functional
  collectives (``distributed.traced_collectives``), which inductor
  launches as it does torch's own tensor parallelism, but for
  ``mode="reduce-overhead"``, where such calls stay ops;
* the tensors live on a device in :func:`lowered_devices` (CUDA by default:
  elsewhere the impl would be traced through the reference kernels, which
  inductor is free to fuse and reorder);
* ``TE_COMPILE_LOWER_OPS=0`` is not set.

Graphs compiled for CUDA graphs (``mode="reduce-overhead"``) lower too,
since the lowered calls share one quantization of an input read by several
layers (``shared_inputs.py``), which ops cannot: llama-a 1.7-2% less step
time than as ops (``benchmarks --configs llama-a`` on an H200).  There
current scaling keeps its two launches (no counter slot,
``kernels/grid_state.py``): a replay costs no host time, and the two
launches less GPU time.

The registration goes into inductor's decomposition table, the one
``torch.compile``'s inductor backend passes to AOTAutograd; other backends
never see it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import warnings
from typing import Callable


from ..kernels import grid_state
from ..kernels.tracing import fast_kernels_traced
from .. import compat
from . import kernel_analysis

_DEVICES = {"cuda"} if os.environ.get("TE_COMPILE_LOWER_OPS", "1") != "0" else set()


def lowered_devices() -> frozenset:
    """Device types whose op calls inductor lowers."""
    return frozenset(_DEVICES)


def set_lowered_devices(device_types) -> frozenset:
    """Set the device types whose op calls inductor lowers (an empty set:
    never); returns the previous set.  Takes effect for graphs compiled
    afterwards."""
    global _DEVICES, _TOKEN
    previous, _DEVICES = frozenset(_DEVICES), set(device_types)
    _TOKEN = (tuple(sorted(_DEVICES)), _DIGEST)
    return previous


def cache_token() -> tuple:
    """What a lowered call's compiled code depends on beyond the graph: the
    lowered device types and this package's source.  The ops put it into
    their simple values, so AOTAutograd's and inductor's caches (keyed by
    the graph) never serve code lowered by another version or setting.
    A plain global read: Dynamo traces it."""
    return _TOKEN


@compat.run_at_trace_time
def pool_token(device_type: str, index) -> int:
    """The address of the device's counter pool (``kernels/grid_state.py``),
    made now if need be, where its calls lower; else 0.  An op call puts it
    into its simple values, so the compile caches key the graph by it: a
    lowered graph keeps a counter slot's address as a constant, and no
    cache may serve it to a process whose pool lies elsewhere.  Run at
    trace time (a constant, no guard): a pool is never freed or moved."""
    if device_type not in _DEVICES:
        return 0
    return grid_state.pool_address(device_type, index)


def _source_digest() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_DIGEST = _source_digest()
_TOKEN = (tuple(sorted(_DEVICES)), _DIGEST)


def lowerable(op, args, plan, predicate) -> bool:
    """Whether one call of ``op`` (its decoded arguments ``args``) may be
    lowered.  Runs inside inductor's trace, so it is also where the op gets
    its fallback lowering for the calls that are not lowered."""
    compat.inductor_fallback(op)
    if not _DEVICES:
        return False
    device = plan.device_of(args)
    if device is None or device.type not in _DEVICES:
        return False
    if compat.compiling_for_cuda_graphs():
        for name, bucket in plan.fields:
            if bucket.kind == "process_group" and getattr(args, name) is not None:
                return False
    return bool(predicate(args))


def trace_impl(impl: Callable, flat, plan, written=frozenset()) -> list:
    """Run ``impl(*flat)`` (an op's impl on flat arguments) inside inductor's
    trace: fast kernels traced, and functionalized, because the table's
    decompositions run below AOTAutograd's functionalization while the
    impls write into buffers they allocate (kernel outputs, amaxes).  Each
    plain tensor argument (by the op's ``plan``; but the fields in
    ``written``, the buffers the op updates) first gets its layout fixed
    (``compat.fixed_layout``): an activation or gradient that a fused
    kernel produces is then realized once for all the Triton kernels that
    read it, instead of copied for each of their arguments, and identical
    calls on the same tensor (q, k and v on one input) merge in AOT's CSE."""
    def run(*args):
        return impl(*plan.with_fixed_layouts(args, written))

    with fast_kernels_traced():
        return compat.functionalized(run)(*flat)


def register(op, plan, predicate, impl: Callable, written=()) -> bool:
    """Give ``op`` an inductor decomposition: ``impl(*flat)`` (the op's impl
    on flat arguments, returning its flat result) traced where
    :func:`lowerable` accepts the call, else the op stays.  ``written``:
    the fields whose buffers the op pair updates.  Returns whether it was
    registered (not without a predicate, nor on a torch without inductor's
    table)."""
    if predicate is None:
        return False
    written = frozenset(written)

    def decomposition(*flat):
        if not lowerable(op, plan.decode(flat), plan, predicate):
            return NotImplemented
        pool = None if compat.compiling_for_cuda_graphs() else flat[-1].as_dict().get("~pool")
        with grid_state.traced_pool(pool):  # None: two launches (see the module docstring)
            return trace_impl(impl, flat, plan, written)

    try:
        from torch._inductor import decomposition as inductor_decomp
    except ImportError:  # pragma: no cover - a torch without inductor
        return False
    table = getattr(inductor_decomp, "decompositions", None)
    if not isinstance(table, dict):  # pragma: no cover - another torch's internals
        warnings.warn("te_compile: inductor's decomposition table was not found; "
                      "the ops run as ops under inductor")
        return False
    table[op] = decomposition
    kernel_analysis.install()  # each kernel analysed once per signature, not per node
    cached = getattr(inductor_decomp, "fast_random_decomps", None)
    if hasattr(cached, "cache_clear"):  # a copy of the table, cached on first use
        cached.cache_clear()
    return True
