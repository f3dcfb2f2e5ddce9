// The backward of a native te.Linear plan: dy quantized, the dgrad and wgrad
// GEMMs on the saved copies, the bias gradient; as the Python path's
// backward runs them (module/linear/compute.py), so both give the same bits.
// Shared by the eager path's autograd node (native_linear.cpp) and the
// backward op's real impl (native_linear_op.cpp).
#include "native_linear.h"

#include <c10/cuda/CUDAStream.h>

namespace te_native {
namespace {

// dgrad and wgrad under current or delayed scaling
void current_grads(const Plan& p, const at::Tensor& dy, const at::Tensor& dy2d, const Saved& s,
                   bool want_dx, bool want_dw, const DelayedState& d, int64_t lo, int64_t hi,
                   cudaStream_t stream, Grads& g) {
  at::Tensor sinv, data, tr;
  if (p.dgrad || p.wgrad) {  // dy quantized (a bias gradient alone reads dy as it is)
    sinv = at::empty({1}, dy.options().dtype(at::kFloat));
    data = p.dgrad ? fp8_empty(p.m, p.n, p.fp8_bwd, dy) : dy2d;
    tr = p.wgrad ? fp8_empty(p.n, p.m, p.fp8_bwd, dy) : dy2d;
    if (p.recipe == kDelayed) {
      TORCH_CHECK(d.history.defined(),
                  "Trying to backward through the graph a second time (te.Linear native "
                  "eager path): the delayed-scaling state was released");
      at::Tensor amaxes = p.amax_len_bwd > 0 ? at::zeros({p.amax_len_bwd}, sinv.options()) : dy2d;
      std::vector<at::Tensor> slots{dy2d, amaxes, d.scale.select(0, 0), data, tr, sinv,
                                    d.history, d.scale, d.new_history, d.new_scale};
      for (const Launch& l : p.bwd_list) l.run(slots, lo, hi, stream);
    } else {
      p.bwd.run({dy2d, data, tr, sinv}, lo, hi, stream);
    }
  }
  if (p.dgrad && want_dx) {
    g.dx = at::_scaled_mm(data, s.w_t.t(), sinv, s.w_sinv, c10::nullopt, c10::nullopt,
                          dy.scalar_type(), false)
               .view(p.in_shape);
  }
  if (p.wgrad && want_dw) {
    g.dw = at::_scaled_mm(tr, s.x_t.t(), sinv, s.x_sinv, c10::nullopt, c10::nullopt,
                          p.wgrad_dtype, false);
  }
}

// dgrad and wgrad under MXFP8 (cuda_gemm._emulated_bf16's calls)
void mx_grads(const Plan& p, const at::Tensor& dy, const at::Tensor& dy2d, const Saved& s,
              bool want_dx, bool want_dw, cudaStream_t stream, Grads& g) {
  constexpr int64_t B = 32;
  if (!(p.dgrad || p.wgrad)) return;
  at::Tensor d_rd = p.dgrad ? fp8_empty(p.m, p.n, p.fp8_bwd, dy) : dy2d;
  at::Tensor d_rs = p.dgrad ? u8_empty(p.m, p.n / B, dy) : dy2d;
  at::Tensor d_cd = p.wgrad ? fp8_empty(p.m, p.n, p.fp8_bwd, dy) : dy2d;
  at::Tensor d_cs = p.wgrad ? u8_empty(p.m / B, p.n, dy) : dy2d;
  auto bf16 = dy.options().dtype(at::kBFloat16);
  // the saved copies (dy2d where the GEMM reading one does not run)
  bool dx = p.dgrad && want_dx, dw = p.wgrad && want_dw;
  at::Tensor x_cd = dw ? s.x_t : dy2d, x_cs = dw ? s.x_sinv : dy2d;
  at::Tensor w_cd = dx ? s.w_t : dy2d, w_cs = dx ? s.w_sinv : dy2d;
  at::Tensor dy16 = p.dgrad ? at::empty({p.m, p.n}, bf16) : dy2d;
  at::Tensor w16c = p.dgrad ? at::empty({p.n, p.k}, bf16) : dy2d;
  at::Tensor dy16c = p.wgrad ? at::empty({p.m, p.n}, bf16) : dy2d;
  at::Tensor x16c = p.wgrad ? at::empty({p.m, p.k}, bf16) : dy2d;
  std::vector<at::Tensor> slots{dy2d, d_rd, d_rs, d_cd, d_cs, dy16, w16c,
                                dy16c, x16c, x_cd, x_cs, w_cd, w_cs};
  for (const Launch& l : p.bwd_list) l.run(slots, 0, 0, stream);
  if (p.dgrad && want_dx) {
    for (const Launch& l : p.dgrad_list) l.run(slots, 0, 0, stream);
    at::Tensor dx = at::mm(dy16, w16c);
    if (dx.scalar_type() != p.act_dtype) dx = dx.to(p.act_dtype);
    g.dx = dx.view(p.in_shape);
  }
  if (p.wgrad && want_dw) {
    for (const Launch& l : p.wgrad_list) l.run(slots, 0, 0, stream);
    at::Tensor dw = at::mm(dy16c.t(), x16c);
    g.dw = dw.scalar_type() == p.wgrad_dtype ? dw : dw.to(p.wgrad_dtype);
  }
}

// dgrad and wgrad under NVFP4 (cuda_gemm._emulated_nvfp4's calls)
void nvfp4_grads(const Plan& p, const at::Tensor& dy, const at::Tensor& dy2d, const Saved& s,
                 bool want_dx, bool want_dw, cudaStream_t stream, Grads& g) {
  if (!(p.dgrad || p.wgrad)) return;
  at::Tensor dp = at::empty({p.parts_dy}, dy.options().dtype(at::kInt));
  auto f32 = dy.options().dtype(at::kFloat);
  // the draws in the Python path's order: the rowwise copy's, then the columnwise one's
  at::Tensor r_row = p.stochastic && p.dgrad ? at::rand({p.m, p.n}, f32) : dp;
  at::Tensor r_col = p.stochastic && p.wgrad ? at::rand({p.n, p.m}, f32) : dp;
  auto dc = nvfp4_copies(p.m, p.n, p.dgrad, p.wgrad, dp);
  // the saved copies (dy2d where the GEMM reading one does not run)
  auto xc = p.wgrad && want_dw ? std::array<at::Tensor, 3>{s.x_t, s.x_sinv, s.x_amax}
                               : std::array<at::Tensor, 3>{dy2d, dy2d, dy2d};
  auto wc = p.dgrad && want_dx ? std::array<at::Tensor, 3>{s.w_t, s.w_sinv, s.w_amax}
                               : std::array<at::Tensor, 3>{dy2d, dy2d, dy2d};
  auto bf16 = dy.options().dtype(at::kBFloat16);
  bool dq = !p.nvfp4_fused;  // the operands dequantized for torch's GEMM
  at::Tensor dy16 = p.dgrad && dq ? at::empty({p.m, p.n}, bf16) : dy2d;
  at::Tensor w16c = p.dgrad && dq ? at::empty({p.k, p.n}, bf16) : dy2d;
  at::Tensor dy16c = p.wgrad && dq ? at::empty({p.n, p.m}, bf16) : dy2d;
  at::Tensor x16c = p.wgrad && dq ? at::empty({p.k, p.m}, bf16) : dy2d;
  std::vector<at::Tensor> slots{dy2d,  dp,    r_row, r_col, dc[0], dc[1], dc[2], dc[3],
                                dc[4], dc[5], xc[0], xc[1], xc[2], wc[0], wc[1], wc[2],
                                dy16,  w16c,  dy16c, x16c,  dy2d,  dy2d,  dy2d,  dy2d};
  for (const Launch& l : p.bwd_list) l.run(slots, 0, 0, stream);
  if (p.dgrad && want_dx) {
    for (const Launch& l : p.dgrad_list) l.run(slots, 0, 0, stream);
    at::Tensor dx = at::empty(p.in_shape, dy.options());
    if (dq) slots[20] = mm_dtype().call(dy16, w16c.t(), at::kFloat);
    slots[21] = dx.view({p.m, p.k});
    p.dgrad_epilogue.run(slots, 0, 0, stream);
    g.dx = dx;
  }
  if (p.wgrad && want_dw) {
    for (const Launch& l : p.wgrad_list) l.run(slots, 0, 0, stream);
    at::Tensor dw = at::empty({p.n, p.k}, dy.options().dtype(p.wgrad_dtype));
    if (dq) slots[22] = mm_dtype().call(dy16c, x16c.t(), at::kFloat);
    slots[23] = dw;
    p.wgrad_epilogue.run(slots, 0, 0, stream);
    g.dw = dw;
  }
}

// dgrad and wgrad under blockwise scaling (cuda_gemm._fp8_blockwise's calls)
void block_grads(const Plan& p, const at::Tensor& dy, const at::Tensor& dy2d, const Saved& s,
                 bool want_dx, bool want_dw, cudaStream_t stream, Grads& g) {
  constexpr int64_t B = 128;
  if (!(p.dgrad || p.wgrad)) return;
  auto f32 = dy.options().dtype(at::kFloat);
  at::Tensor d_rd = p.dgrad ? fp8_empty(p.m, p.n, p.fp8_bwd, dy) : dy2d;
  at::Tensor d_rs = p.dgrad ? at::empty({p.n / B, p.m}, f32) : dy2d;
  at::Tensor d_cd = p.wgrad ? fp8_empty(p.n, p.m, p.fp8_bwd, dy) : dy2d;
  at::Tensor d_cs = p.wgrad ? at::empty({p.m / B * p.n}, f32) : dy2d;
  p.bwd.run({dy2d, d_rd, d_rs, d_cd, d_cs}, 0, 0, stream);
  if (p.dgrad && want_dx) {
    at::Tensor dx = at::empty(p.in_shape, dy.options());
    at::Tensor dx2d = dx.view({p.m, p.k});
    block_gemm(p, d_rd, d_rs.t(), s.w_t, s.w_sinv, true, dx2d);
    g.dx = dx;
  }
  if (p.wgrad && want_dw) {
    at::Tensor dw = at::empty({p.n, p.k}, dy.options().dtype(p.wgrad_dtype));
    block_gemm(p, d_cd, d_cs.view({p.m / B, p.n}).t(), s.x_t,
               s.x_sinv.view({p.m / B, p.k}).t(), false, dw);
    g.dw = dw;
  }
}

// dgrad and wgrad without a recipe: F.linear on the operands
// plain.linear_grads passes it (dy as (M, N), W's and x's
// transposes), for the same cuBLAS calls; dy as it is, not `operand`'s
// aligned copy, which could change the GEMM's algorithm.
void plain_grads(const Plan& p, const at::Tensor& dy, const Saved& s, bool want_dx, bool want_dw,
                 Grads& g) {
  at::Tensor dy2d = dy.reshape({p.m, p.n});
  if (p.dgrad && want_dx) g.dx = at::linear(dy2d, s.w_t.t()).view(p.in_shape);
  if (p.wgrad && want_dw) g.dw = at::linear(dy2d.t(), s.x_t.reshape({p.m, p.k}).t());
}

}  // namespace

Grads grads_of(const Plan& p, const at::Tensor& dy, const Saved& s, bool want_dx, bool want_dw,
               bool want_db, const DelayedState& d, int64_t lo, int64_t hi) {
  at::NoGradGuard no_grad;
  at::Tensor dy2d = operand(dy, p.m, p.n);
  auto stream = c10::cuda::getCurrentCUDAStream(dy.device().index()).stream();
  Grads g;
  if (p.recipe == kPlain) {
    plain_grads(p, dy, s, want_dx, want_dw, g);
  } else if (p.recipe == kBlock) {
    block_grads(p, dy, dy2d, s, want_dx, want_dw, stream, g);
  } else if (p.recipe == kMx) {
    mx_grads(p, dy, dy2d, s, want_dx, want_dw, stream, g);
  } else if (p.recipe == kNvfp4) {
    nvfp4_grads(p, dy, dy2d, s, want_dx, want_dw, stream, g);
  } else {
    current_grads(p, dy, dy2d, s, want_dx, want_dw, d, lo, hi, stream, g);
  }
  if (p.bias_grad && want_db) {
    at::Tensor parts = at::empty({p.bias_groups, p.n}, dy.options().dtype(at::kFloat));
    at::Tensor db = at::empty({p.n}, dy.options());
    std::vector<at::Tensor> slots{dy2d, parts, db};
    p.bias_rows.run(slots, lo, hi, stream);
    p.bias_cols.run(slots, lo, hi, stream);
    g.db = db;
  }
  return g;
}

}  // namespace te_native
