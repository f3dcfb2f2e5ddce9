"""The emulated NVFP4 GEMM in one kernel (kernels/triton_nvfp4_gemm.py) on
the GPU: its bf16 tensor-core products against the reference, which path
``gemm`` takes by size, and compiled te.Linear calls on both sides of the
size limit equal to eager.  Skips without CUDA."""

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R
from transformer_engine_compile.kernels import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.quantization import cuda_gemm
    from transformer_engine_compile.kernels import triton_nvfp4_gemm as tg


def _operand(rows, k, wide, gen):
    """A packed copy with every code; block scales of one binade (every sum of
    products then exact in fp32, in any order) or across many (wide)."""
    packed = torch.randint(0, 256, (rows, k // 2), device="cuda", dtype=torch.uint8,
                           generator=gen)
    if wide:
        scales = (torch.rand(rows, k // 16, device="cuda", generator=gen) * 400 + 1e-3)
        scales = scales.to(torch.float8_e4m3fn)
    else:
        scales = torch.randint(0x38, 0x40, (rows, k // 16), device="cuda", dtype=torch.uint8,
                               generator=gen).view(torch.float8_e4m3fn)  # [1, 2)
    return packed, scales, torch.rand(1, device="cuda", generator=gen) * 50


SHAPES = [(16, 32, 64), (1000, 512, 272), (256, 256, 256), (130, 48, 2048), (8, 4096, 64)]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_fused_gemm_equals_the_reference_where_sums_are_exact(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, b = _operand(m, k, False, gen), _operand(n, k, False, gen)
    for bias in (None, torch.randn(n, device="cuda", generator=gen),
                 torch.randn(n, device="cuda", generator=gen).bfloat16()):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            got = tg.nvfp4_gemm(a, b, bias, dt)
            assert got.dtype == dt and torch.equal(got, ref.nvfp4_gemm(a, b, bias, dt)), (bias, dt)


@pytest.mark.parametrize("m,n,k", SHAPES, ids=str)
def test_fused_gemm_within_fp32_accumulation_of_the_reference(m, n, k):
    """Scales across binades: the sums round, in the kernel's K order."""
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    a, b = _operand(m, k, True, gen), _operand(n, k, True, gen)
    want = ref.nvfp4_gemm(a, b, None, torch.float32).double()
    mag = ref.nvfp4_gemm((a[0] & 0x77, a[1], a[2]), (b[0] & 0x77, b[1], b[2]), None,
                         torch.float32).double()  # |A| |B|^T
    got = tg.nvfp4_gemm(a, b, None, torch.float32).double()
    assert ((got - want).abs() <= mag * k * 2.0 ** -23 + 1e-30).all()


def _kernels(fn) -> list:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return out, names


def test_gemm_takes_one_kernel_for_small_products(monkeypatch):
    """te.Linear's NVFP4 products (fprop, dgrad, wgrad of 256 x 384 x 512)
    run as one kernel each; above ``NVFP4_FUSED_MAX`` as three, and both
    paths agree to fp32 accumulation rounding."""
    from test_gpu_kernels import _operands
    from transformer_engine_compile.quantization.gemm import gemm
    xq, wq, gq = _operands(R.NVFP4BlockScaling())
    assert cuda_gemm.nvfp4_fused(256, 512, 384)
    for a, au, b, bu in ((xq, "rowwise", wq, "rowwise"), (gq, "rowwise", wq, "columnwise"),
                         (gq, "columnwise", xq, "columnwise")):
        one, names = _kernels(lambda: gemm(a, au, b, bu, torch.float32))
        assert len(names) == 1 and "nvfp4_gemm" in names[0], names
        with monkeypatch.context() as mp:
            mp.setattr(cuda_gemm, "NVFP4_FUSED_MAX", 0)
            three, names = _kernels(lambda: gemm(a, au, b, bu, torch.float32))
        assert len(names) >= 3 and not any("nvfp4_gemm" in n for n in names), names  # + cuBLAS
        assert ((one - three).abs().max() / three.abs().max()).item() < 1e-5, (au, bu)


def test_compiled_linear_equals_eager_on_both_sides_of_the_limit():
    """Dynamic token counts, compiled with inductor (the forward lowered):
    a call small enough for the one-kernel GEMM and one above the limit
    give eager's bits, output and gradients."""
    torch.manual_seed(0)
    layer = te.Linear(256, 512, bias=True, params_dtype=torch.bfloat16, device="cuda")
    rec = R.NVFP4BlockScaling()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (64, 2048):
        assert cuda_gemm.nvfp4_fused(tokens, 512, 256) == (tokens == 64)
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        results = []
        for fn in (layer, compiled):
            layer.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_(True)
            torch.cuda.manual_seed(3)
            with te.autocast(recipe=rec):
                y = fn(xx)
            y.backward(dy)
            results.append((y, xx.grad, layer.weight.grad, layer.bias.grad))
        for got, want in zip(*results):
            assert torch.equal(got, want), tokens
