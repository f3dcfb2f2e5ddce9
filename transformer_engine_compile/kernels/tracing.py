"""Fast kernels inside a graph trace: the ops' impls lowered into inductor.

While :func:`fast_kernels_traced` is active (``dynamo/lowering.py`` runs an
op's impl under it while inductor's AOT trace decomposes the op),
``kernels.get`` keeps returning the fast CUDA kernels although the code is
being traced, and each Triton launch records a ``wrap_triton`` node instead
of launching (``triton_launch.Launcher``).  Inductor then launches the same
Triton kernels from its generated code, so a lowered op computes exactly
what the eager op computes, at inductor's launch cost instead of the op's
Python.  Launch keys and data pointers do not exist on traced tensors:
``int_key`` / ``ptr_key`` return placeholders meanwhile.
"""

from __future__ import annotations

import contextlib
import threading

active = False
_eager = threading.local()


@contextlib.contextmanager
def fast_kernels_traced():
    global active
    previous, active = active, True
    try:
        yield
    finally:
        active = previous


def functional(*tensors) -> bool:
    """Whether ``tensors`` are the functionalized tensors of a lowered trace:
    a kernel traced as writing one of them then becomes a functional node
    (the tensor keeps its value, the write yields a new one), and inductor
    may do the write in place where that is safe (its reinplacing pass)."""
    if not active:
        return False
    from torch._subclasses.functional_tensor import FunctionalTensor
    return all(isinstance(t, FunctionalTensor) for t in tensors)


class eager_buffers_in_place:
    """The ops' impls called eagerly (``CustomOpPair.eager``), not as ops:
    a delayed-scaling step then writes the layer's amax history and scale
    themselves, as it does in a lowered trace, instead of new buffers that
    the op's updates copy back (two copies and two allocations per op
    call).  An op must not write its inputs, so its real impl never does.
    Thread-local: the autograd engine may run a backward on a thread of
    its own.  A plain class, not a generator context manager: it runs twice
    per eager layer call (a few us less, docs/benchmarks.md)."""

    __slots__ = ("_previous",)

    def __enter__(self):
        self._previous = getattr(_eager, "in_place", False)
        _eager.in_place = True

    def __exit__(self, *exc):
        _eager.in_place = self._previous


@contextlib.contextmanager
def thread_local_value(store: threading.local, name: str, value):
    """``store.name = value`` for the block; after it, the previous value
    (None where there was none)."""
    previous = getattr(store, name, None)
    setattr(store, name, value)
    try:
        yield
    finally:
        setattr(store, name, previous)


def eager_in_place() -> bool:
    """Whether :func:`eager_buffers_in_place` is active on this thread."""
    return bool(getattr(_eager, "in_place", False))
