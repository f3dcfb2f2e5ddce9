"""DelayedScaling state in a checkpoint: the layers' ``_extra_state``, as
Transformer Engine keeps it (one 1-D fp32 tensor per layer), packed from and
restored into the module buffers of each GEMM's amax histories and scales."""

from __future__ import annotations

import torch


def delayed_state_names(prefix: str = "") -> tuple:
    """The buffers of one GEMM's DelayedScaling state a resumed run needs
    (``get_extra_state``): ``te.Linear``'s, or ``fc1_...`` of a LayerNormMLP."""
    return tuple(f"{prefix}fp8_{n}" for n in ("amax_history_fwd", "scale_fwd",
                                               "amax_history_bwd", "scale_bwd"))


def pack_delayed_state(module, names, device) -> torch.Tensor:
    """One GEMM's buffers ``names`` packed into a 1-D fp32 tensor (history fwd
    (L, 2), scale fwd (2,), history bwd (L, 2), scale bwd (2,): 4 L + 4
    values for a te.Linear; a grouped GEMM's have more columns), or an empty
    one when the module has not run under DelayedScaling."""
    parts = [module._buffers.get(n) for n in names]
    if any(p is None for p in parts):
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.cat([p.detach().reshape(-1) for p in parts])


def check_extra_state(owner: str, state, gemms: int = 1, columns: tuple = (2, 2)) -> None:
    """Refuse (ValueError naming ``owner``) what is not ``gemms`` equally long
    :func:`pack_delayed_state` results concatenated, each of histories with
    ``columns`` (forward, backward) columns."""
    n = state.numel() if isinstance(state, torch.Tensor) else -1
    one, width = (n // gemms if n > 0 else n), sum(columns)
    if (n < 0 or state.dim() != 1 or state.dtype != torch.float32
            or (n and (n % gemms or one < 2 * width or one % width))):
        count = "" if gemms == 1 else f"{gemms} x "
        raise ValueError(f"{owner}: the extra state must be the 1-D fp32 tensor of "
                         f"get_extra_state() ({count}({width} * amax_history_len + {width}) "
                         f"values, or none), got {type(state).__name__} "
                         f"{tuple(state.shape) if isinstance(state, torch.Tensor) else ''}")


@torch.no_grad()
def unpack_delayed_state(module, names, state, device, columns: tuple = (2, 2)) -> None:
    """Restore what :func:`pack_delayed_state` saved (checked by
    :func:`check_extra_state`) into histories of ``columns`` (forward,
    backward) columns.  Buffers of the same layout are copied into (so CUDA
    graphs keep their addresses); an empty state drops them."""
    n = state.numel()
    if n == 0:
        for name in names:
            module._buffers.pop(name, None)
        return
    fwd, bwd = columns
    length = n // (fwd + bwd) - 1
    values = state.to(device).split([fwd * length, fwd, bwd * length, bwd])
    shapes = ((length, fwd), (fwd,), (length, bwd), (bwd,))
    for name, value, shape in zip(names, values, shapes):
        value = value.reshape(shape)
        cur = module._buffers.get(name)
        if cur is not None and cur.shape == value.shape and cur.dtype == value.dtype:
            cur.copy_(value)
        else:
            module.register_buffer(name, value.clone(), persistent=False)


class LoadsWithoutExtraState:
    """Module mixin: a checkpoint without ``_extra_state`` (older, or the
    plain torch module's a layer replaced) loads strictly too; the layer's
    FP8 state is then left as it is."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        load_without_extra_state(missing_keys, state_dict, prefix)


def load_without_extra_state(missing_keys, state_dict, prefix) -> None:
    """A checkpoint without extra state (older, or a plain torch module's)
    loads strictly too; the layer's FP8 state is then left as it is."""
    key = prefix + "_extra_state"
    if key in missing_keys and key not in state_dict:
        missing_keys.remove(key)
