"""Storage and wrapper tensors: flatten protocol, registry, parameter ops."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.quantization import storage_registry

from conftest import ALL, STATELESS


def _same_values(a, b):
    return torch.equal(a.dequantize().view(torch.int16 if a.dtype != torch.float32 else torch.int32),
                       b.dequantize().view(torch.int16 if b.dtype != torch.float32 else torch.int32))


def test_flatten_unflatten_roundtrip(any_name, usage):
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    t = ALL[any_name](*usage).quantize(x)
    names, meta = t.__tensor_flatten__()
    assert names == ["_" + n for n in t.buffers()]
    inner = {n: getattr(t, n) for n in names}
    back = type(t).__tensor_unflatten__(inner, meta, t.shape, t.stride())
    assert type(back) is type(t) and back.shape == t.shape and back.dtype == t.dtype
    assert _same_values(back, t)
    assert back.get_usages() == {"rowwise": usage[0], "columnwise": usage[1]}


def test_registry_resolves_every_class():
    reg = storage_registry()
    for cls in (te.Float8TensorStorage, te.Float8Tensor, te.MXFP8TensorStorage, te.MXFP8Tensor,
                te.Float8BlockwiseQTensorStorage, te.Float8BlockwiseQTensor,
                te.NVFP4TensorStorage, te.NVFP4Tensor):
        assert reg[f"{cls.__module__}.{cls.__qualname__}"] is cls


def test_internal_quantizer_returns_storage_not_tensor(stateless_name):
    q = STATELESS[stateless_name](True, True)
    q.internal = True
    s = q.quantize(torch.randn(128, 256))
    assert isinstance(s, te.QuantizedTensorStorage) and not isinstance(s, torch.Tensor)
    assert s.shape == (128, 256) and s.dtype == torch.float32 and s.size(1) == 256
    q.internal = False
    w = q.quantize(torch.randn(128, 256))
    assert isinstance(w, te.QuantizedTensor)
    names, meta = s.__tensor_flatten__()
    back = te.QuantizedTensorStorage.__tensor_unflatten__(
        {n: getattr(s, n) for n in names}, meta, s.shape, None)
    assert type(back) is type(s) and torch.equal(back.dequantize(), s.dequantize())


def test_stateful_quantizer_stays_out_of_flatten_ctx():
    t = ALL["fp8_delayed"](True, True).quantize(torch.randn(8, 16))
    _, meta = t.__tensor_flatten__()
    assert meta.quantizer is None
    assert t._quantizer is not None  # kept for eager copy_


def test_update_usage_drops_copies_and_refuses_to_invent_them():
    t = te.MXFP8Quantizer().quantize(torch.randn(64, 64))
    t.update_usage(rowwise_usage=False)
    assert t.get_usages() == {"rowwise": False, "columnwise": True}
    assert t._rowwise_data is None and t._columnwise_data is not None
    with pytest.raises(RuntimeError, match="no rowwise copy"):
        t.update_usage(rowwise_usage=True)
    with pytest.raises(ValueError, match="drop every copy"):
        t.update_usage(columnwise_usage=False)


def test_parameter_detach_clone_and_deepcopy(stateless_name):
    t = STATELESS[stateless_name](True, True).quantize(torch.randn(128, 256))
    p = torch.nn.Parameter(t)
    assert type(p) is type(t) and p.requires_grad
    d = p.detach()
    assert type(d) is type(t) and not d.requires_grad
    assert all(a is b for a, b in zip(d.buffers().values(), t.buffers().values()))
    c = t.clone()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(c.buffers().values(), t.buffers().values()))
    assert torch.equal(c.dequantize(), t.dequantize())
    dc = copy.deepcopy(t)
    assert type(dc) is type(t) and torch.equal(dc.dequantize(), t.dequantize())


def test_copy_requantizes_in_place_and_copies_between_same_format(stateless_name):
    q = STATELESS[stateless_name](True, True)
    dst = q.quantize(torch.randn(128, 256))
    ptrs = [b.data_ptr() for b in dst.buffers().values()]
    src = torch.randn(128, 256)
    dst.copy_(src)
    assert [b.data_ptr() for b in dst.buffers().values()] == ptrs  # in place
    assert torch.equal(dst.dequantize(), q.quantize(src).dequantize())
    other = q.quantize(torch.randn(128, 256))
    dst.copy_(other)
    assert torch.equal(dst.dequantize(), other.dequantize())


def test_copy_between_formats_is_an_error():
    a = te.MXFP8Quantizer().quantize(torch.randn(64, 64))
    b = te.Float8CurrentScalingQuantizer().quantize(torch.randn(64, 64))
    with pytest.raises(NotImplementedError, match="formats differ"):
        a.copy_(b)


def test_copy_into_plain_tensor_dequantizes():
    t = te.Float8CurrentScalingQuantizer().quantize(torch.randn(16, 32))
    out = torch.empty(16, 32)
    out.copy_(t)
    assert torch.equal(out, t.dequantize())


def test_device_move_and_dtype_change():
    t = te.Float8BlockQuantizer().quantize(torch.randn(128, 128))
    moved = t.to("cpu", copy=True)
    assert type(moved) is type(t) and torch.equal(moved.dequantize(), t.dequantize())
    f = t.to(torch.float32)  # logical dtype unchanged: stays quantized
    assert type(f) is type(t)
    h = t.to(torch.bfloat16)
    assert type(h) is torch.Tensor and h.dtype == torch.bfloat16
    assert torch.equal(h, t.dequantize(dtype=torch.bfloat16))


def test_view_and_reshape_keep_last_dim(stateless_name):
    t = STATELESS[stateless_name](True, True).quantize(torch.randn(128, 256))
    v = t.view(4, 32, 256)
    assert type(v) is type(t) and v.shape == (4, 32, 256)
    assert torch.equal(v.dequantize().reshape(128, 256), t.dequantize())
    r = v.reshape(-1, 256)
    assert r.shape == (128, 256) and torch.equal(r.dequantize(), t.dequantize())
    with pytest.raises(NotImplementedError, match="must keep the last dim"):
        t.view(256, 128)


def test_unsupported_ops_raise_a_clear_error():
    t = te.Float8CurrentScalingQuantizer().quantize(torch.randn(8, 8))
    with pytest.raises(NotImplementedError, match=r"does not support aten\.add.*dequantize\(\)"):
        t + 1
    with pytest.raises(NotImplementedError, match="does not support"):
        torch.matmul(t, torch.randn(8, 8))


def test_repr_names_format_and_usage():
    t = te.MXFP8Quantizer(columnwise_usage=False).quantize(torch.randn(32, 32))
    r = repr(t)
    assert "MXFP8Tensor" in r and "rowwise=True" in r and "columnwise=False" in r


def test_docs_buffer_table_is_generated_from_the_declarations():
    import pathlib
    from transformer_engine_compile.quantization.layout_doc import buffer_table
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "formats.md").read_text()
    assert buffer_table() in doc
