"""TensorProto: layout of create_tensor() equals a real quantize(), eagerly,
under FakeTensorMode and inside torch.compile(fullgraph=True)."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import transformer_engine_compile as te
from transformer_engine_compile.quantization.base import Quantizer

from conftest import ALL, STATELESS

SHAPE = (2, 128, 256)


def _layout(t):
    """Everything but values: class, logical shape/dtype, per-buffer
    name/shape/stride/dtype in flatten order."""
    names, meta = t.__tensor_flatten__()
    bufs = [(n, tuple(getattr(t, n).shape), tuple(getattr(t, n).stride()), getattr(t, n).dtype)
            for n in names]
    return type(t), tuple(t.shape), t.dtype, bufs, meta.extras


def _real(name, usage, dtype=torch.bfloat16):
    q = ALL[name](*usage)
    return q, q.quantize(torch.randn(SHAPE, dtype=dtype))


def test_create_tensor_eager_matches_quantize(any_name, usage):
    q, real = _real(any_name, usage)
    proto = te.TensorProto(SHAPE, torch.bfloat16, q)
    made = proto.create_tensor()
    assert _layout(made) == _layout(real)
    assert proto.inner_names() == real.__tensor_flatten__()[0]


def test_create_tensor_under_fake_mode_matches_quantize(any_name, usage):
    q, real = _real(any_name, usage)
    with FakeTensorMode():
        made = te.TensorProto(SHAPE, torch.bfloat16, q).create_tensor()
        layout = _layout(made)
    assert layout == _layout(real)


def test_create_tensor_in_compiled_function_matches_quantize(stateless_name, usage):
    torch._dynamo.reset()
    counters.clear()
    q, real = _real(stateless_name, usage)

    def f(q):
        return te.TensorProto(SHAPE, torch.bfloat16, q).create_tensor()

    made = torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    assert _layout(made) == _layout(real)
    assert not counters["graph_break"]


def test_create_tensor_traces_with_usage_change_inside_compile():
    torch._dynamo.reset()
    q = te.NVFP4Quantizer()

    def f(x, q):
        proto = te.TensorProto(x.shape, x.dtype, q).update_usage(rowwise=False)
        t = proto.create_tensor()
        return x.sum() + 0 * len(proto.inner_names()), t

    x = torch.randn(32, 64)
    _, t = torch.compile(f, fullgraph=True, backend="aot_eager")(x, q)
    assert t.get_usages() == {"rowwise": False, "columnwise": True}
    assert q.rowwise_usage  # caller's quantizer untouched


def test_plain_proto():
    p = te.TensorProto((3, 4), torch.float32, requires_grad=True)
    assert not p.is_quantized and p.inner_names() == [] and p.stride() == (4, 1)
    t = p.create_tensor()
    assert t.shape == (3, 4) and t.requires_grad and type(t) is torch.Tensor


def test_update_usage_changes_only_the_private_copy():
    shared = te.MXFP8Quantizer()
    p = te.TensorProto((64, 64), torch.float32, shared)
    p.update_usage(columnwise=False)
    assert shared.columnwise_usage and not p.quantizer.columnwise_usage
    assert p.inner_names() == ["_rowwise_data", "_rowwise_scale_inv"]
    shared.set_usage(rowwise=False)  # later changes to the shared one don't leak in
    assert p.quantizer.rowwise_usage


def test_metadata_and_requires_grad():
    p = te.TensorProto((128, 128), torch.bfloat16, te.Float8BlockQuantizer(), requires_grad=True)
    meta = p.create_metadata()
    assert meta.storage_class() is te.Float8BlockwiseQTensor and meta.requires_grad
    assert dict(meta.extras) == {"fp8_format": "e4m3", "block_scaling_dim": 2}
    t = p.create_tensor()
    assert t.requires_grad and t.dtype == torch.bfloat16


def test_internal_quantizer_gives_storage():
    q = te.Float8CurrentScalingQuantizer(internal=True)
    made = te.TensorProto((4, 8), torch.float32, q).create_tensor()
    assert type(made) is te.Float8TensorStorage


def test_bad_shape_raises_through_proto():
    with pytest.raises(ValueError, match="MXFP8 needs the last dim divisible by 32"):
        te.TensorProto((32, 40), torch.float32, te.MXFP8Quantizer()).inner_names()


class _Disordered(te.MXFP8Quantizer):
    """A quantizer whose described buffers break the storage's order."""

    def describe_buffers(self, shape):
        d = Quantizer.describe_buffers(self, shape)
        return dict(reversed(list(d.items())))


class _Unknown(te.MXFP8Quantizer):
    def describe_buffers(self, shape):
        d = Quantizer.describe_buffers(self, shape)
        d["extra"] = d["rowwise_data"]
        return d


@pytest.mark.parametrize("cls", [_Disordered, _Unknown])
def test_quantizer_disagreeing_with_declaration_raises(cls):
    p = te.TensorProto((64, 64), torch.float32, cls())
    with pytest.raises(ValueError, match="declared flatten order"):
        p.inner_names()


def test_non_quantizer_is_rejected():
    with pytest.raises(TypeError, match="must be a Quantizer"):
        te.TensorProto((4,), torch.float32, quantizer="fp8")


def test_to_tensor_proto_plain_storage_and_wrapper(any_name, usage):
    x = torch.randn(SHAPE, dtype=torch.bfloat16, requires_grad=True)
    p = te.to_tensor_proto(x)
    assert (p.shape, p.dtype, p.requires_grad, p.quantizer) == (SHAPE, torch.bfloat16, True, None)
    q, real = _real(any_name, usage)
    p = te.to_tensor_proto(real)
    assert p.is_quantized and p.quantizer is not real._quantizer
    assert _layout(p.create_tensor()) == _layout(real)
    real.update_usage(rowwise_usage=False) if usage == (True, True) else None
    assert _layout(te.to_tensor_proto(real).create_tensor()) == _layout(real)
    q.internal = True
    storage = q.quantize(torch.randn(SHAPE))
    assert type(te.to_tensor_proto(storage).create_tensor()) is type(storage)
    with pytest.raises(TypeError, match="expected a tensor"):
        te.to_tensor_proto([1, 2])
