// Eager te.Linear under FP8 current scaling (per tensor), delayed scaling
// (per tensor, the layer's amax history and scales updated in place), FP8
// blockwise scaling (1x128 activations and gradients, 128x128 weights) or
// MXFP8 (emulated: dequantized to bf16 for bf16 GEMMs) as one C++ call and a
// C++ autograd node (kernels/native.py builds the plans and says when).
//
// The Python eager path runs ~150 us of Python per layer forward + backward
// around ~10 CUDA calls, and the autograd engine runs the backward's Python
// on its device thread, markedly slower on the lent H200 hosts
// (docs/benchmarks.md).  Here the same kernels run in the same order with
// the same arguments: the Triton kernels the Python path compiled (launched
// through the driver with the arguments a plan fixed) and torch's
// _scaled_mm (current scaling) or _scaled_mm_v2 with block scales (as
// F.scaled_mm calls it), so the results are bit for bit the Python path's.
#include "native_linear.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace te_native {

// -- the block-scaled GEMM (F.scaled_mm's op), looked up at run time ------------
// (looked up rather than called through the generated API, so a torch
// without it, or with another schema, still builds the rest of this file)
using ScaledMmV2Out = at::Tensor&(const at::Tensor&, const at::Tensor&, at::TensorList,
                                  at::IntArrayRef, at::IntArrayRef, at::TensorList,
                                  at::IntArrayRef, at::IntArrayRef,
                                  const std::optional<at::Tensor>&,
                                  std::optional<at::ScalarType>, at::IntArrayRef, bool,
                                  at::Tensor&);

const c10::TypedOperatorHandle<ScaledMmV2Out>& scaled_mm_v2_out() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("aten::_scaled_mm_v2", "out")
                       .typed<ScaledMmV2Out>();
  return op;
}

// Whether this torch has the block-scaled GEMM with the schema above.
bool has_block_gemm() {
  try {
    scaled_mm_v2_out();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// -- the bf16 GEMM with an fp32 product (NVFP4's emulation), looked up too -------

const c10::TypedOperatorHandle<MmDtype>& mm_dtype() {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::mm", "dtype").typed<MmDtype>();
  return op;
}

// Whether this torch has aten::mm.dtype with the schema above.
bool has_mm_dtype() {
  try {
    mm_dtype();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}


// out = A @ B^T with 1x128 scales for A (`a_s`, (rows, blocks) with stride
// (1, rows)) and 1x128 or 128x128 scales for B (the latter stored padded),
// as cuda_gemm._fp8_blockwise.
void block_gemm(const Plan& p, const at::Tensor& a, const at::Tensor& a_s, const at::Tensor& b,
                const at::Tensor& b_s, bool b_2d, at::Tensor& out) {
  std::array<at::Tensor, 1> sa{a_s};
  std::array<at::Tensor, 1> sb{b_2d ? b_s.t() : b_s};
  std::array<int64_t, 1> ra{p.scaling_1x128};
  std::array<int64_t, 1> rb{b_2d ? p.scaling_128x128 : p.scaling_1x128};
  scaled_mm_v2_out().call(a, b.t(), sa, ra, {}, sb, rb, {}, std::nullopt, out.scalar_type(),
                          {}, false, out);
}

// The bf16 emulated GEMM's result in `out` (cuda_gemm._emulated_bf16:
// F.linear of the dequantized operands, then the output's dtype).
void mx_gemm(const at::Tensor& a16, const at::Tensor& b16t, at::Tensor& out) {
  if (out.scalar_type() == at::kBFloat16) {
    at::mm_out(out, a16, b16t);
  } else {
    out.copy_(at::mm(a16, b16t));
  }
}

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// `state`: the weight cache's rowwise data and scales, columnwise data and
// scales where the plan has one (then main_grad where it has one).
Forward forward_block(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, const std::vector<at::Tensor>& state,
                      const std::vector<at::Tensor>* shared) {
  constexpr int64_t B = 128;
  at::NoGradGuard no_grad;
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor x2d, x_rd, x_rs, x_cd, x_cs;
  if (shared) {  // x's copies made by an earlier call (shared_x_for)
    x2d = x_rd = (*shared)[0];
    x_rs = (*shared)[1];
    x_cd = p.x_col ? (*shared)[2] : x2d;
    x_cs = p.x_col ? (*shared)[3] : x2d;
  } else {
    x2d = operand(x, p.m, p.k);
    x_rd = fp8_empty(p.m, p.k, p.fp8_fwd, x);
    x_rs = at::empty({p.k / B, p.m}, f32);
    x_cd = p.x_col ? fp8_empty(p.k, p.m, p.fp8_fwd, x) : x2d;
    x_cs = p.x_col ? at::empty({p.m / B * p.k}, f32) : x2d;
  }
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  at::Tensor w_rd, w_rs, w_cd, w_cs;
  if (p.cache == kReadCache) {  // x's launch alone
    p.fwd.run({x2d, x_rd, x_rs, x_cd, x_cs}, 0, 0, stream);
    w_rd = state[0];
    w_rs = state[1];
    w_cd = state[2];
    w_cs = state[3];
  } else {  // x's and W's in one launch
    at::Tensor w2d = operand(w, p.n, p.k);
    w_rd = fp8_empty(p.n, p.k, p.fp8_fwd, x);
    w_rs = at::empty({p.n / B, padded_blocks(p.k / B)}, f32);
    w_cd = p.w_col ? fp8_empty(p.k, p.n, p.fp8_fwd, x) : w2d;
    w_cs = p.w_col ? at::empty({p.k / B, padded_blocks(p.n / B)}, f32) : w2d;
    if (shared) {  // W's launch alone
      p.fwd_w.run({w2d, w_rd, w_rs, w_cd, w_cs}, 0, 0, stream);
    } else {
      p.fwd.run({x2d, x_rd, x_rs, x_cd, x_cs, w2d, w_rd, w_rs, w_cd, w_cs}, 0, 0, stream);
    }
  }
  at::Tensor y = at::empty(p.out_shape, x.options());
  at::Tensor y2d = y.view({p.m, p.n});
  block_gemm(p, x_rd, x_rs.t(), w_rd, w_rs, true, y2d);
  if (p.bias) p.bias_add.run({y2d, *bias}, 0, 0, stream);
  if (p.cache == kWriteCache) {
    state[0].copy_(w_rd);
    state[1].copy_(w_rs);
    state[2].copy_(w_cd);
    state[3].copy_(w_cs);
  }
  bool w_col = p.w_col || p.cache == kReadCache;
  Forward f{y, p.x_col ? x_cd : at::Tensor(), p.x_col ? x_cs : at::Tensor(),
            w_col ? w_cd : at::Tensor(), w_col ? w_cs : at::Tensor()};
  if (p.share) f.x_copies = {x_rd, x_rs, f.x_t, f.x_sinv};
  return f;
}

// The forward's casts of x and W (current scaling: one launch; delayed: the
// plan's list over the layer's state).
void forward_casts(const Plan& p, const at::Tensor& x2d, const at::Tensor& w2d,
                   const at::Tensor& x_data, const at::Tensor& x_t, const at::Tensor& x_sinv,
                   const at::Tensor& w_data, const at::Tensor& w_t, const at::Tensor& w_sinv,
                   int64_t lo, int64_t hi, const std::vector<at::Tensor>& state,
                   const GivenX* given, const at::Tensor& new_h, const at::Tensor& new_s,
                   cudaStream_t stream) {
  if (p.recipe == kDelayed) {
    const at::Tensor& scale = state[1];
    at::Tensor amaxes = given          ? given->amaxes
                        : p.amax_len > 0 ? at::zeros({p.amax_len}, x2d.options().dtype(at::kFloat))
                                         : x2d;
    std::vector<at::Tensor> slots{x2d,    w2d,    amaxes,
                                  scale.select(0, 0), scale.select(0, 1),
                                  x_data, x_t,    x_sinv, w_data, w_t, w_sinv, state[0], scale,
                                  new_h.defined() ? new_h : state[0],
                                  new_s.defined() ? new_s : scale};
    for (const Launch& l : p.fwd_list) l.run(slots, lo, hi, stream);
  } else {
    p.fwd.run({x2d, w2d, x_data, x_t, x_sinv, w_data, w_t, w_sinv}, lo, hi, stream);
  }
}

// Current or delayed scaling (`state`: the forward and backward histories
// and scales under delayed scaling, then the weight cache's data, transpose
// and scale_inv with one; `given`: x's copies where its norm made them, x
// then only stands for the norm's output and is not read; `new_h`, `new_s`:
// where the step writes, see forward_of).
Forward forward_current(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias, int64_t lo, int64_t hi,
                        const std::vector<at::Tensor>& state, const GivenX* given,
                        const at::Tensor& new_h, const at::Tensor& new_s) {
  at::NoGradGuard no_grad;
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor x2d, x_sinv, x_data, x_t;
  if (given) {  // the launches never read x's slot then: its data stands in
    x2d = x_data = given->data;
    x_sinv = given->sinv;
    x_t = p.x_col ? given->t : x2d;
  } else {
    x2d = operand(x, p.m, p.k);
    x_sinv = at::empty({1}, f32);
    x_data = fp8_empty(p.m, p.k, p.fp8_fwd, x);
    x_t = p.x_col ? fp8_empty(p.k, p.m, p.fp8_fwd, x) : x2d;
  }
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  size_t c = p.recipe == kDelayed ? 4 : 0;  // the cache's first buffer in `state`
  at::Tensor w_sinv, w_data, w_t;
  if (p.cache == kReadCache) {
    w_data = state[c];
    w_t = state[c + 1];
    w_sinv = state[c + 2];
    if (p.recipe == kDelayed) {  // x's cast, W's amax, the step
      forward_casts(p, x2d, operand(w, p.n, p.k), x_data, x_t, x_sinv, w_data, w_t, w_sinv, lo,
                    hi, state, given, new_h, new_s, stream);
    } else {
      p.fwd.run({x2d, x_data, x_t, x_sinv}, lo, hi, stream);
    }
  } else {
    at::Tensor w2d = operand(w, p.n, p.k);
    w_sinv = at::empty({1}, f32);
    w_data = fp8_empty(p.n, p.k, p.fp8_fwd, x);
    w_t = p.w_col ? fp8_empty(p.k, p.n, p.fp8_fwd, x) : w2d;
    if (given && p.recipe == kCurrent) {  // x's copies shared: W's launch alone
      p.fwd_w.run({w2d, w_data, w_t, w_sinv}, lo, hi, stream);
    } else {
      forward_casts(p, x2d, w2d, x_data, x_t, x_sinv, w_data, w_t, w_sinv, lo, hi, state, given,
                    new_h, new_s, stream);
    }
  }
  at::Tensor y = at::empty(p.out_shape, x.options());
  at::Tensor y2d = y.view({p.m, p.n});
  at::_scaled_mm_out(y2d, x_data, w_data.t(), x_sinv, w_sinv, bias, c10::nullopt,
                     x.scalar_type(), /*use_fast_accum=*/true);
  if (p.cache == kWriteCache) {
    state[c].copy_(w_data);
    state[c + 1].copy_(w_t);
    state[c + 2].copy_(w_sinv);
  }
  bool w_col = p.w_col || p.cache == kReadCache;
  Forward f{y, p.x_col ? x_t : at::Tensor(), x_sinv, w_col ? w_t : at::Tensor(), w_sinv};
  if (p.share) f.x_copies = {x_data, f.x_t, x_sinv};
  return f;
}

Forward forward_mx(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias) {
  constexpr int64_t B = 32;
  at::NoGradGuard no_grad;
  at::Tensor x2d = operand(x, p.m, p.k), w2d = operand(w, p.n, p.k);
  at::Tensor x_rd = fp8_empty(p.m, p.k, p.fp8_fwd, x), x_rs = u8_empty(p.m, p.k / B, x);
  at::Tensor x_cd = p.x_col ? fp8_empty(p.m, p.k, p.fp8_fwd, x) : x2d;
  at::Tensor x_cs = p.x_col ? u8_empty(p.m / B, p.k, x) : x2d;
  at::Tensor w_rd = fp8_empty(p.n, p.k, p.fp8_fwd, x), w_rs = u8_empty(p.n, p.k / B, x);
  at::Tensor w_cd = p.w_col ? fp8_empty(p.n, p.k, p.fp8_fwd, x) : w2d;
  at::Tensor w_cs = p.w_col ? u8_empty(p.n / B, p.k, x) : w2d;
  auto bf16 = x.options().dtype(at::kBFloat16);
  at::Tensor x16 = at::empty({p.m, p.k}, bf16), w16 = at::empty({p.n, p.k}, bf16);
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  std::vector<at::Tensor> slots{x2d, w2d, x_rd, x_rs, x_cd, x_cs, w_rd, w_rs, w_cd, w_cs, x16, w16};
  for (const Launch& l : p.fwd_list) l.run(slots, 0, 0, stream);
  at::Tensor y = at::empty(p.out_shape, x.options());
  at::Tensor y2d = y.view({p.m, p.n});
  mx_gemm(x16, w16.t(), y2d);
  if (p.bias) p.bias_add.run({y2d, *bias}, 0, 0, stream);
  return {y, p.x_col ? x_cd : at::Tensor(), p.x_col ? x_cs : at::Tensor(),
          p.w_col ? w_cd : at::Tensor(), p.w_col ? w_cs : at::Tensor()};
}

Forward forward_nvfp4(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias) {
  at::NoGradGuard no_grad;
  at::Tensor x2d = operand(x, p.m, p.k), w2d = operand(w, p.n, p.k);
  at::Tensor xp = at::empty({p.parts_x}, x.options().dtype(at::kInt));
  at::Tensor wp = at::empty({p.parts_w}, x.options().dtype(at::kInt));
  auto xc = nvfp4_copies(p.m, p.k, true, p.x_col, xp);
  auto wc = nvfp4_copies(p.n, p.k, true, p.w_col, wp);
  auto bf16 = x.options().dtype(at::kBFloat16);
  at::Tensor x16 = p.nvfp4_fused ? x2d : at::empty({p.m, p.k}, bf16);
  at::Tensor w16 = p.nvfp4_fused ? x2d : at::empty({p.n, p.k}, bf16);
  std::vector<at::Tensor> slots{x2d,   w2d,   xp,    xc[0], xc[1], xc[2], xc[3],
                                xc[4], xc[5], wp,    wc[0], wc[1], wc[2], wc[3],
                                wc[4], wc[5], x16,   w16};
  auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  for (const Launch& l : p.fwd_list) l.run(slots, 0, 0, stream);
  at::Tensor acc = p.nvfp4_fused ? x2d : mm_dtype().call(x16, w16.t(), at::kFloat);
  at::Tensor y = at::empty(p.out_shape, x.options());
  slots.push_back(acc);
  slots.push_back(y.view({p.m, p.n}));
  slots.push_back(p.bias ? *bias : acc);
  p.epilogue.run(slots, 0, 0, stream);
  Forward f{y};
  if (p.x_col) {
    f.x_t = xc[3];
    f.x_sinv = xc[4];
    f.x_amax = xc[5];
  }
  if (p.w_col) {
    f.w_t = wc[3];
    f.w_sinv = wc[4];
    f.w_amax = wc[5];
  }
  return f;
}

// No recipe: F.linear on the operands module/linear/plain.py passes
// it (x as (M, K), W as it is), so the same cuBLAS call gives the same
// bits; the backward reads x and W themselves.
Forward forward_plain(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias) {
  at::NoGradGuard no_grad;
  at::Tensor y = at::linear(x.reshape({p.m, p.k}), w, bias).view(p.out_shape);
  Forward f{y};
  if (p.wgrad) f.x_t = x;
  if (p.dgrad) f.w_t = w;
  return f;
}

}  // namespace

Forward forward_of(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias, int64_t lo, int64_t hi,
                   const std::vector<at::Tensor>& state, const GivenX* given,
                   const at::Tensor& new_history, const at::Tensor& new_scale) {
  return p.recipe == kPlain   ? forward_plain(p, x, w, bias)
         : p.recipe == kBlock ? forward_block(p, x, w, bias, state, nullptr)
         : p.recipe == kMx    ? forward_mx(p, x, w, bias)
         : p.recipe == kNvfp4 ? forward_nvfp4(p, x, w, bias)
                              : forward_current(p, x, w, bias, lo, hi, state, given, new_history,
                                                new_scale);
}

namespace {

// -- the autograd node ---------------------------------------------------------
struct LinearFp8Backward : public Node {
  std::shared_ptr<const Plan> plan;
  SavedVariable x_t_, x_sinv_, w_t_, w_sinv_;
  SavedVariable x_amax_, w_amax_;  // NVFP4
  at::Tensor history_bwd, scale_bwd;  // delayed scaling: the layer's buffers (updated)
  at::Tensor main_grad;  // fuse_wgrad_accumulation: receives W's gradient (add_)
  int64_t lo = 0, hi = 0;
  // next edges: x, W, then the bias, each where it needs a gradient
  bool x_grad = false, w_grad = false, b_grad = false;

  std::string name() const override {
    return plan->recipe == kPlain ? "TeLinearBackward" : "TeLinearFp8Backward";
  }

  // The gradients by the Python path's backward from the same saved copies.
  void python_path(const at::Tensor& dy, variable_list& out) {
    auto arg = [](const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
    at::Tensor x_t, x_sinv, w_t, w_sinv, x_amax, w_amax;
    bool nvfp4 = plan->recipe == kNvfp4;
    if (w_grad) {
      x_t = x_t_.unpack();
      x_sinv = x_sinv_.unpack();
      if (nvfp4) x_amax = x_amax_.unpack();
    }
    if (x_grad) {
      w_t = w_t_.unpack();
      w_sinv = w_sinv_.unpack();
      if (nvfp4) w_amax = w_amax_.unpack();
    }
    py::gil_scoped_acquire gil;
    py::tuple res = py::handle(plan->python_backward.fn)(arg(dy), arg(x_t), arg(x_sinv),
                                                          arg(w_t), arg(w_sinv), arg(x_amax),
                                                          arg(w_amax));
    size_t i = 0;
    for (int k = 0; k < 3; ++k) {
      if ((k == 0 && !x_grad) || (k == 1 && !w_grad) || (k == 2 && !b_grad)) continue;
      if (!res[k].is_none() && should_compute_output(i)) out[i] = res[k].cast<at::Tensor>();
      ++i;
    }
  }

  void release_variables() override {
    x_t_.reset_data();
    x_sinv_.reset_data();
    w_t_.reset_data();
    w_sinv_.reset_data();
    x_amax_.reset_data();
    w_amax_.reset_data();
    history_bwd.reset();
    scale_bwd.reset();
    main_grad.reset();
  }

  variable_list apply(variable_list&& grads) override {
    const Plan& p = *plan;
    variable_list out(num_outputs());
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    if (!plain_on(dy, p.device, p.act_dtype)) {
      python_path(dy, out);
      return once_differentiable(grads, std::move(out), "te.Linear");
    }
    // output positions: x, W, then the bias, each where it takes a gradient
    size_t ix = 0, iw = x_grad ? 1 : 0, ib = iw + (w_grad ? 1 : 0);
    bool want_dx = x_grad && should_compute_output(ix);
    bool want_dw = w_grad && (should_compute_output(iw) || main_grad.defined());
    bool want_db = b_grad && should_compute_output(ib);
    Saved s;
    if (want_dx) {
      s.w_t = w_t_.unpack();
      s.w_sinv = w_sinv_.unpack();
      if (p.recipe == kNvfp4) s.w_amax = w_amax_.unpack();
    }
    if (want_dw) {
      s.x_t = x_t_.unpack();
      s.x_sinv = x_sinv_.unpack();
      if (p.recipe == kNvfp4) s.x_amax = x_amax_.unpack();
    }
    // delayed scaling: the step updates the layer's buffers in place
    DelayedState d{history_bwd, scale_bwd, history_bwd, scale_bwd};
    Grads g = grads_of(p, dy, s, want_dx, want_dw, want_db, d, lo, hi);
    if (want_dx) out[ix] = g.dx;
    if (want_dw) {  // under fuse_wgrad_accumulation added into main_grad, none for W
      if (main_grad.defined()) {
        main_grad.add_(g.dw);
      } else {
        out[iw] = g.dw;
      }
    }
    if (want_db) out[ib] = g.db;
    return once_differentiable(grads, std::move(out), "te.Linear");
  }
};

// Whether `t` is the plan's weight cache buffer `j`: W's FP8 data (N, K),
// transpose (K, N) and its one fp32 scale_inv; blockwise, the rowwise data
// (N, K) and its fp32 128x128 scales, the columnwise data (K, N) and scales.
bool cache_buffer_fits(const Plan& p, const at::Tensor& t, size_t j) {
  constexpr int64_t B = 128;
  if (p.recipe == kBlock) {
    bool fp8 = j % 2 == 0;
    int64_t rows = j < 2 ? p.n : p.k, cols = j < 2 ? p.k : p.n;
    if (!fp8) {
      rows /= B;
      cols = padded_blocks(cols / B);
    }
    return t.scalar_type() == (fp8 ? p.fp8_fwd : at::kFloat) && t.dim() == 2 &&
           t.size(0) == rows && t.size(1) == cols;
  }
  if (j == 2) return t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == 1;
  return t.scalar_type() == p.fp8_fwd && t.dim() == 2 && t.size(0) == (j == 0 ? p.n : p.k) &&
         t.size(1) == (j == 0 ? p.k : p.n);
}

// -1 where the plan does not fit this call (operands on another device
// than the plan's, a layer moved since, other gradients, state buffers not
// the planned ones: the caller then takes the Python path), else whether
// it records for autograd (grad mode on and x, W or the bias needing a
// gradient); `x_req`: whether x needs one.
int fits(const Plan& p, bool x_req, int64_t x_device, const at::Tensor& w,
         const c10::optional<at::Tensor>& bias, const std::vector<at::Tensor>& state) {
  size_t n_delayed = p.recipe == kDelayed ? 4u : 0u;
  size_t n_cache = p.cache == kNoCache ? 0u : p.recipe == kBlock ? 4u : 3u;
  size_t n_state = n_delayed + n_cache;
  if (x_device != p.device || w.get_device() != p.device || bias.has_value() != p.bias ||
      state.size() != n_state + (p.main_grad ? 1u : 0u)) {
    return -1;
  }
  if (p.main_grad) {  // W's gradient is added into it in place
    const at::Tensor& g = state.back();
    if (!plain_on(g, p.device, p.wgrad_dtype) ||
        g.sizes() != at::IntArrayRef{p.n, p.k}) {
      return -1;
    }
  }
  for (size_t i = 0; i < n_state; ++i) {  // the kernels were fixed for aligned buffers
    const at::Tensor& t = state[i];
    // delayed scaling: fp32 histories and scales; then the weight cache
    if (t.get_device() != p.device || !aligned(t) ||
        (i < n_delayed ? t.scalar_type() != at::kFloat : !cache_buffer_fits(p, t, i - n_delayed))) {
      return -1;
    }
  }
  bool b_req = false;
  if (p.bias) {
    if (!bias_fits(p, *bias)) return -1;
    b_req = bias->requires_grad();
  }
  bool record = at::GradMode::is_enabled() && (x_req || w.requires_grad() || b_req);
  if (record && (x_req != p.dgrad || w.requires_grad() != p.wgrad || b_req != p.bias_grad)) {
    return -1;  // planned for other gradients
  }
  return record ? 1 : 0;
}

// -- one quantization of an x that several eager calls read ---------------------
// The last x an eager call with a sharing plan quantized, and its copies, per
// thread.  The weak pointer keeps the TensorImpl's memory (not the tensor) so
// its address names that x until the entry is replaced; the version counter
// says x has not been written since.  The entry holds the copies (one x's
// FP8 bytes) until the next sharing call replaces it.
struct SharedX {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> x{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  uint32_t version = 0;
  int64_t share = 0;
  std::vector<at::Tensor> copies;
};
thread_local SharedX shared_x;

bool shares_x(const Plan& p, const at::Tensor& x, const GivenX* given) {
  return p.share != 0 && p.cache == kNoCache && !given && !x.is_inference();
}

// x's copies made by the previous sharing call when it quantized this x, as
// it is now, the same way (and with the columnwise copy where `p` needs it).
const std::vector<at::Tensor>* shared_x_for(const Plan& p, const at::Tensor& x) {
  const SharedX& s = shared_x;
  if (s.share != p.share || s.x._unsafe_get_target() != x.unsafeGetTensorImpl() ||
      s.version != x.unsafeGetTensorImpl()->version_counter().current_version() ||
      (p.x_col && !s.copies[s.copies.size() - 2].defined()))
    return nullptr;
  return &s.copies;
}

void offer_x(const Plan& p, const at::Tensor& x, std::vector<at::Tensor> copies) {
  SharedX& s = shared_x;
  s.x = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr());
  s.version = x.unsafeGetTensorImpl()->version_counter().current_version();
  s.share = p.share;
  s.copies = std::move(copies);
}

// The forward, and its node where `record`.
at::Tensor run(const std::shared_ptr<Plan>& plan, const at::Tensor& x, const at::Tensor& w,
               const c10::optional<at::Tensor>& bias, int64_t lo, int64_t hi,
               const std::vector<at::Tensor>& state, bool record, const GivenX* given) {
  const Plan& p = *plan;
  c10::cuda::CUDAGuard guard(x.device());
  bool share = shares_x(p, x, given);
  const std::vector<at::Tensor>* shared = share ? shared_x_for(p, x) : nullptr;
  Forward f;
  if (shared && p.recipe == kBlock) {
    f = forward_block(p, x, w, bias, state, shared);
  } else if (shared) {
    GivenX copies{(*shared)[0], (*shared)[1], (*shared)[2], at::Tensor()};
    f = forward_current(p, x, w, bias, lo, hi, state, &copies, at::Tensor(), at::Tensor());
  } else {
    // delayed scaling: the step updates the layer's buffers in place
    f = forward_of(p, x, w, bias, lo, hi, state, given, at::Tensor(), at::Tensor());
    if (share) offer_x(p, x, std::move(f.x_copies));
  }
  if (!record) return f.y;
  auto node = NodeMaker<LinearFp8Backward, NodeHolder>::make();
  node->plan = plan;
  node->lo = lo;
  node->hi = hi;
  node->x_grad = x.requires_grad();
  node->w_grad = w.requires_grad();
  node->b_grad = p.bias && bias->requires_grad();
  if (p.recipe == kDelayed) {
    node->history_bwd = state[2];
    node->scale_bwd = state[3];
  }
  if (p.main_grad) node->main_grad = state.back();
  torch::autograd::edge_list edges;
  if (node->x_grad) edges.push_back(torch::autograd::impl::gradient_edge(x));
  if (node->w_grad) edges.push_back(torch::autograd::impl::gradient_edge(w));
  if (node->b_grad) edges.push_back(torch::autograd::impl::gradient_edge(*bias));
  node->set_next_edges(std::move(edges));
  // saved in the order the Python path saves them, so saved-tensor hooks
  // (activation checkpointing's among them) see the same sequence: x's before
  // W's without a recipe (plain.PlainLinear), W's first otherwise
  auto save_w = [&] {
    if (!node->x_grad) return;
    node->w_t_ = SavedVariable(f.w_t, false);
    node->w_sinv_ = SavedVariable(f.w_sinv, false);
    if (f.w_amax.defined()) node->w_amax_ = SavedVariable(f.w_amax, false);
  };
  auto save_x = [&] {
    if (!node->w_grad) return;
    node->x_t_ = SavedVariable(f.x_t, false);
    node->x_sinv_ = SavedVariable(f.x_sinv, false);
    if (f.x_amax.defined()) node->x_amax_ = SavedVariable(f.x_amax, false);
  };
  if (p.recipe == kPlain) {
    save_x();
    save_w();
  } else {
    save_w();
    save_x();
  }
  torch::autograd::set_history(f.y, NodeHolder(node));
  return f.y;
}

// y = x W^T, recorded for autograd when grad mode is on and x or W needs a
// gradient; None (an undefined tensor) where the plan does not fit the call
// (fits): the caller then takes the Python path.
at::Tensor linear(const std::shared_ptr<Plan>& plan, const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& bias, int64_t lo, int64_t hi,
                  const std::vector<at::Tensor>& state) {
  int rec = !x.is_cuda() || plan->given_x ? -1 : fits(*plan, x.requires_grad(), x.get_device(),
                                                      w, bias, state);
  return rec < 0 ? at::Tensor() : run(plan, x, w, bias, lo, hi, state, rec > 0, nullptr);
}

// A fused module's norm and first GEMM under delayed scaling: the norm's
// kernel writes its output's FP8 copy with the layer's forward scale[0]
// (native_norm.cpp's norm_fp8), which the GEMM reads; both record their
// nodes, joined by the norm's output.  [y, ln_out] (ln_out None where the
// plan does not write it), or [] where either plan does not fit the call
// (checked before anything runs): the caller then takes the Python path.
std::vector<at::Tensor> norm_linear(const std::shared_ptr<Plan>& plan, py::handle norm_plan,
                                    const at::Tensor& x, const at::Tensor& ln_w,
                                    const c10::optional<at::Tensor>& ln_b, const at::Tensor& w,
                                    const c10::optional<at::Tensor>& bias, int64_t lo,
                                    int64_t hi, const std::vector<at::Tensor>& state) {
  const Plan& p = *plan;
  std::shared_ptr<NormPlan> norm = norm_plan_of(norm_plan);
  int norm_rec = p.given_x ? norm_fp8_fits(*norm, x, ln_w, ln_b) : -1;
  if (norm_rec < 0) return {};
  int rec = fits(p, norm_rec > 0, x.get_device(), w, bias, state);
  if (rec < 0) return {};
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor amaxes = at::zeros({p.amax_len}, x.options().dtype(at::kFloat));
  NormFp8 n = norm_fp8(norm, x, ln_w, ln_b, state[1].select(0, 0), amaxes, norm_rec > 0);
  GivenX given{n.data, n.t, n.sinv, amaxes};
  at::Tensor y = run(plan, n.ln_out, w, bias, lo, hi, state, rec > 0, &given);
  return {y, n.with_y ? n.ln_out : at::Tensor()};
}

Launch make_launch(int64_t function, std::vector<int64_t> grid, int64_t threads, int64_t shared,
                   int64_t n_scratch, std::vector<int64_t> kinds, std::vector<int64_t> ints,
                   std::vector<double> floats) {
  TORCH_CHECK(grid.size() == 3 && kinds.size() == ints.size() && kinds.size() == floats.size(),
              "te native: bad launch description");
  Launch l;
  l.function = function;
  l.grid = {grid[0], grid[1], grid[2]};
  l.threads = threads;
  l.shared = shared;
  l.n_scratch = n_scratch;
  l.kinds = std::move(kinds);
  l.ints = std::move(ints);
  l.floats = std::move(floats);
  return l;
}

// (offset, size) of each parameter of a kernel, from the driver: checks a plan's
// packing against the compiled kernel.
std::vector<std::pair<int64_t, int64_t>> param_info(int64_t function) {
  static auto fn = reinterpret_cast<ParamInfoFn>(dlsym(libcuda(), "cuFuncGetParamInfo"));
  TORCH_CHECK(fn != nullptr, "te native: libcuda has no cuFuncGetParamInfo");
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < 256; ++i) {
    size_t off = 0, size = 0;
    if (fn(reinterpret_cast<void*>(function), i, &off, &size) != 0) break;
    out.emplace_back(static_cast<int64_t>(off), static_cast<int64_t>(size));
  }
  return out;
}

// Launch one kernel on the current stream (tests and plan checks).
void run_launch(const Launch& l, const std::vector<at::Tensor>& slots, int64_t lo, int64_t hi) {
  TORCH_CHECK(!slots.empty(), "te native: no tensors");
  c10::cuda::CUDAGuard guard(slots[0].device());
  l.run(slots, lo, hi, c10::cuda::getCurrentCUDAStream(slots[0].device().index()).stream());
}

}  // namespace
}  // namespace te_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace te_native;
  py::class_<Launch>(m, "Launch").def(py::init<>());  // empty: a kPlain plan's fwd and bwd
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(py::init([](Launch fwd, Launch bwd, py::object python_backward,
                       const std::string& act_dtype, int64_t device, int64_t mm, int64_t k, int64_t n,
                       const std::string& fp8_fwd, const std::string& fp8_bwd,
                       const std::string& wgrad_dtype,
                       bool x_col, bool w_col, bool dgrad, bool wgrad, bool bias,
                       std::vector<int64_t> out_shape, std::vector<int64_t> in_shape) {
        auto p = std::make_shared<Plan>();
        p->fwd = std::move(fwd);
        p->bwd = std::move(bwd);
        p->python_backward.fn = python_backward.release().ptr();
        p->act_dtype = dtype_named(act_dtype);
        p->device = device;
        p->m = mm;
        p->k = k;
        p->n = n;
        p->fp8_fwd = dtype_named(fp8_fwd);
        p->fp8_bwd = dtype_named(fp8_bwd);
        p->wgrad_dtype = dtype_named(wgrad_dtype);
        p->x_col = x_col;
        p->w_col = w_col;
        p->dgrad = dgrad;
        p->wgrad = wgrad;
        p->bias = bias;
        p->out_shape = std::move(out_shape);
        p->in_shape = std::move(in_shape);
        return p;
      }))
      .def("set_block",
           [](Plan& p, int64_t scaling_1x128, int64_t scaling_128x128,
              std::optional<Launch> bias_add) {
             TORCH_CHECK(p.m % 128 == 0 && p.k % 128 == 0 && p.n % 128 == 0 &&
                             p.bias == bias_add.has_value(),
                         "te native: a blockwise plan takes 128-multiple sizes and a bias "
                         "add launch with a bias");
             p.recipe = kBlock;
             if (bias_add) p.bias_add = std::move(*bias_add);
             p.scaling_1x128 = scaling_1x128;
             p.scaling_128x128 = scaling_128x128;
           })
      .def("set_delayed",
           [](Plan& p, std::vector<Launch> fwd_list, std::vector<Launch> bwd_list,
              int64_t amax_len, int64_t amax_len_bwd) {
             TORCH_CHECK(!fwd_list.empty() && amax_len >= 0 && amax_len_bwd >= 0,
                         "te native: bad delayed plan");
             p.recipe = kDelayed;
             p.fwd_list = std::move(fwd_list);
             p.bwd_list = std::move(bwd_list);
             p.amax_len = amax_len;
             p.amax_len_bwd = amax_len_bwd;
           })
      .def("set_mx",
           [](Plan& p, std::vector<Launch> fwd_list, std::vector<Launch> bwd_list,
              std::vector<Launch> dgrad_list, std::vector<Launch> wgrad_list,
              std::optional<Launch> bias_add) {
             TORCH_CHECK(fwd_list.size() == 4 && p.m % 32 == 0 && p.k % 32 == 0 &&
                             p.n % 32 == 0 && p.bias == bias_add.has_value(),
                         "te native: bad MXFP8 plan");
             p.recipe = kMx;
             p.fwd_list = std::move(fwd_list);
             p.bwd_list = std::move(bwd_list);
             p.dgrad_list = std::move(dgrad_list);
             p.wgrad_list = std::move(wgrad_list);
             if (bias_add) p.bias_add = std::move(*bias_add);
           })
      .def("set_nvfp4",
           [](Plan& p, std::vector<Launch> fwd_list, Launch epilogue, std::vector<Launch> bwd_list,
              std::vector<Launch> dgrad_list, std::optional<Launch> dgrad_epilogue,
              std::vector<Launch> wgrad_list, std::optional<Launch> wgrad_epilogue,
              int64_t parts_x, int64_t parts_w, int64_t parts_dy, bool stochastic,
              bool fused) {
             TORCH_CHECK(fwd_list.size() == (fused ? 4u : 6u) && p.m % 16 == 0 &&
                             p.k % 16 == 0 &&
                             p.n % 16 == 0 && parts_x > 0 && parts_w > 0 &&
                             (!p.dgrad || dgrad_epilogue.has_value()) &&
                             (!p.wgrad || wgrad_epilogue.has_value()),
                         "te native: bad NVFP4 plan");
             p.recipe = kNvfp4;
             p.fwd_list = std::move(fwd_list);
             p.epilogue = std::move(epilogue);
             p.bwd_list = std::move(bwd_list);
             p.dgrad_list = std::move(dgrad_list);
             p.wgrad_list = std::move(wgrad_list);
             if (dgrad_epilogue) p.dgrad_epilogue = std::move(*dgrad_epilogue);
             if (wgrad_epilogue) p.wgrad_epilogue = std::move(*wgrad_epilogue);
             p.parts_x = parts_x;
             p.parts_w = parts_w;
             p.parts_dy = parts_dy;
             p.stochastic = stochastic;
             p.nvfp4_fused = fused;
           })
      .def("set_plain",
           [](Plan& p) {
             TORCH_CHECK(p.cache == kNoCache && p.wgrad_dtype == p.act_dtype,
                         "te native: a plain plan takes no weight cache and a weight of the "
                         "activations' dtype");
             p.recipe = kPlain;
           })
      .def("set_share",
           [](Plan& p, int64_t share, Launch fwd_w) {
             TORCH_CHECK((p.recipe == kCurrent || p.recipe == kBlock) && !p.given_x && share != 0,
                         "te native: x's quantization is shared under current or blockwise "
                         "scaling, by a nonzero key");
             p.share = share;
             p.fwd_w = std::move(fwd_w);
           })
      .def("set_cache",
           [](Plan& p, int64_t cache) {
             TORCH_CHECK(p.recipe != kMx && p.recipe != kNvfp4 && cache >= kNoCache &&
                             cache <= kReadCache && (cache != kWriteCache || p.w_col),
                         "te native: a weight cache is for current, delayed or blockwise scaling, "
                         "written with W's columnwise copy");
             p.cache = cache;
           })
      .def("set_given_x",
           [](Plan& p) {
             TORCH_CHECK(p.recipe == kDelayed && p.fwd_list.size() >= 1,
                         "te native: a norm-quantized x is for delayed scaling");
             p.given_x = true;
           })
      .def("set_main_grad",
           [](Plan& p) {
             TORCH_CHECK(p.wgrad && p.recipe != kMx && p.recipe != kPlain,
                         "te native: main_grad is for a weight gradient under FP8 current, "
                         "delayed or blockwise scaling, or NVFP4");
             p.main_grad = true;
           })
      .def("drop_python_backward",
           [](Plan& p) {  // an op's plan: its backward never takes the Python path
             PyObject* fn = p.python_backward.fn;
             p.python_backward.fn = nullptr;
             Py_XDECREF(fn);
           })
      .def("set_op_shapes",
           [](Plan& p, std::vector<std::vector<int64_t>> fwd,
              std::vector<std::vector<int64_t>> bwd) {
             p.op_fwd_shapes = std::move(fwd);
             p.op_bwd_shapes = std::move(bwd);
           })
      .def("set_bias_grad", [](Plan& p, Launch rows, Launch cols, int64_t groups) {
        TORCH_CHECK(p.bias && groups > 0, "te native: a bias gradient needs a bias");
        p.bias_rows = std::move(rows);
        p.bias_cols = std::move(cols);
        p.bias_groups = groups;
        p.bias_grad = true;
      });
  m.def("make_launch", &make_launch);
  m.def("param_info", &param_info);
  m.def("run_launch", &run_launch);
  m.def("linear", &linear);
  m.def("norm_linear", &norm_linear);
  m.def("has_block_gemm", &has_block_gemm);
  m.def("has_mm_dtype", &has_mm_dtype);
  te_native::register_norm(m);
  te_native::register_act(m);
  te_native::register_alloc(m);
  te_native::register_linear_op(m);
}
