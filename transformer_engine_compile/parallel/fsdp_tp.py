"""State dicts of 2-D models (tensor parallel x FSDP2) that checkpoints can place.

Under 2-D parallelism FSDP2 takes each te layer's TP shard for a whole
parameter: the parameter is a DTensor over ``mesh["dp"]`` whose global
shape is the TP shard's.  The tp ranks' shards then carry the same name,
shape and offsets, and ``torch.distributed.checkpoint`` takes them for
replicas of one tensor: it kept one and lost the others, without an error.

:func:`register` (called by ``te.fsdp.fully_shard``) gives such a layer
two hooks:

* ``state_dict()`` describes each TP-split parameter on the whole
  ``(dp, tp)`` mesh with its full, single-device shape (the same local
  tensor, no copy): DCP then saves every rank's piece at its place in the
  full tensor, and loads it back into any layout (another mesh size, one
  process, ``get_model_state_dict(..., full_state_dict=True)``);
* ``load_state_dict()`` takes such a value back to the parameter's own
  DTensor over ``mesh["dp"]``.

Placements on the root mesh: the tp dim splits the parameter as the layer
does (column: dim 0 of the weight and bias; row: dim 1 of the weight, the
bias whole and left as it is); the dp dim keeps FSDP2's ``Shard(0)``, which
on the same dim as the tp split is applied to the tp shard, i.e. a
``_StridedShard`` when dp precedes tp in the mesh (as torch's FSDP2 + TP
writes it).  A gated ``LayerNormMLP``'s fc1 under TP holds this rank's rows
of both halves, which no DTensor placement describes: its state dict is
refused with an error, as is a layer whose dp mesh is not one dim of a
2-D mesh whose other dim is the layer's ``tp_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import compat

__all__ = ["register", "tp_split_dims"]

_GATED = object()  # a gated fc1 under TP: this rank's rows of both halves


def tp_split_dims(layer: torch.nn.Module) -> dict:
    """``{parameter name: the dim its TP shard splits}`` for the parameters
    of ``layer`` that tensor parallelism splits (empty without TP)."""
    from ..module.layernorm.mlp import GATED, LayerNormMLP
    from ..module.linear.layer import Linear

    if isinstance(layer, Linear):
        if layer.parallel_mode is None or layer.tp_size == 1:
            return {}
        # under parameters_split each part holds its own rows of the shard
        dim = 0 if layer.parallel_mode == "column" else 1
        dims = dict.fromkeys(layer._weight_names, dim)
        if layer.parallel_mode == "column" and layer._has_bias():
            dims.update(dict.fromkeys(layer._bias_names, 0))
        return dims
    if isinstance(layer, LayerNormMLP):
        if not layer._tp_active():
            return {}
        dims = {}
        for gemm in layer._gemms:
            gated = gemm.prefix == "fc1_" and layer.activation in GATED
            dim = 0 if gemm.parallel_mode == "column" else 1
            dims[gemm.prefix + "weight"] = _GATED if gated else dim
            if gemm.parallel_mode == "column" and getattr(layer, gemm.prefix + "bias") is not None:
                dims[gemm.prefix + "bias"] = _GATED if gated else 0
        return dims
    return {}


def _layout(layer, name: str, value, dim) -> tuple:
    """(root mesh, placements, full shape) of ``value`` (a DTensor over the
    dp mesh holding this tp rank's shard of parameter ``name``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    where = f"{type(layer).__name__} parameter {name!r}"
    if dim is _GATED:
        raise NotImplementedError(
            f"{where}: a gated activation's fc1 under tensor parallelism holds this rank's "
            "rows of both halves (gate and up), which a DTensor cannot place in the full "
            "tensor; its 2-D (TP x FSDP2) checkpoint is not supported: use a non-gated "
            "activation, or te.Linear layers for fc1 / fc2")
    dp_mesh = value.device_mesh
    root = compat.root_mesh(dp_mesh)
    names = getattr(root, "mesh_dim_names", None)
    dp_name = (getattr(dp_mesh, "mesh_dim_names", None) or (None,))[0]
    if root is dp_mesh or root.ndim != 2 or not names or dp_name not in names:
        raise ValueError(
            f"{where}: a tensor-parallel layer sharded by FSDP2 over a mesh that is not one "
            "dim of a 2-D (dp, tp) DeviceMesh; its state dict cannot say where its TP shard "
            "lies in the full tensor. Build the mesh with init_device_mesh(..., (dp, tp), "
            "mesh_dim_names=('dp', 'tp')) and pass mesh['dp'] to te.fsdp.fully_shard")
    dp_dim = names.index(dp_name)
    tp_dim = 1 - dp_dim
    tp_ranks = dist.get_process_group_ranks(root.get_group(tp_dim))
    if tp_ranks != dist.get_process_group_ranks(layer.tp_group):
        raise ValueError(
            f"{where}: the layer's tp_group (ranks {dist.get_process_group_ranks(layer.tp_group)}) "
            f"is not the other dim of the dp mesh's 2-D mesh (ranks {tp_ranks})")
    (dp_place,) = value.placements
    if type(dp_place) is not Shard:  # FSDP2's default; a strided or custom one is not
        raise NotImplementedError(f"{where}: FSDP2 placement {dp_place} (expected Shard)")
    if dp_place.dim == dim and dp_dim < tp_dim:
        dp_place = _StridedShard(dim, split_factor=len(tp_ranks))
    placements = [None, None]
    placements[dp_dim], placements[tp_dim] = dp_place, Shard(dim)
    shape = list(value.shape)
    shape[dim] *= len(tp_ranks)
    return root, tuple(placements), torch.Size(shape)


def _on_root_mesh(layer, name: str, value, dim):
    from torch.distributed.tensor import DTensor

    root, placements, shape = _layout(layer, name, value, dim)
    local = value.to_local()
    out = DTensor.from_local(local, root, placements, run_check=False, shape=shape,
                             stride=torch.empty(shape, device="meta").stride())
    # DTensor's own account of this rank's piece must be the piece it holds
    # (an uneven split where the two would differ is refused, not mislabelled)
    want = compat.local_shape_and_offset(shape, root, placements)[0]
    if tuple(want) != tuple(local.shape):
        raise NotImplementedError(
            f"{type(layer).__name__} parameter {name!r}: this rank holds a {tuple(local.shape)} "
            f"piece, but {placements} on the mesh place a {tuple(want)} one (an uneven FSDP2 "
            "shard of a tensor-parallel weight); its 2-D checkpoint is not supported")
    return out


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """The TP-split parameters on the whole (dp, tp) mesh (module level, so
    copies of a layer share nothing)."""
    from torch.distributed.tensor import DTensor

    from .fsdp_weight import _plain

    for name, dim in tp_split_dims(module).items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, DTensor) and value.device_mesh.ndim == 1:
            state_dict[key] = _on_root_mesh(module, name, _plain(value), dim)
    return state_dict


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs):
    """Values laid out as :func:`_state_dict_hook` writes them go back to the
    parameter's own DTensor over the dp mesh (the same local piece)."""
    from torch.distributed.tensor import DTensor

    for name, dim in tp_split_dims(module).items():
        key = prefix + name
        value, param = state_dict.get(key), getattr(module, name, None)
        if not (isinstance(value, DTensor) and isinstance(param, DTensor)
                and value.device_mesh.ndim == 2 and param.device_mesh.ndim == 1):
            continue
        root, placements, shape = _layout(module, name, param, dim)
        if (value.device_mesh, tuple(value.placements), value.shape) != (root, placements, shape):
            continue  # another layout: torch's own loading reports the mismatch
        state_dict[key] = DTensor.from_local(value.to_local(), param.device_mesh,
                                             param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())


def register(module: torch.nn.Module) -> torch.nn.Module:
    """Give every tensor-parallel te layer inside ``module`` the two hooks
    (once each).  Returns ``module``."""
    for layer in module.modules():
        if not tp_split_dims(layer):
            continue
        if _state_dict_hook not in layer._state_dict_hooks.values():
            layer._register_state_dict_hook(_state_dict_hook)
        if not any(getattr(h, "hook", h) is _load_pre_hook
                   for h in layer._load_state_dict_pre_hooks.values()):
            layer.register_load_state_dict_pre_hook(_load_pre_hook)
    return module
