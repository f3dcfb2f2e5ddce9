"""The weight FSDP2 all-gathers quantized: :class:`QuantizedAllGatherWeight`.

A wrapper around a sharded high-precision GEMM weight that implements
FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``): each rank hands FSDP2 its shard quantized in the
recipe's weight format, and the gathered bytes become the recipe's
quantized weight, which the layer consumes as is.  Which weights are
wrapped, and the sharding API around them, live in :mod:`.fsdp`.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
from torch.utils._pytree import tree_map

from .. import kernels
from .. import recipe as R
from .. import compat
from ..kernels import reference as ref
from ..quantization import factory

aten = torch.ops.aten

# ops whose result is still the sharded weight (or a piece of it), as FSDP2
# and torch.optim use them; every other op returns plain tensors
_KEEP_WRAPPER = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.narrow.default, aten.clone.default, aten.empty_like.default,
    aten.new_zeros.default, aten.new_empty.default, aten._to_copy.default,
    aten._pin_memory.default, aten.copy_.default,
}


class _SignedMethod:
    """A method whose bound form carries its signature: ``inspect.signature``
    reads the stored ``__signature__`` instead of building the bound
    method's anew at each call."""

    def __init__(self, fn):
        self._fn = fn
        params = list(inspect.signature(fn).parameters.values())[1:]  # without self
        self._bound_signature = inspect.Signature(params)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self._fn
        return _SignedBound(self._fn, obj, self._bound_signature)


class _SignedBound:
    """``obj.method`` as :class:`_SignedMethod` binds it."""

    __slots__ = ("_fn", "_obj", "__signature__")

    def __init__(self, fn, obj, signature):
        self._fn, self._obj, self.__signature__ = fn, obj, signature

    def __call__(self, *args, **kwargs):
        return self._fn(self._obj, *args, **kwargs)


class QuantizedAllGatherWeight(torch.Tensor):
    """A sharded high-precision GEMM weight that FSDP2 all-gathers quantized.

    Outside the all-gather it behaves as its inner tensor (optimizer steps,
    ``copy_``, state dicts operate on the high-precision values); ops other
    than the views and copies FSDP2 makes return plain tensors.

    The quantized shard is made once per weight update and kept: the
    forward's gather and the backward's re-gather send the same bytes, and
    ``te.fsdp.precompute_scales`` makes every shard right after the optimizer
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
        # (state, param dtype, (gather inputs, scale), the raw streams they were recorded on)
        self._gather_input = None
        self._scale_recorded = None  # (scale, the raw streams it was recorded on)
        self._mesh_group = None  # (FSDP2's shard mesh, its process group)
        self._quantizers = {}  # usages -> quantizer (value objects: made once)

    def __repr__(self, *, tensor_contents=None):
        return f"QuantizedAllGatherWeight({self._format}, {self._inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrapped = []

        def unwrap(t):
            if isinstance(t, cls):
                wrapped.append(t)
                return t._inner
            if type(t) is list or type(t) is tuple:  # Tensor[] (the optimizer's lists)
                items = []
                for u in t:
                    if isinstance(u, cls):
                        wrapped.append(u)
                        u = u._inner
                    items.append(u)
                return type(t)(items)
            return t

        # an aten schema nests tensors one list deep at most: no pytree walk
        out = func(*(unwrap(a) for a in args),
                   **({k: unwrap(v) for k, v in kwargs.items()} if kwargs else {}))
        if func._schema.is_mutable:  # e.g. the optimizer's in-place update
            for t in wrapped:
                t._shared.updates += 1
        if func not in _KEEP_WRAPPER:
            return out
        template = wrapped[0]
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
    # Both hooks run for every gathered weight at every gather, on the step's
    # critical host path: they do attribute reads and cached lookups only.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard quantized: (bytes to gather, metadata)."""
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function("te.fsdp.pre_all_gather"):
                return self._pre_all_gather(mesh, mp_policy)
        return self._pre_all_gather(mesh, mp_policy)

    # FSDP2 reads this method's signature at every gather (inspect.signature of
    # the bound method: tens of microseconds per weight when built anew)
    fsdp_pre_all_gather = _SignedMethod(fsdp_pre_all_gather)

    def _pre_all_gather(self, mesh, mp_policy):
        dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else self.dtype
        if self._mesh_group is None or self._mesh_group[0] is not mesh:
            self._mesh_group = (mesh, mesh.get_group())
        inputs, scale = self._shard_inputs(self._mesh_group[1], dtype)
        # read on FSDP2's copy-in streams, kept past them
        recorded = _record_once(inputs, self._gather_input[3])
        if recorded is not self._gather_input[3]:
            self._gather_input = (*self._gather_input[:3], recorded)
        return inputs, (dtype, scale)

    def _shard_inputs(self, group, dtype) -> tuple:
        """``(gather inputs, scale)`` of this shard quantized from ``dtype``,
        made once per weight update: FP8 current scaling gathers the bytes
        alone (its scale, the whole weight's, is the same on every rank and
        rides in the metadata: one gather input per weight, which is
        FSDP2's host work per weight), 128x128 blocks gather the bytes and
        the block scales (scale None)."""
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
            inputs = ((buffers["data"].view(torch.uint8),), buffers["scale_inv"])
        else:  # fp8_block: whole 128-row blocks
            buffers = q._quantize_rows(x)
            inputs = ((buffers["rowwise_data"].view(torch.uint8),
                       buffers["rowwise_scale_inv"]), None)
        self._gather_input = (state, dtype, inputs, ())  # no stream recorded yet
        return inputs

    def _set_current_inputs(self, dtype, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Keep FP8 current scaling's gather inputs made elsewhere (one cast
        of many weights, ``te.fsdp.precompute_scales``) for this weight as it
        is now, quantized from ``dtype``."""
        self._gather_input = (self._state(), dtype, ((data.view(torch.uint8),), scale_inv), ())

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
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function("te.fsdp.post_all_gather"):
                return self._post_all_gather(all_gather_outputs, metadata, out)
        return self._post_all_gather(all_gather_outputs, metadata, out)

    def _record_scale(self, scale: torch.Tensor) -> None:
        """The gathered weight's scale is read on the streams the gathers end
        on (the layers'): recorded on each, once per scale."""
        recorded = self._scale_recorded
        streams = recorded[1] if recorded is not None and recorded[0] is scale else ()
        self._scale_recorded = (scale, _record_once((scale,), streams))

    def _post_all_gather(self, all_gather_outputs, metadata, out):
        dtype, scale = metadata
        q = self._quantizer(rowwise=True, columnwise=True)
        fp8 = ref.FP8_DTYPE[q.fp8_format]
        if self._format == "fp8_current":
            (data,) = all_gather_outputs
            data = data.view(fp8)
            self._record_scale(scale)
            if out is not None:  # the scale of the weight just gathered
                out._scale_inv = scale
            buffers = {"data": data, "transpose": None, "scale_inv": scale}
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


def _record_once(tensors, recorded: tuple) -> tuple:
    """Record ``tensors`` (of one device) on the current CUDA stream unless
    its raw id is in ``recorded``; returns the ids recorded on (``recorded``
    itself when nothing was).  Raw ids, not stream objects: the gather hooks
    run per weight on the step's critical host path."""
    index = tensors[0].get_device()
    if index < 0:
        return recorded
    raw = torch._C._cuda_getCurrentRawStream(index)
    if raw in recorded:
        return recorded
    stream = torch.cuda.current_stream(index)
    for t in tensors:
        t.record_stream(stream)
    return recorded + (raw,)


def _profiled(name: str):
    """A ``record_function`` range while torch.profiler records, else nothing
    (the range's own cost stays off the unprofiled hot path)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


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
