"""``te_compile::linear_bias`` (kernels/gemm_bias.py): the unquantized GEMM
with its bias that lowered traces keep opaque."""

import pytest
import torch

from transformer_engine_compile.kernels import gemm_bias
from transformer_engine_compile.kernels.gemm import gemm_reference
from transformer_engine_compile.kernels.tracing import fast_kernels_traced

OP = torch.ops.te_compile.linear_bias.default


def _operands(dtype, rows=(8,)):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*rows, 48, generator=g).to(dtype)
    b = torch.randn(40, 48, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    return a, b, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [(8,), (2, 5)])
def test_op_is_f_linear(dtype, rows):
    a, b, bias = _operands(dtype, rows)
    assert torch.equal(OP(a, b, bias), torch.nn.functional.linear(a, b, bias))
    torch.library.opcheck(OP, (a, b, bias))


def test_fake_refuses_what_f_linear_refuses():
    a, b, bias = _operands(torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fa, fb, fbias = (mode.from_tensor(t) for t in (a, b, bias))
        out = OP(fa, fb, fbias)
        assert (out.shape, out.dtype, out.stride()) == ((8, 40), torch.bfloat16, (40, 1))
        with pytest.raises(RuntimeError, match="shapes do not match"):
            OP(fa, fb, fbias[:-1])
        with pytest.raises(RuntimeError, match="dtypes differ"):
            OP(fa, fb, fbias.float())


def test_gemm_reference_records_the_op_only_in_a_lowered_trace():
    """Only ``fast_kernels_traced`` (a lowered trace) routes the bias GEMM
    through the op; elsewhere ``F.linear`` runs directly."""
    a, b, bias = _operands(torch.bfloat16)
    seen = []

    def record(*args):
        seen.append(args)
        return torch.nn.functional.linear(*args)

    real = gemm_bias.OP
    gemm_bias.OP = record
    try:
        eager = gemm_reference(a, "rowwise", b, "rowwise", torch.bfloat16, bias)
        assert seen == []
        with fast_kernels_traced():
            traced = gemm_reference(a, "rowwise", b, "rowwise", torch.bfloat16, bias)
            gemm_reference(a, "rowwise", b, "rowwise", torch.bfloat16)  # no bias: no op
    finally:
        gemm_bias.OP = real
    assert len(seen) == 1 and torch.equal(eager, traced)


def test_python_impl_alone_registers_no_cuda_kernel():
    """The check below tells the native kernel from the Python impl: the
    latter (CompositeExplicitAutograd) registers no CUDA kernel of its own."""
    from transformer_engine_compile.kernels import native
    if native._state["ext"] is not None:
        pytest.skip("the native extension is loaded in this process")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("te_compile::linear_bias", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("te_compile::linear_bias",
                                                          "CompositeExplicitAutograd")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_is_the_native_one_and_f_linear():
    """With the native extension loaded, the dispatcher runs the op's C++
    CUDA kernel (native_gemm_bias.cpp) instead of the Python impl, with
    F.linear's bits."""
    from transformer_engine_compile.kernels import native
    if native.extension(wait=True) is None:
        pytest.skip(f"native extension not built: {native._state['failed']}")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("te_compile::linear_bias", "CUDA")
    for rows in ((8,), (3, 100)):
        a, b, bias = (t.cuda() for t in _operands(torch.bfloat16, rows))
        assert torch.equal(OP(a, b, bias), torch.nn.functional.linear(a, b, bias))
        torch.library.opcheck(OP, (a, b, bias))
