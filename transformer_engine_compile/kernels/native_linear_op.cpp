// The linear ops' real impls as one C++ call each, for the
// configurations a native plan covers (module/linear/native_ops.py says
// which): te_compile::linear_fwd's and linear_bwd's flat outputs, in the
// order and shapes their fakes lay them out (dynamo/flat_result.py), from
// the kernels the eager path's plan runs, so the ops give the Python
// impls' bits.  An op may not write its inputs: delayed scaling's step
// writes new buffers, which the ops return as the Python impls do.
#include "native_linear.h"

#include <c10/cuda/CUDAGuard.h>

namespace te_native {
namespace {

// The outputs as an op returns them: each in the shape its fake gives it
// (`shapes`, where given: a copy's scales stored flat, say) and none a view
// (a view returned by an op is refused in-place ops by autograd).
std::vector<at::Tensor> as_outputs(std::vector<at::Tensor> out,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  TORCH_CHECK(shapes.empty() || shapes.size() == out.size(), "te native: the op plan lays out ",
              shapes.size(), " outputs, the call made ", out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    at::Tensor& t = out[i];
    if (!shapes.empty() && t.sizes() != at::IntArrayRef(shapes[i])) t = t.view(shapes[i]);
    if (t.is_view()) t = t.detach();
  }
  return out;
}

// Delayed scaling's state as an op takes it: the history and the scales,
// fp32 on the plan's device, as the launches were fixed for.
bool state_fits(const Plan& p, const std::vector<at::Tensor>& state) {
  if (p.recipe != kDelayed) return state.empty();
  if (state.size() != 2) return false;
  for (const at::Tensor& t : state) {
    if (!plain_on(t, p.device, at::kFloat) || !aligned(t)) return false;
  }
  return true;
}

void append_copy(std::vector<at::Tensor>& out, const Plan& p, const at::Tensor& data,
                 const at::Tensor& scales, const at::Tensor& amax) {
  out.push_back(data);
  out.push_back(scales);
  if (p.recipe == kNvfp4) out.push_back(amax);
}

// linear_fwd's outputs: y, under delayed scaling the new forward history and
// scales, then x's saved columnwise copy (where W takes a gradient) and W's
// (where x does), each its buffers; empty where the plan does not fit the
// call (the caller takes the Python impl).  `state`: the forward history and
// scales under delayed scaling, else none.
std::vector<at::Tensor> op_forward(const std::shared_ptr<Plan>& plan, const at::Tensor& x,
                                   const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                   int64_t lo, int64_t hi, const std::vector<at::Tensor>& state) {
  const Plan& p = *plan;
  if (!plain_on(x, p.device, p.act_dtype) || !w.is_cuda() || w.get_device() != p.device ||
      p.cache != kNoCache || p.given_x || bias.has_value() != p.bias || !state_fits(p, state) ||
      (p.bias && !bias_fits(p, *bias))) {
    return {};
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor new_h, new_s;
  if (p.recipe == kDelayed) {
    new_h = at::empty_like(state[0]);
    new_s = at::empty_like(state[1]);
  }
  Forward f = forward_of(p, x, w, bias, lo, hi, state, nullptr, new_h, new_s);
  std::vector<at::Tensor> out{f.y};
  if (p.recipe == kDelayed) {
    out.push_back(new_h);
    out.push_back(new_s);
  }
  if (p.x_col) append_copy(out, p, f.x_t, f.x_sinv, f.x_amax);
  if (p.w_col) append_copy(out, p, f.w_t, f.w_sinv, f.w_amax);
  return as_outputs(std::move(out), p.op_fwd_shapes);
}

// linear_bwd's outputs: dx, dW, the bias gradient (each where the plan takes
// it), under delayed scaling the new backward history and scales, then dW
// as main_grad's update under fuse_wgrad_accumulation; empty where the plan
// does not fit the call.  `saved`: x's columnwise copy (data, scales, NVFP4's
// amax), then W's, None where absent (kPlain: x, None, None, W, None, None);
// `state`: the backward history and scales under delayed scaling.
std::vector<at::Tensor> op_backward(const std::shared_ptr<Plan>& plan, const at::Tensor& dy,
                                    const std::vector<c10::optional<at::Tensor>>& saved,
                                    int64_t lo, int64_t hi,
                                    const std::vector<at::Tensor>& state) {
  const Plan& p = *plan;
  if (!plain_on(dy, p.device, p.act_dtype) || !(p.dgrad || p.wgrad) || saved.size() != 6 ||
      !state_fits(p, state)) {
    return {};
  }
  Saved s;
  at::Tensor* slots[6] = {&s.x_t, &s.x_sinv, &s.x_amax, &s.w_t, &s.w_sinv, &s.w_amax};
  bool plain = p.recipe == kPlain;  // x and W themselves, read by cuBLAS alone
  for (size_t i = 0; i < 6; ++i) {
    bool needed = (i < 3 ? p.wgrad : p.dgrad) &&
                  (plain ? i % 3 == 0 : i % 3 < 2 || p.recipe == kNvfp4);
    if (!needed) continue;
    const auto& t = saved[i];
    if (!t.has_value() || !t->is_cuda() || t->get_device() != p.device ||
        (plain ? !plain_on(*t, p.device, p.act_dtype) : !aligned(*t))) {
      return {};
    }
    *slots[i] = *t;
  }
  c10::cuda::CUDAGuard guard(dy.device());
  DelayedState d;
  if (p.recipe == kDelayed) {
    d = {state[0], state[1], at::empty_like(state[0]), at::empty_like(state[1])};
  }
  Grads g = grads_of(p, dy, s, true, true, true, d, lo, hi);
  std::vector<at::Tensor> out;
  if (p.dgrad) out.push_back(g.dx);
  if (p.wgrad && !p.main_grad) out.push_back(g.dw);
  if (p.bias_grad) out.push_back(g.db);
  if (p.recipe == kDelayed) {
    out.push_back(d.new_history);
    out.push_back(d.new_scale);
  }
  if (p.wgrad && p.main_grad) out.push_back(g.dw);
  return as_outputs(std::move(out), p.op_bwd_shapes);
}

}  // namespace

void register_linear_op(py::module& m) {
  m.def("linear_op_forward", &op_forward);
  m.def("linear_op_backward", &op_backward);
}

}  // namespace te_native
