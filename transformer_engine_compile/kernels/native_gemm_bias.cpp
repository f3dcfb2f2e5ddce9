// te_compile::linear_bias's CUDA kernel (kernels/gemm_bias.py): the op a
// lowered graph calls for an unquantized GEMM with its bias.
//
// Python defines the op with a Python impl; inductor's code calls it as a
// fallback kernel, which paid a Python kernel call per layer forward (the
// dispatcher's Python kernel holder, the GIL, the arguments converted).
// Registered here for CUDA, the dispatcher takes this kernel instead once
// the extension is loaded: the same at::linear call that F.linear makes,
// so the same bits.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace te_native {
namespace {

at::Tensor linear_bias(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias) {
  return at::linear(a, b, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(te_compile, CUDA, m) { m.impl("linear_bias", &linear_bias); }

}  // namespace te_native
