"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with quantized weight all-gather.

Plain ``fully_shard`` already trains the layers: FSDP2 gathers each weight
in high precision and the layer quantizes it.  :func:`fully_shard` here
(or :func:`quantized_all_gather` before torch's own) makes each GEMM weight
a :class:`~.fsdp_weight.QuantizedAllGatherWeight`, a wrapper around the
high-precision shard that implements FSDP2's all-gather extension:

* ``fsdp_pre_all_gather`` quantizes this rank's shard in the recipe's
  weight format and hands FSDP2 the quantized bytes (and block scales) to
  gather: half of bf16's traffic, a quarter of fp32's;
* ``fsdp_post_all_gather`` assembles the gathered bytes into the recipe's
  quantized wrapper tensor (``Float8Tensor`` / ``Float8BlockwiseQTensor``),
  which FSDP2 installs as the unsharded parameter: the layer consumes it
  without quantizing again, and its weight gradient is a plain tensor that
  FSDP2 reduce-scatters as usual.

Which gather runs is ``fully_shard``'s ``quantized_gather``: by default
(``"auto"``) quantized when the shard group spans hosts and high precision
within one host, where the quantized gather's host work per weight costs
more than its halved bytes save (:func:`choose_gather`).

Which recipes gather quantized (:func:`gather_format`):

* ``Float8CurrentScaling``: the shard's amax is all-reduced (max) over the
  shard group first, so every rank uses the scale of the whole weight and
  the gathered tensor equals quantizing the whole weight on one device;
* ``Float8BlockScaling`` with 128x128 weight blocks: each rank's shard
  is whole block rows (``out_features`` a multiple of 128 x ranks), so the
  gathered data and block scales equal quantizing the whole weight.

Everything else gathers high precision (the wrapper is not applied):
``DelayedScaling`` (its scale moves between the forward's and the
backward's gather, so the two would quantize differently), MXFP8 and NVFP4
(1x32 / 16-element blocks and NVFP4's global scale make shard-wise
quantization awkward; both are emulated on Hopper anyway), bf16, and
shapes that do not shard evenly into whole blocks.

2-D parallelism (tensor parallel x FSDP2): build the te layers with
``tp_group=mesh["tp"].get_group()`` and shard with ``mesh=mesh["dp"]``.
FSDP2 takes each TP layer's local shard for the whole parameter: it shards
it over the dp group and gathers it there, so the FP8-current amax is
all-reduced over the dp group only (the TP rank's whole shard, as the TP
layer quantizes it without FSDP).  ``fully_shard`` keeps torch's meaning of
the mesh (a 2-D mesh is HSDP), and refuses one with a ``"tp"`` dim.

The gather format is fixed when the weight is wrapped (FSDP2 sizes its
gather buffers on the first gather).  A forward under another recipe, or
none, is refused while gradients are on (the gradient would not reach the
high-precision weight through a dequantized copy) and reads the
dequantized weight without them (validation).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch

from . import fsdp_tp
from .. import recipe as R
from .. import kernels
from .fsdp_weight import QuantizedAllGatherWeight, _plain, _profiled
from ..module.weight_format import check_gathered_weight  # noqa: F401  (te.fsdp's name)

log = logging.getLogger("transformer_engine_compile.fsdp")  # te.fsdp, its public name

__all__ = ["QuantizedAllGatherWeight", "fully_shard", "choose_gather", "spans_hosts",
           "gather_format", "gathered_formats", "save_original_weights",
           "quantized_all_gather", "gemm_weight_names", "check_gathered_weight", "fit_extra_state",
           "precompute_scales"]

FP8_BLOCK = 128


def gemm_weight_names(module: torch.nn.Module) -> tuple:
    """Names of ``module``'s own GEMM weights (``te.Linear`` / ``te.LayerNormLinear``:
    ``weight``; ``te.LayerNormMLP``: ``fc1_weight``, ``fc2_weight``), else ().
    A layer with ``parameters_split`` has none: its GEMM weight is its parts
    joined, whose quantization no part's gathered copy equals, so FSDP2
    gathers the parts in high precision."""
    from ..module.layernorm.mlp import LayerNormMLP
    from ..module.linear.layer import Linear

    if isinstance(module, LayerNormMLP):
        return ("fc1_weight", "fc2_weight")
    if isinstance(module, Linear) and module.parameters_split is None:
        return ("weight",)
    return ()


def gather_format(recipe: Optional[R.Recipe], shape, world_size: int) -> Optional[str]:
    """``"fp8_current"`` / ``"fp8_block"`` when a weight of ``shape`` sharded
    over ``world_size`` ranks gathers quantized under ``recipe``, else None
    (high precision, see the module docstring).  One rank gathers nothing
    (and FSDP2 then copies only the first of an extension's gather inputs)."""
    rows, cols = shape
    if world_size <= 1 or rows % world_size:
        return None
    if isinstance(recipe, R.Float8CurrentScaling):
        return "fp8_current"
    if (isinstance(recipe, R.Float8BlockScaling) and recipe.constant("w_block_scaling_dim") == 2
            and rows % (FP8_BLOCK * world_size) == 0 and cols % FP8_BLOCK == 0):
        return "fp8_block"
    return None


@torch.no_grad()
def precompute_scales(module: torch.nn.Module) -> None:
    """After the optimizer step: the quantized shards of every weight that
    FSDP2 gathers quantized in ``module``, made ahead of the next forward's
    gathers, with the FP8-current amaxes in one all-reduce per shard group
    instead of one per weight (as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``).  Optional: a gather whose
    weight changed since makes its own."""
    with _profiled("te.fsdp.precompute_scales"):
        _precompute_scales(module)


def _precompute_scales(module):
    by_group: dict = {}
    for param in module.parameters():
        local = getattr(param, "_local_tensor", None)
        if isinstance(local, QuantizedAllGatherWeight):
            group = param.device_mesh.get_group()
            by_group.setdefault(group, []).append(local)
    for group, weights in by_group.items():
        current = [w for w in weights if w._format == "fp8_current"]
        if current:
            inner = [w._inner for w in current]
            amaxes = torch.stack(torch._foreach_norm(inner, float("inf"))).float()
            torch.distributed.all_reduce(amaxes, torch.distributed.ReduceOp.MAX, group=group)
            for w, amax in zip(current, amaxes.split(1)):
                w._amax = (w._state(), amax)
            _cast_current_together(current, amaxes)
        for w in weights:  # whatever is not made yet (blockwise), one by one
            w._shard_inputs(group, _gather_dtype(w))


def _cast_current_together(weights: list, amaxes: torch.Tensor) -> None:
    """The FP8-current gather inputs of ``weights`` (``amaxes``: their
    reduced amaxes, in order), one launch for each set of weights that
    share a dtype, device and quantizer configuration: a launch per weight
    would cost the step's critical host path tens of microseconds each."""
    batches: dict = {}
    for i, w in enumerate(weights):
        if not w._inner.is_contiguous():
            continue  # cast on its own by _shard_inputs
        q = w._quantizer()
        key = (_gather_dtype(w), w._inner.dtype, w._inner.device, q.fp8_format,
               q.force_pow_2_scales, q.amax_epsilon)
        batches.setdefault(key, []).append(i)
    for (dtype, inner_dtype, _, fmt, pow2, eps), index in batches.items():
        xs = [weights[i]._inner.detach() for i in index]
        batch_amaxes = amaxes if len(index) == len(weights) else amaxes[index]
        if dtype != inner_dtype:  # the layer would quantize the param_dtype weight
            xs = [x.to(dtype) for x in xs]
            batch_amaxes = batch_amaxes.to(dtype).float()
        outs = kernels.get("quantize_fp8_many", xs[0])(xs, batch_amaxes, fmt, pow2, eps)
        for i, (data, scale_inv) in zip(index, outs):
            weights[i]._set_current_inputs(dtype, data, scale_inv)


def _gather_dtype(weight: QuantizedAllGatherWeight) -> torch.dtype:
    """The dtype FSDP2 gathers ``weight`` from: its mixed-precision policy's
    ``param_dtype`` as the last gather saw it, else the weight's own."""
    cached = weight._gather_input
    return cached[1] if cached is not None else weight.dtype


def _plain_state_dict_hook(module, state_dict, prefix, local_metadata):
    """``state_dict()`` of a layer with wrapped weights: plain tensors (a
    module-level function, so copies of the layer share nothing)."""
    for name in gemm_weight_names(module):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _plain(state_dict[key])
    return state_dict


def _world_size(mesh) -> int:
    if mesh is not None:
        return mesh.size()
    return torch.distributed.get_world_size()


def quantized_all_gather(module: torch.nn.Module, recipe: Optional[R.Recipe], *,
                         world_size: Optional[int] = None) -> torch.nn.Module:
    """Make the GEMM weights of every layer in ``module`` that gathers
    quantized under ``recipe`` (:func:`gather_format`) a
    :class:`QuantizedAllGatherWeight`; call right before ``fully_shard`` on
    the same ``module`` (the weights learn their FSDP2 unit from it).
    Weights already wrapped, and everything else, stay as they are.
    Returns ``module``."""
    if recipe is not None and not isinstance(recipe, R.Recipe):
        raise TypeError(f"recipe must be a transformer_engine_compile.recipe.Recipe or None, "
                        f"got {type(recipe).__name__}")
    world_size = _world_size(None) if world_size is None else world_size
    for layer in module.modules():
        for name in gemm_weight_names(layer):
            param = getattr(layer, name)
            if isinstance(param, QuantizedAllGatherWeight) or param.dim() != 2:
                continue
            fmt = gather_format(recipe, tuple(param.shape), world_size)
            if fmt is None:
                continue
            wrapped = QuantizedAllGatherWeight(param.data, recipe, fmt)
            wrapped._shared.set_unit(module)  # the module fully_shard is called on next
            setattr(layer, name, torch.nn.Parameter(wrapped, requires_grad=param.requires_grad))
            if _plain_state_dict_hook not in layer._state_dict_hooks.values():
                layer._register_state_dict_hook(_plain_state_dict_hook)
    return module


def save_original_weights(module: torch.nn.Module) -> torch.nn.Module:
    """Set ``save_original_weight`` on every te layer in ``module`` with
    GEMM weights: a weight FSDP2 gathers in high precision is then saved
    for the backward as the gathered parameter itself, whose storage FSDP2
    frees after the forward and gathers again for the backward, and the
    backward quantizes its columnwise copy again (bit for bit the forward's).
    Without it each layer would keep its quantized weight copy from the
    forward to the backward: 1 byte per parameter of the whole unsharded
    model, on every rank.  Weights gathered quantized are unaffected (their
    gathered copy is what FSDP2 frees and gathers again).  Includes the
    grouped expert layers (``te.GroupedLinear``, ``te.GroupedExperts``).
    Returns ``module``."""
    for layer in module.modules():
        if hasattr(type(layer), "save_original_weight"):
            layer.save_original_weight = True
    return module


def gathered_formats(module: torch.nn.Module) -> dict:
    """``{name: format}`` for every GEMM weight inside ``module``: how FSDP2
    gathers it, ``"fp8_current"`` / ``"fp8_block"`` or ``"high precision"``."""
    out = {}
    for prefix, layer in module.named_modules():
        for name in gemm_weight_names(layer):
            param = getattr(layer, name)
            local = getattr(param, "_local_tensor", param)
            fmt = local._format if isinstance(local, QuantizedAllGatherWeight) else "high precision"
            out[f"{prefix}.{name}" if prefix else name] = fmt
    return out


def _log_gather(module: torch.nn.Module, why: str) -> None:
    formats = gathered_formats(module)
    if not formats:
        return
    counts: dict = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    log.info("te.fsdp.fully_shard(%s): GEMM weights gathered %s (%s)", type(module).__name__,
             ", ".join(f"{fmt} {n}/{len(formats)}" for fmt, n in counts.items()), why)


def _ranks_per_host(group) -> int:
    """Ranks per host: torchrun's ``LOCAL_WORLD_SIZE``, else, for a group
    with a GPU backend, the visible GPUs, else the whole world (one host: a
    CPU group's ranks say nothing of the GPUs a machine has)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 0 and torch.cuda.is_available() \
            and "nccl" in str(torch.distributed.get_backend(group)):
        local = torch.cuda.device_count()
    return local if local > 0 else torch.distributed.get_world_size()


def spans_hosts(mesh=None) -> bool:
    """True when the shard group (``mesh``'s last dim: the whole 1-D mesh, or
    HSDP's shard dim; else the world) holds ranks of more than one host,
    ranks numbered host by host as torchrun does."""
    if mesh is None:
        group = torch.distributed.group.WORLD
    else:
        group = mesh.get_group(mesh.ndim - 1) if mesh.ndim > 1 else mesh.get_group()
    per_host = _ranks_per_host(group)
    ranks = torch.distributed.get_process_group_ranks(group)
    return len({r // per_host for r in ranks}) > 1


def choose_gather(quantized_gather: Union[bool, str], mesh=None) -> tuple:
    """``(quantize, why)``: whether :func:`fully_shard` gathers quantized,
    and the reason it logs.  ``"auto"`` gathers quantized only when the
    shard group spans hosts: within one host (NVLink) the high-precision
    gather measured faster for every recipe and model (docs/parallel.md),
    the all-gather hidden behind compute and the quantized gather's
    per-weight host work exposed; between hosts the gather's bytes are
    what the step waits for, and the quantized gather halves them."""
    if isinstance(quantized_gather, bool):
        return quantized_gather, f"quantized_gather={quantized_gather}"
    if quantized_gather != "auto":
        raise TypeError(f"te.fsdp.fully_shard: quantized_gather must be True, False or "
                        f"'auto', got {quantized_gather!r}")
    if spans_hosts(mesh):
        return True, "quantized_gather='auto': the shard group spans hosts"
    return False, ("quantized_gather='auto': one host, where the high-precision gather is "
                   "faster; quantized_gather=True halves its bytes")


def fully_shard(module: torch.nn.Module, *, recipe: Optional[R.Recipe] = None, mesh=None,
                quantized_gather: Union[bool, str] = "auto", **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, mesh=mesh, **kwargs)``
    with the GEMM weights inside ``module`` gathered in ``recipe``'s format
    (:func:`quantized_all_gather`) when ``quantized_gather`` says so:
    ``True``, ``False`` (high precision), or ``"auto"`` (the default,
    :func:`choose_gather`: quantized when the shard group spans hosts).
    ``recipe=None`` gathers high precision.  Which format each weight
    gathers in, and why, is logged (logger ``transformer_engine_compile.fsdp``,
    INFO) and :func:`gathered_formats` tells.

    The quantized gather moves half of bf16's bytes; the high-precision
    gather costs less host time per step (no all-gather extension per
    weight).  Neither holds a weight copy from the forward to the backward:
    with the high-precision gather the layers save the gathered weight
    itself, which FSDP2 frees and gathers again, and quantize it again in
    the backward (:func:`save_original_weights`, set here for every te
    layer in ``module``).  docs/parallel.md measures both.

    ``mesh`` is the data-parallel mesh, as for torch's: with tensor
    parallelism on a ``(dp, tp)`` mesh pass ``mesh["dp"]`` (the layers hold
    their TP shards and ``tp_group``).  A mesh of several dims with one
    named ``"tp"`` is refused: torch would take it for HSDP (replicate over
    dim 0, shard over dim 1) and shard over the tensor-parallel ranks.
    The tensor-parallel layers' state dicts then place their shards on the
    whole mesh, so ``torch.distributed.checkpoint`` saves and loads every
    TP shard (:mod:`transformer_engine_compile.parallel.fsdp_tp`)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None and mesh.ndim > 1 and "tp" in names:
        raise ValueError(
            f"te.fsdp.fully_shard: mesh has the dims {tuple(names)}; FSDP2 shards over the "
            "data-parallel ranks only: pass mesh['dp'] (the te layers run tensor "
            "parallelism over their own tp_group; a 2-D mesh would mean HSDP to torch)")
    if recipe is not None and not isinstance(recipe, R.Recipe):
        raise TypeError(f"te.fsdp.fully_shard: recipe must be a "
                        f"transformer_engine_compile.recipe.Recipe or None, got {type(recipe).__name__}")
    quantize, why = choose_gather(quantized_gather, mesh)
    if quantize:
        quantized_all_gather(module, recipe, world_size=_world_size(mesh))
    save_original_weights(module)
    _log_gather(module, why)
    fsdp_tp.register(module)
    return torch_fully_shard(module, mesh=mesh, **kwargs)


def fit_extra_state(state_dict: dict, checkpoint_id) -> dict:
    """Size the layers' ``_extra_state`` entries of ``state_dict`` (nested
    dicts too) like the saved ones, before ``torch.distributed.checkpoint.load``
    (which loads into tensors of the saved size): a model that has not run
    yet holds empty extra state, a DelayedScaling checkpoint 4 L + 4 values.
    ``checkpoint_id``: the path given to ``dcp.save``.  Returns ``state_dict``."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata

    def fit(d: dict, prefix: str):
        for key, value in d.items():
            name = prefix + key
            if isinstance(value, dict):
                fit(value, name + ".")
            elif key.endswith("_extra_state") and isinstance(value, torch.Tensor):
                meta = saved.get(name)
                size = getattr(meta, "size", None)
                if size is not None and tuple(size) != tuple(value.shape):
                    d[key] = value.new_empty(size)

    fit(state_dict, "")
    return state_dict

