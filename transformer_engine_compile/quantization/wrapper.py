"""``QuantizedTensor``: the torch.Tensor wrapper-subclass base of every format.

A wrapper tensor reports the logical shape and high-precision dtype, holds
the storage's buffers, and implements the few torch ops a parameter needs.
Any other op raises, naming the op: silently dequantizing would hide
precision and memory costs.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .base import QuantizedTensorStorage

aten = torch.ops.aten


def _rebuild(src: "QuantizedTensor", shape, buffers: dict, requires_grad=False):
    meta = src._meta()
    meta = type(meta)(meta.cls_name, meta.dtype, meta.quantizer, meta.extras, requires_grad)
    return meta.build(shape, buffers)


def _rowwise_key(t) -> str | None:
    for name in ("data", "rowwise_data"):
        if getattr(t, "_" + name, None) is not None:
            return name
    return None


def _view(t: "QuantizedTensor", shape):
    """View that keeps the last dim: only the rowwise data changes shape."""
    shape = list(shape)
    numel = t.numel()
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = numel // known if known else 0
    if not shape or shape[-1] != t.shape[-1] or torch.Size(shape).numel() != numel:
        raise NotImplementedError(
            f"{type(t).__name__}: view/reshape must keep the last dim "
            f"({tuple(t.shape)} -> {tuple(shape)}); dequantize() first")
    buffers = dict(t.buffers())
    key = _rowwise_key(t)
    if key is not None:
        data = buffers[key]
        buffers[key] = data.view(*shape[:-1], data.shape[-1])
    return _rebuild(t, torch.Size(shape), buffers)


def _copy_into(dst: "QuantizedTensor", src) -> None:
    if isinstance(src, QuantizedTensorStorage):
        if type(src) is not type(dst) or src.extras() != dst.extras():
            raise NotImplementedError(
                f"copy_ from {type(src).__name__} into {type(dst).__name__}: formats differ")
        src_buffers = src.buffers()
    else:
        if dst._quantizer is None:
            raise NotImplementedError(
                f"copy_ into {type(dst).__name__} needs its quantizer to re-quantize")
        usages = dst.get_usages()
        q = dst._quantizer.with_usage(rowwise=usages["rowwise"], columnwise=usages["columnwise"])
        src_buffers = q.quantize(src.to(dst.dtype).reshape(dst.shape)).buffers()
    dst_buffers = dst.buffers()
    if list(src_buffers) != list(dst_buffers):
        raise NotImplementedError(
            f"copy_: source has buffers {list(src_buffers)}, destination {list(dst_buffers)}")
    for name, buf in dst_buffers.items():
        buf.copy_(src_buffers[name].view(buf.shape))


def _is_identity_strided(t, size, stride, storage_offset=0) -> bool:
    """``as_strided(t, size, stride, offset)`` is ``t`` itself (contiguous)."""
    expected, step = [], 1
    for s in reversed(tuple(size)):
        expected.insert(0, step)
        step *= max(s, 1)
    return (tuple(size) == tuple(t.shape) and not storage_offset
            and tuple(stride) == tuple(expected))


class QuantizedTensor(torch.Tensor):
    """Wrapper tensor base; concrete classes also inherit their storage class."""

    @staticmethod
    def __new__(cls, shape, dtype, *, quantizer=None, requires_grad=False, **kwargs):
        device = next(t.device for t in kwargs.values() if isinstance(t, torch.Tensor))
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the storage base's shape/dtype/device/size come first in the MRO;
        # wrappers must report torch.Tensor's own (identical, but C-level).
        for name in ("shape", "dtype", "device", "size"):
            setattr(cls, name, getattr(torch.Tensor, name))

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return QuantizedTensorStorage.__repr__(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            src = args[0]
            return _rebuild(src, src.shape, dict(src.buffers()))
        if func is aten.clone.default:
            src = args[0]
            return _rebuild(src, src.shape, {k: v.clone() for k, v in src.buffers().items()})
        if func is aten._to_copy.default:
            src = args[0]
            dtype = kwargs.get("dtype")
            device = kwargs.get("device")
            if dtype is not None and dtype != src.dtype:
                out = src.dequantize(dtype=dtype)
                return out.to(device) if device is not None else out
            moved = {k: v.to(device) if device is not None else v.clone()
                     for k, v in src.buffers().items()}
            return _rebuild(src, src.shape, moved)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, QuantizedTensor):
                _copy_into(dst, src)
                return dst
            return dst.copy_(src.dequantize(dtype=dst.dtype))
        if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return _view(args[0], args[1])
        if func is aten.as_strided.default and _is_identity_strided(*args):
            src = args[0]  # FSDP2 installs its unsharded parameter through as_strided
            return _rebuild(src, src.shape, dict(src.buffers()))
        if func in (aten.is_same_size.default,):
            return args[0].shape == args[1].shape
        names = tree_map(lambda a: type(a).__name__ if isinstance(a, torch.Tensor) else a, args)
        raise NotImplementedError(
            f"{cls.__name__} does not support {func} (args {names}); "
            "call .dequantize() to get a high-precision tensor first (a gradient quantized by "
            "te.Linear(fp8_grad=True) can flow only into a te.Linear, through views)")
