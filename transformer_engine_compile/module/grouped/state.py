"""DelayedScaling state of grouped GEMMs: each GEMM's amax histories and
scales as module buffers (one column per expert and tensor: the forward's
x of experts 0..n-1 then their W, the backward's dy), allocated at trace
time (``dynamo/state.py``) and bound into the ops' arguments, and packed
into the module's ``_extra_state`` for checkpoints, as te.Linear keeps its
own.  The experts' scales are those of a ``te.Linear`` per expert: each
column steps as that layer's would."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...autocast import get_amax_reduction_group, get_autocast_recipe
from ...dynamo.state import ensure_buffers
from ..extra_state import (check_extra_state, delayed_state_names, pack_delayed_state,
                           unpack_delayed_state)


def _columns(groups: int) -> tuple:
    """(forward, backward) history columns of a GEMM over ``groups`` experts."""
    return 2 * groups, groups


def bind_delayed_state(module: torch.nn.Module, gemms: Sequence[tuple], device,
                       extra_layout: tuple = ()) -> list:
    """For each ``(prefix, groups)`` GEMM of ``module``: its DelayedScaling
    fields of ``GroupedLinearFwdArgs`` (a dict), allocated once, or None
    when the active recipe is not DelayedScaling.  All GEMMs' buffers, and
    the module's other buffers of ``extra_layout``, in one
    ``ensure_buffers`` call, before any is read."""
    recipe = get_autocast_recipe()
    if recipe is None or not recipe.delayed():
        if extra_layout:
            ensure_buffers(module._state_key, extra_layout, device)
        return [None] * len(gemms)
    n, f32 = recipe.constant("amax_history_len"), torch.float32
    layout = ()
    for prefix, groups in gemms:
        fwd, bwd = _columns(groups)
        hist_fwd, scale_fwd, hist_bwd, scale_bwd = delayed_state_names(prefix)
        layout += ((hist_fwd, (n, fwd), f32, 0.0, None), (scale_fwd, (fwd,), f32, 1.0, None),
                   (hist_bwd, (n, bwd), f32, 0.0, None), (scale_bwd, (bwd,), f32, 1.0, None))
    ensure_buffers(module._state_key, layout + tuple(extra_layout), device)
    group = get_amax_reduction_group()
    fields = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")
    return [{**{f: getattr(module, name) for f, name in zip(fields, delayed_state_names(prefix))},
             "amax_group": group} for prefix, _ in gemms]


def get_grouped_extra_state(module, gemms: Sequence[tuple], device) -> torch.Tensor:
    """The GEMMs' buffers packed one after another (empty before a
    DelayedScaling run)."""
    parts = [pack_delayed_state(module, delayed_state_names(prefix), device)
             for prefix, _ in gemms]
    if any(p.numel() == 0 for p in parts):
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.cat(parts)


@torch.no_grad()
def set_grouped_extra_state(module, owner: str, gemms: Sequence[tuple], state,
                            device: Optional[torch.device]) -> None:
    """Restore what :func:`get_grouped_extra_state` saved (all GEMMs have
    the same experts)."""
    columns = _columns(gemms[0][1])
    check_extra_state(owner, state, gemms=len(gemms), columns=columns)
    parts = state.chunk(len(gemms)) if state.numel() else [state] * len(gemms)
    for (prefix, _), part in zip(gemms, parts):
        unpack_delayed_state(module, delayed_state_names(prefix), part, device, columns)
