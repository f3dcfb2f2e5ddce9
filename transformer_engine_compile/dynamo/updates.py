"""State an op updates in place, written right after it (custom_op.py's
``forward_updates`` / ``backward_updates``): :class:`Update` names the
argument field an op output is copied or added into, :func:`apply_updates`
writes them, in eager and traced code alike."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..quantization.base import QuantizedTensorStorage, storage_parts

if TYPE_CHECKING:
    from .arg_plan import ArgPlan


class Update(NamedTuple):
    """Write an op output into the argument field ``field``: ``"copy"`` or ``"add"``."""

    field: str
    how: str = "copy"


def _write(dst, new, how: str, where: str, detach: bool = False) -> None:
    if isinstance(new, QuantizedTensorStorage):  # buffer by buffer, same names
        if not isinstance(dst, QuantizedTensorStorage):
            raise TypeError(f"{where}: a quantized update needs a quantized target")
        names, bufs, _, _ = storage_parts(dst)
        new_names, new_bufs, _, _ = storage_parts(new)
        if names != new_names:
            raise RuntimeError(f"{where}: target buffers {names} differ from {new_names}")
        pairs = zip(bufs, new_bufs)
    else:
        pairs = [(dst, new)]
    for d, n in pairs:
        if tuple(d.shape) != tuple(n.shape):
            raise RuntimeError(f"{where}: target of shape {tuple(d.shape)}, update of shape "
                               f"{tuple(n.shape)}")
        n = n.detach() if detach else n
        d.add_(n) if how == "add" else d.copy_(n)


def apply_updates(updates: dict, args, results: dict) -> dict:
    """Write the update outputs of ``results`` into ``args``' fields (under
    no_grad) and return the remaining results.

    Under ``torch.export`` the values are detached instead: export records a
    no_grad region as a ``wrap_with_set_grad_enabled`` node, and one that
    returns nothing (these in-place writes, or none) makes ``torch.export.load``
    refuse the saved program.  No update target requires grad."""
    if not updates:
        return results
    results = dict(results)
    pending = []
    for name, update in updates.items():
        new = results.pop(name, None)
        if new is not None:
            pending.append((name, update, new))
    if not pending:  # the common eager call: nothing to write
        return results
    exporting = torch.compiler.is_exporting()
    with contextlib.nullcontext() if exporting else torch.no_grad():
        for name, update, new in pending:
            dst = getattr(args, update.field)
            if dst is None:
                raise RuntimeError(f"update {name!r} has no target: field "
                                   f"{update.field!r} is None")
            _write(dst, new, update.how, f"update {name!r} -> {update.field!r}", exporting)
    return results


def _check_updates(updates, plan: ArgPlan, what: str) -> dict:
    updates = {name: Update(*u) if isinstance(u, tuple) else Update(u)
               for name, u in (updates or {}).items()}
    for name, u in updates.items():
        if u.field not in plan.tensor_fields:
            raise TypeError(f"{what}[{name!r}]: {u.field!r} is not a tensor field of "
                            f"{plan.cls.__name__}")
        if u.how not in ("copy", "add"):
            raise TypeError(f"{what}[{name!r}]: how must be 'copy' or 'add', got {u.how!r}")
    return updates
