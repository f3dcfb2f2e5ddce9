"""GPU checks (skip without CUDA; run by qa/L0_gpu/test.sh on a GPU machine):
the kernel dispatch on CUDA computes exactly what the CPU reference does,
and compiled quantization on CUDA equals eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

from conftest import STATELESS, USAGES, USAGE_IDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bits(t):
    return {k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in t.buffers().items()}


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
def test_cuda_quantize_equals_cpu_reference(stateless_name, usage):
    q = STATELESS[stateless_name](*usage)
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    x[torch.rand(x.shape) < 0.002] *= 300
    cpu = _bits(q.quantize(x))
    gpu = {k: v.cpu() for k, v in _bits(q.quantize(x.cuda())).items()}
    assert list(cpu) == list(gpu)
    for name in cpu:
        if "rht" in stateless_name and name.startswith("columnwise"):
            continue  # the RHT is a matmul: summation order differs by device
        assert torch.equal(cpu[name], gpu[name]), name
    if "rht" in stateless_name and usage[1]:
        d_cpu = q.quantize(x).dequantize(dtype=torch.float32)
        d_gpu = q.quantize(x.cuda()).dequantize(dtype=torch.float32).cpu()
        assert (d_cpu - d_gpu).norm() / d_cpu.norm() < 2e-2


@pytest.mark.parametrize("name", sorted(STATELESS))
def test_cuda_inductor_quantize_matches_eager(name):
    """Inductor on CUDA lowers fp32 division to Triton's approximate divide,
    so a scale may differ from eager by an ulp and a value sitting on an FP8
    rounding boundary may round the other way.  The ops of te.Linear run the
    eager kernels inside opaque custom ops, where this does not arise."""
    torch._dynamo.reset()
    counters.clear()
    q = STATELESS[name](True, True)
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")

    def f(x, q):
        return q.quantize(x)

    got, want = torch.compile(f, fullgraph=True)(x, q), f(x, q)
    assert type(got) is type(want) and list(got.buffers()) == list(want.buffers())
    for k, g in got.buffers().items():
        w = want.buffers()[k]
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride(), k
        if g.element_size() == 1:  # FP8 / packed FP4 codes, E8M0 / E4M3 scales
            assert (g.view(torch.uint8) != w.view(torch.uint8)).float().mean() < 1e-3, k
        else:  # fp32 scales and amaxes: within a couple of ulps
            torch.testing.assert_close(g, w, rtol=3e-7, atol=0)
    d_got, d_want = got.dequantize(dtype=torch.float32), want.dequantize(dtype=torch.float32)
    assert (d_got - d_want).norm() / d_want.norm() < 1e-3
    assert not counters["graph_break"]


def test_cuda_wrapper_tensor_device_moves():
    t = te.Float8BlockQuantizer().quantize(torch.randn(128, 256))
    g = t.to("cuda")
    assert type(g) is type(t) and g.device.type == "cuda"
    assert all(b.is_cuda for b in g.buffers().values())
    assert torch.equal(g.dequantize().cpu(), t.dequantize())
