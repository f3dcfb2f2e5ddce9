"""Module buffers allocated on first use, before any graph that uses them runs.

Delayed-scaling history, scales and the cached FP8 weight have a layout that
depends on the recipe, so a layer allocates them when it first runs under
one.  Allocating inside a compiled graph would make them graph outputs,
which CUDA graphs overwrite on the next replay.  :func:`ensure_buffers` is
therefore called at trace time (Dynamo runs it eagerly, see
``compat.run_at_trace_time``): the buffers are ordinary allocations
registered on the module before the graph exists, and the graph reads and
updates them as module buffers (static inputs under CUDA graphs).

A module is named by a key (:func:`register_module`) because the trace-time
call takes constant arguments only.  The key names one module object, never
its copies: a module that uses it re-registers in ``__setstate__``, which
``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.load`` all call on
the new object, so a copy (made before or after the first run, in this or
another process, with its original alive or collected) gets a fresh key
and allocates or carries its own buffers.  The registry holds weak
references only and is never the owner of any state: the buffers live on
the module (and travel with it).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .. import compat

_MODULES: "weakref.WeakValueDictionary[str, torch.nn.Module]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_module(module: torch.nn.Module) -> str:
    """Give ``module`` a key for :func:`ensure_buffers` (call in ``__init__``)."""
    key = f"{type(module).__name__}#{next(_KEYS)}"
    _MODULES[key] = module
    return key


@compat.run_at_trace_time
def ensure_buffers(key: str, layout: tuple, device) -> bool:
    """Register each ``(name, shape, dtype, fill, missing_error)`` of
    ``layout`` as a non-persistent buffer of module ``key``, unless one of
    that shape, dtype and device is there.  ``fill`` None leaves it
    uninitialised; a ``missing_error`` string raises ``ValueError`` instead
    of allocating (the buffer must hold earlier results).  Returns True.

    Call it once per forward, before reading any of the buffers: Dynamo
    reads ``module._buffers`` once per trace, so buffers registered after
    the first read are invisible to that trace."""
    module = _MODULES.get(key)
    if module is None:
        raise RuntimeError(f"te state: no live module has key {key!r} (a module copied "
                           "without __setstate__? see dynamo/state.py)")
    device = torch.device(device)
    for name, shape, dtype, fill, missing_error in layout:
        buf = module._buffers.get(name)
        if (buf is not None and tuple(buf.shape) == tuple(shape) and buf.dtype == dtype
                and buf.device == device):
            continue
        if missing_error is not None:
            raise ValueError(missing_error)
        with torch.inference_mode(False):  # state made in validation must serve training
            buf = torch.empty(shape, dtype=dtype, device=device)
            if fill is not None:
                buf.fill_(fill)
        module.register_buffer(name, buf, persistent=False)
    return True
