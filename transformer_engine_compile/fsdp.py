"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with quantized weight all-gather.

Plain ``fully_shard`` already trains the layers: FSDP2 gathers each weight
in high precision and the layer quantizes it.  :func:`fully_shard` here
(or :func:`quantized_all_gather` before torch's own) makes each GEMM weight
a :class:`QuantizedAllGatherWeight`, a wrapper around the high-precision
shard that implements FSDP2's all-gather extension:

* ``fsdp_pre_all_gather`` quantizes this rank's shard in the recipe's
  weight format and hands FSDP2 the quantized bytes (and block scales) to
  gather: half of bf16's traffic, a quarter of fp32's;
* ``fsdp_post_all_gather`` assembles the gathered bytes into the recipe's
  quantized wrapper tensor (``Float8Tensor`` / ``Float8BlockwiseQTensor``),
  which FSDP2 installs as the unsharded parameter: the layer consumes it
  without quantizing again, and its weight gradient is a plain tensor that
  FSDP2 reduce-scatters as usual.

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

import contextlib
import inspect
import logging
import weakref
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from . import fsdp_tp
from . import recipe as R
from . import kernels
from .kernels import reference as ref
from .dynamo import compat
from .quantization import factory
from .quantization.base import QuantizedTensorStorage

aten = torch.ops.aten
log = logging.getLogger(__name__)

__all__ = ["QuantizedAllGatherWeight", "fully_shard", "gather_format", "gathered_formats",
           "quantized_all_gather", "gemm_weight_names", "check_gathered_weight", "fit_extra_state",
           "precompute_scales"]

FP8_BLOCK = 128

# ops whose result is still the sharded weight (or a piece of it), as FSDP2
# and torch.optim use them; every other op returns plain tensors
_KEEP_WRAPPER = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.narrow.default, aten.clone.default, aten.empty_like.default,
    aten.new_zeros.default, aten.new_empty.default, aten._to_copy.default,
    aten._pin_memory.default, aten.copy_.default,
}


def gemm_weight_names(module: torch.nn.Module) -> tuple:
    """Names of ``module``'s own GEMM weights (``te.Linear`` / ``te.LayerNormLinear``:
    ``weight``; ``te.LayerNormMLP``: ``fc1_weight``, ``fc2_weight``), else ().
    A layer with ``parameters_split`` has none: its GEMM weight is its parts
    joined, whose quantization no part's gathered copy equals, so FSDP2
    gathers the parts in high precision."""
    from .module.layernorm_mlp import LayerNormMLP
    from .module.linear import Linear

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


class QuantizedAllGatherWeight(torch.Tensor):
    """A sharded high-precision GEMM weight that FSDP2 all-gathers quantized.

    Outside the all-gather it behaves as its inner tensor (optimizer steps,
    ``copy_``, state dicts operate on the high-precision values); ops other
    than the views and copies FSDP2 makes return plain tensors.

    The quantized shard is made once per weight update and kept: the
    forward's gather and the backward's re-gather send the same bytes, and
    :func:`precompute_scales` makes every shard's right after the optimizer
    step, so FSDP2's gather hooks (on the step's critical host path) only
    hand it over.  A weight update is seen through the inner tensor's version
    counter (in-place ops on it or on views of it) and a counter this class
    keeps: ops dispatched through the wrapper, such as the optimizer's, run
    below autograd and leave the inner version counter as it was."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, recipe: R.Recipe, fmt: str, shared=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, recipe: R.Recipe, fmt: str, shared=None):
        self._inner = inner
        self._recipe = recipe
        self._format = fmt
        # what every wrapper of this weight (the views and copies FSDP2 makes)
        # shares: writes through any of them, the FSDP2 unit that gathers it
        self._shared = _SharedState() if shared is None else shared
        self._amax = None  # (state, amax over the shard group): see _group_amax
        # (state, param dtype, gather inputs, the stream they were recorded on)
        self._gather_input = None
        self._quantizers = {}  # usages -> quantizer (value objects: made once)

    def __repr__(self, *, tensor_contents=None):
        return f"QuantizedAllGatherWeight({self._format}, {self._inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        template = None
        wrapped = []

        def unwrap(t):
            nonlocal template
            if isinstance(t, cls):
                template = t if template is None else template
                wrapped.append(t)
                return t._inner
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable:  # e.g. the optimizer's in-place update
            for t in wrapped:
                t._shared.updates += 1
        if func not in _KEEP_WRAPPER:
            return out
        return tree_map(lambda t: cls(t, template._recipe, template._format, template._shared)
                        if type(t) is torch.Tensor else t, out)

    def __tensor_flatten__(self):
        return ["_inner"], (self._recipe, self._format)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return QuantizedAllGatherWeight(inner_tensors["_inner"], *meta)

    def _state(self) -> tuple:
        """Changes with every write to the high-precision values."""
        return (self._inner._version, self._shared.updates)

    def _quantizer(self, rowwise=True, columnwise=False):
        q = self._quantizers.get((rowwise, columnwise))
        if q is None:
            q = self._quantizers[(rowwise, columnwise)] = factory.quantizer_for(
                self._recipe, "weight").with_usage(rowwise=rowwise, columnwise=columnwise)
        return q

    # -- FSDP2's all-gather extension ---------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard quantized: (bytes to gather, metadata)."""
        with _profiled("te.fsdp.pre_all_gather"):
            dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else self.dtype
            inputs = self._shard_inputs(mesh.get_group(), dtype)
            if inputs[0].is_cuda:  # read on FSDP2's copy-in stream, kept past it
                stream = torch.cuda.current_stream(inputs[0].device)
                if self._gather_input[3] != stream:
                    for t in inputs:
                        t.record_stream(stream)
                    self._gather_input = (*self._gather_input[:3], stream)
            return inputs, (dtype,)

    # FSDP2 reads this method's signature on every gather (inspect.signature,
    # tens of microseconds of host time per weight): a stored one is read back
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)

    def _shard_inputs(self, group, dtype) -> tuple:
        """(FP8 bytes, scales) of this shard quantized from ``dtype``, made
        once per weight update."""
        state = self._state()
        cached = self._gather_input
        if cached is not None and cached[0] == state and cached[1] == dtype:
            return cached[2]
        x = self._inner.detach()
        if dtype != x.dtype:  # the layer would quantize the param_dtype weight
            x = x.to(dtype)
        q = self._quantizer()
        if self._format == "fp8_current":
            amax = self._group_amax(group)
            if dtype != self._inner.dtype:  # amax of the cast weight: the cast amax
                amax = amax.to(dtype).float()
            # FSDP2 hands over a 2-D shard of the weight: the cast kernel alone
            buffers = kernels.get("quantize_fp8_current", x)(
                x, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon, True, False, amax)
            # the scale (the same on every rank) travels with the bytes: FSDP2
            # then owns every buffer the gathered weight reads, on its streams
            inputs = (buffers["data"].view(torch.uint8), buffers["scale_inv"])
        else:  # fp8_block: whole 128-row blocks
            buffers = q._quantize_rows(x)
            inputs = (buffers["rowwise_data"].view(torch.uint8), buffers["rowwise_scale_inv"])
        self._gather_input = (state, dtype, inputs, None)  # None: no stream recorded yet
        return inputs

    def _group_amax(self, group) -> torch.Tensor:
        """The whole weight's amax (fp32, shape (1,)): this shard's, all-reduced
        (max) over ``group``; kept until the weight changes."""
        state = self._state()
        if self._amax is None or self._amax[0] != state:
            amax = self._inner.detach().abs().amax().float().reshape(1)
            torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=group)
            self._amax = (state, amax)
        return self._amax[1]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered bytes as the recipe's quantized weight (both copies:
        the transposed one is built here, as a cast-transpose would)."""
        with _profiled("te.fsdp.post_all_gather"):
            return self._post_all_gather(all_gather_outputs, metadata, out)

    def _post_all_gather(self, all_gather_outputs, metadata, out):
        (dtype,) = metadata
        q = self._quantizer(rowwise=True, columnwise=True)
        fp8 = ref.FP8_DTYPE[q.fp8_format]
        if self._format == "fp8_current":
            data, scales = all_gather_outputs
            data = data.view(fp8)
            buffers = {"data": data, "transpose": None, "scale_inv": scales[:1]}
            derived = {"transpose": data}
        else:
            data, scales = all_gather_outputs
            data = data.view(fp8)
            buffers = {"rowwise_data": data, "rowwise_scale_inv": scales,
                       "columnwise_data": None, "columnwise_scale_inv": None}
            derived = {"columnwise_data": data, "columnwise_scale_inv": scales}
        # the transposed copies serve the backward alone (dgrad): a forward
        # gather that FSDP2 repeats before the backward leaves them to it
        later = compat.fsdp_gathers_again_for_backward(self._shared.unit())
        if out is not None:  # FSDP2 re-gathered into the same storage
            if later:
                return None
            # refresh what the forward may have saved for backward: the
            # values are the same (no optimizer step in between), so keep
            # the version counters as FSDP2 does for its own copy-out
            for name, src in derived.items():
                dst = getattr(out, "_" + name)
                with torch.autograd._unsafe_preserve_version_counter(dst):
                    _transpose(src, data.shape[1], dst)
            return None
        for name, src in derived.items():
            buffers[name] = _transpose_like(src, data.shape[1]) if later else \
                _transpose(src, data.shape[1])
        shape = torch.Size(data.shape)
        tensor = q.create_metadata(shape, dtype).build(shape, buffers)
        return tensor, tuple(buffers[name] for name in derived)


class _SharedState:
    """What the wrappers of one weight share: ``updates``, bumped by every
    mutating op dispatched through any of them, and ``unit``, the FSDP2 unit
    (the module given to ``fully_shard``) that gathers the weight, held
    weakly (None until known)."""

    __slots__ = ("updates", "_unit")

    def __init__(self):
        self.updates = 0
        self._unit = None

    def unit(self):
        return None if self._unit is None else self._unit()

    def set_unit(self, module: torch.nn.Module) -> None:
        self._unit = weakref.ref(module)

    def __deepcopy__(self, memo):
        """A copied weight belongs to no unit yet (not the original's): until
        it is known, every gather makes the transposed copy."""
        copied = _SharedState()
        copied.updates = self.updates
        return copied


def _profiled(name: str):
    """A ``record_function`` range while torch.profiler records, else nothing
    (the range's own cost stays off the unprofiled hot path)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


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
        for w in weights:
            w._shard_inputs(group, _gather_dtype(w))


def _gather_dtype(weight: QuantizedAllGatherWeight) -> torch.dtype:
    """The dtype FSDP2 gathers ``weight`` from: its mixed-precision policy's
    ``param_dtype`` as the last gather saw it, else the weight's own."""
    cached = weight._gather_input
    return cached[1] if cached is not None else weight.dtype


def _transpose_like(x2d: torch.Tensor, k: int) -> torch.Tensor:
    """An uninitialised buffer shaped as :func:`_transpose`'s result (for a
    later gather to fill); padded block scales are zeros, as there."""
    if x2d.element_size() == 1:
        return x2d.new_empty((x2d.shape[1], x2d.shape[0]))
    return ref.pad_block_scales(x2d.new_zeros((k // ref.FP8_BLOCK, x2d.shape[0])))


def _transpose(x2d: torch.Tensor, k: int, out=None) -> torch.Tensor:
    """The transposed copy of gathered FP8 bytes (a Triton tile kernel on
    CUDA) or of fp32 128x128 block scales of a weight with ``k`` columns:
    those are stored with their blocks padded (``reference.padded_blocks``),
    so only the (rows, K/128) part is transposed and the result padded
    again (``out``'s padding, zeros since it was built so, is left as is)."""
    if x2d.element_size() == 1:
        return kernels.get("transpose_bytes", x2d)(x2d, out)
    scales = x2d[:, :k // ref.FP8_BLOCK].t()
    if out is None:
        return ref.pad_block_scales(scales)
    out[:, :scales.shape[1]].copy_(scales)
    return out


def check_gathered_weight(owner: str, weight, recipe, grad_enabled: bool):
    """The weight a layer's GEMM takes: ``weight`` itself, unless it is
    quantized (gathered by FSDP2 through :class:`QuantizedAllGatherWeight`,
    or an FP8 primary weight) in another format than the active recipe's:
    then its dequantized values without gradients, a clear error with them."""
    if not isinstance(weight, QuantizedTensorStorage):
        return weight
    if recipe is not None and isinstance(weight, factory.weight_storage_class(recipe)):
        return weight  # the recipe's format family (the GEMM checks the rest)
    if grad_enabled and weight.requires_grad:
        active = "no recipe" if recipe is None else type(recipe).__name__
        raise RuntimeError(
            f"{owner}: the weight is a {type(weight).__name__} (FSDP2 gathers it so for "
            f"the recipe given to te.fsdp.fully_shard), but the forward runs under "
            f"{active}; training needs the high-precision weight for its gradient. Shard "
            "with the recipe you train with (or recipe=None to gather high precision)")
    return weight.dequantize()


def _plain(value):
    """A state-dict value without the wrapper: the inner high-precision
    tensor (a DTensor shard of it under FSDP2), sharing its storage, so
    checkpoints hold plain tensors and in-place loads reach the weight."""
    local = getattr(value, "_local_tensor", None)
    if isinstance(local, QuantizedAllGatherWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local._inner, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, QuantizedAllGatherWeight):
        return value._inner
    return value


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


def _log_gather(module: torch.nn.Module, quantized_gather: bool) -> None:
    formats = gathered_formats(module)
    if not formats:
        return
    counts: dict = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    why = "" if quantized_gather else " (quantized_gather=False)"
    log.info("te.fsdp.fully_shard(%s): GEMM weights gathered %s%s", type(module).__name__,
             ", ".join(f"{fmt} {n}/{len(formats)}" for fmt, n in counts.items()), why)


def fully_shard(module: torch.nn.Module, *, recipe: Optional[R.Recipe] = None, mesh=None,
                quantized_gather: bool = True, **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, mesh=mesh, **kwargs)``
    with the GEMM weights inside ``module`` gathered in ``recipe``'s format
    (:func:`quantized_all_gather`; ``recipe=None`` or
    ``quantized_gather=False`` gathers high precision).  Which format each
    weight gathers in is logged (logger ``transformer_engine_compile.fsdp``,
    INFO) and :func:`gathered_formats` tells.

    The quantized gather moves half of bf16's bytes and keeps peak memory
    at or below the high-precision gather's; the high-precision gather
    costs less host time per step (no all-gather extension per weight) but
    each layer then saves its quantized weight copy for the backward, so
    peak memory grows by the FP8 size of every gathered layer's weights.
    docs/parallel.md measures both.

    ``mesh`` is the data-parallel mesh, as for torch's: with tensor
    parallelism on a ``(dp, tp)`` mesh pass ``mesh["dp"]`` (the layers hold
    their TP shards and ``tp_group``).  A mesh of several dims with one
    named ``"tp"`` is refused: torch would take it for HSDP (replicate over
    dim 0, shard over dim 1) and shard over the tensor-parallel ranks.
    The tensor-parallel layers' state dicts then place their shards on the
    whole mesh, so ``torch.distributed.checkpoint`` saves and loads every
    TP shard (:mod:`transformer_engine_compile.fsdp_tp`)."""
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
    if not isinstance(quantized_gather, bool):
        raise TypeError(f"te.fsdp.fully_shard: quantized_gather must be True or False, "
                        f"got {quantized_gather!r}")
    if quantized_gather:
        quantized_all_gather(module, recipe, world_size=_world_size(mesh))
    _log_gather(module, quantized_gather)
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

