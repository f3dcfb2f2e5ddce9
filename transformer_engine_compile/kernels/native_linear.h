// The plan of one te.Linear configuration and the pieces of its forward and
// backward that kernels/native.py's extension shares between its sources:
// native_linear.cpp (the eager path: one C++ call and an autograd node),
// native_linear_grads.cpp (the backward's GEMMs, for the node and the ops)
// and native_linear_op.cpp (the linear ops' real impls).
#pragma once

#include "native_common.h"

#include <c10/cuda/CUDAStream.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace te_native __attribute__((visibility("hidden"))) {

// -- the plan of one te.Linear configuration -------------------------------------
// kPlain: no recipe (bf16 or fp16 with a bias: F.linear's GEMMs, the bias
// gradient's launches), as module/linear/plain.py runs them.
enum Recipe : int64_t { kCurrent = 0, kBlock = 1, kDelayed = 2, kMx = 3, kNvfp4 = 4, kPlain = 5 };
// Current, delayed or blockwise scaling with is_first_microbatch: the
// weight's copies written into the layer's FP8 weight cache after the GEMM
// (as the Python path's update copies them), or read from it instead of
// quantizing the weight.
enum Cache : int64_t { kNoCache = 0, kWriteCache = 1, kReadCache = 2 };

// Forward quantize slots: 0 x (M, K), 1 W (N, K), 2 x data, 3 x transpose,
// 4 x scale_inv, 5 W data, 6 W transpose, 7 W scale_inv.  Backward quantize
// slots: 0 dy (M, N), 1 dy data, 2 dy transpose, 3 dy scale_inv.  A copy not
// made points at the kernel's input (never written).  Reading the weight
// cache, the forward launch quantizes x alone: slots 0 x, 1 x data, 2 x
// transpose, 3 x scale_inv.  The bias gradient's
// two launches (column sums of dy): 0 dy, 1 fp32 partial sums, 2 the result.
// Blockwise: the forward's launch quantizes x and W (x alone where the
// weight cache is read), the backward's dy; per tensor, slots 0 the input,
// 1 rowwise data, 2 rowwise scales, 3 columnwise data, 4 columnwise scales
// (the forward: x's 0-4, then W's 5-9).
// Delayed scaling: lists of launches (the casts, the step when it is not
// fused into the last cast) over one slot table each.  Forward: 0 x, 1 W,
// 2 the zeroed amaxes, 3 scale[0], 4 scale[1], 5-7 x's data, transpose,
// scale_inv, 8-10 W's, 11 the forward history, 12 the forward scales, 13
// and 14 the history and scales the step writes (11 and 12 themselves on
// the eager path, new buffers for an op).  Reading the weight cache, 8-10 are the cache's buffers and the list is x's
// cast, W's amax and the step, as the Python path launches them.
// Backward: 0 dy, 1 the zeroed amaxes, 2 scale[0], 3-5 dy's data,
// transpose, scale_inv, 6 the backward history, 7 the backward scales, 8
// and 9 the step's outputs (6 and 7, or new buffers, as the forward's).
// MXFP8: lists too.  Forward: 0 x, 1 W, 2-5 x's rowwise data and scales,
// columnwise data and scales, 6-9 W's, 10 x in bf16, 11 W in bf16 (the
// quantizations, then the dequantizations of the rowwise copies).
// Backward: 0 dy, 1-4 dy's copies, 5 dy rowwise in bf16, 6 W columnwise in
// bf16, 7 dy columnwise in bf16, 8 x columnwise in bf16, 9-10 x's saved
// columnwise copy and scales, 11-12 W's (dy's quantization, then the
// dequantizations dgrad reads, then those wgrad reads).
// NVFP4 (emulated: each operand's blocks dequantized to bf16, a bf16 GEMM
// with an fp32 product, the epilogue dividing by both per-tensor scales):
// lists and an epilogue per GEMM.  Forward: 0 x, 1 W, 2 x's amax partials,
// 3-8 x's rowwise data, scales, amax, columnwise data, scales, amax, 9 W's
// partials, 10-15 W's copies, 16 x in bf16, 17 W in bf16, 18 the fp32
// product, 19 y, 20 the bias (the product without one); the list is x's
// amax and quantize passes, W's, then the two dequantizations.  Backward:
// 0 dy, 1 its partials, 2-3 the stochastic draws for dy's rowwise and
// columnwise copies (the partials where none), 4-9 dy's copies, 10-12 x's
// saved columnwise copy, 13-15 W's, 16 dy rowwise in bf16, 17 W columnwise
// in bf16, 18 dy columnwise in bf16, 19 x columnwise in bf16, 20 dgrad's
// product, 21 dx, 22 wgrad's product, 23 dW.  An absent copy is the
// partials (a buffer not needed, dy).  Small products (`nvfp4_fused`,
// cuda_gemm.nvfp4_fused) run in one kernel each: the lists hold no
// dequantizations, the bf16 and product slots are placeholders (x or dy),
// and each "epilogue" is that kernel, reading the packed copies.
struct Plan {
  int64_t recipe = kCurrent;
  int64_t cache = kNoCache;  // the weight cache (`state`: its buffers, after delayed state)
  Launch fwd, bwd;
  Launch bias_add;  // blockwise with a bias: added to the GEMM's output (slots y, bias)
  std::vector<Launch> fwd_list, bwd_list;  // delayed scaling, MXFP8
  std::vector<Launch> dgrad_list, wgrad_list;  // MXFP8, NVFP4: the operands' dequantizations
  Launch epilogue, dgrad_epilogue, wgrad_epilogue;  // NVFP4
  int64_t parts_x = 0, parts_w = 0, parts_dy = 0;  // NVFP4: int32 amax partials per tensor
  bool stochastic = false;  // NVFP4: dy rounded stochastically (torch.rand draws)
  bool nvfp4_fused = false;  // NVFP4: each GEMM one kernel (its "epilogue" launch)
  // delayed scaling: elements of the forward's and the backward's zeroed amax
  // vectors; 0 where the launch keeps its amaxes in the counter slot
  // (triton_delayed.py: the slot of the vector then holds x or dy, unread)
  int64_t amax_len = 0, amax_len_bwd = 0;
  int64_t scaling_1x128 = 0, scaling_128x128 = 0;  // F.ScalingType values
  Launch bias_rows, bias_cols;  // the bias gradient (when bias_grad)
  // the Python path's backward, for a gradient this node does not take as it
  // is (a tensor subclass such as fp8_grad's quantized dy, another dtype)
  PyCallable python_backward;
  at::ScalarType act_dtype = at::kBFloat16;  // x, y and dy
  int64_t device = 0;  // the kernels' device (their handles are per device)
  int64_t m = 0, k = 0, n = 0;
  at::ScalarType fp8_fwd = at::kFloat8_e4m3fn, fp8_bwd = at::kFloat8_e5m2;
  at::ScalarType wgrad_dtype = at::kBFloat16;
  bool x_col = false, w_col = false, dgrad = false, wgrad = false;
  // a bias of act_dtype added in the forward GEMM's epilogue; its gradient
  // summed over `bias_groups` row groups (triton_bias.column_sum)
  bool bias = false, bias_grad = false;
  int64_t bias_groups = 0;
  // fuse_wgrad_accumulation: W's gradient (of wgrad_dtype) is added into the
  // weight's main_grad, the last `state` tensor, and W's edge gets none
  bool main_grad = false;
  // delayed scaling in a fused module: x comes quantized by its norm's
  // kernel (norm_linear), the forward list holds W's launches alone
  bool given_x = false;
  // eager calls that read one x (q, k, v; gate, up) quantize it once: a
  // nonzero `share` names x's quantization (format and scaling: equal values
  // make equal bytes), and `fwd_w` quantizes W alone for a call that found
  // x's copies made (current scaling: slots 0 W, 1 data, 2 transpose,
  // 3 scale_inv; blockwise: 0 W, 1-4 its rowwise and columnwise data and
  // scales).  Current and blockwise scaling without the weight cache.
  int64_t share = 0;
  Launch fwd_w;
  std::vector<int64_t> out_shape, in_shape;
  // the linear ops' real impls (native_linear_op.cpp): each flat output's
  // shape in the op's fake, forward and backward (empty: as made)
  std::vector<std::vector<int64_t>> op_fwd_shapes, op_bwd_shapes;
};

// x's FP8 copies made by a fused module's norm kernel (norm_linear), and the
// call's amax vector with x's amax recorded in it
struct GivenX {
  at::Tensor data, t, sinv, amaxes;
};


inline at::Tensor fp8_empty(int64_t r, int64_t c, at::ScalarType dt, const at::Tensor& like) {
  return at::empty({r, c}, like.options().dtype(dt));
}

inline at::Tensor u8_empty(int64_t r, int64_t c, const at::Tensor& like) {
  return at::empty({r, c}, like.options().dtype(at::kByte));
}

// The NVFP4 copies of one (rows, cols) tensor: rowwise data, scales, amax,
// columnwise data, scales, amax; an absent copy's buffers are `parts`.
inline std::array<at::Tensor, 6> nvfp4_copies(int64_t rows, int64_t cols, bool rowwise,
                                              bool columnwise, const at::Tensor& parts) {
  constexpr int64_t B = 16;
  auto u8 = parts.options().dtype(at::kByte), e4m3 = parts.options().dtype(at::kFloat8_e4m3fn);
  auto f32 = parts.options().dtype(at::kFloat);
  return {rowwise ? at::empty({rows, cols / 2}, u8) : parts,
          rowwise ? at::empty({rows, cols / B}, e4m3) : parts,
          rowwise ? at::empty({1}, f32) : parts,
          columnwise ? at::empty({cols, rows / 2}, u8) : parts,
          columnwise ? at::empty({cols, rows / B}, e4m3) : parts,
          columnwise ? at::empty({1}, f32) : parts};
}

// Whether a bias is one the plan's launches take: plain, of the activations'
// dtype on the plan's device, (N,), contiguous and 16-byte aligned.
inline bool bias_fits(const Plan& p, const at::Tensor& b) {
  return plain_on(b, p.device, p.act_dtype) && b.dim() == 1 && b.size(0) == p.n && aligned(b);
}

// The tensors a forward leaves for the backward: x's and W's columnwise
// copies and their scales (current scaling: a one-element scale_inv each;
// kPlain: x and W themselves, no scales).
struct Forward {
  at::Tensor y, x_t, x_sinv, w_t, w_sinv;
  at::Tensor x_amax, w_amax;  // NVFP4: the columnwise copies' amaxes
  // a plan with `share`: all of x's copies (current: data, transpose,
  // scale_inv; blockwise: rowwise data, scales, columnwise data, scales;
  // an absent columnwise copy undefined)
  std::vector<at::Tensor> x_copies;
};

// The stored length of a row of 128x128 scales: `blocks` padded to a
// multiple of 4 (reference.padded_blocks), as cuBLAS reads them.
inline int64_t padded_blocks(int64_t blocks) { return (blocks + 3) / 4 * 4; }

// The copies a backward reads: x's and W's columnwise copies and their
// scales (NVFP4: and amaxes; kPlain: x and W); undefined where the GEMM
// reading one does not run.
struct Saved {
  at::Tensor x_t, x_sinv, x_amax, w_t, w_sinv, w_amax;
};

// Delayed scaling's backward state: the history and scales the casts read,
// and the buffers the step writes (the same tensors, in place, on the eager
// path; new ones for an op, which may not write its inputs).
struct DelayedState {
  at::Tensor history, scale, new_history, new_scale;
};

// A backward's gradients (undefined where not computed); `dw` of the plan's
// wgrad dtype (main_grad's with fuse_wgrad_accumulation, not yet added to it).
struct Grads {
  at::Tensor dx, dw, db;
};

// torch's GEMMs looked up at run time (a torch without one still builds the rest)
bool has_block_gemm();
bool has_mm_dtype();
using MmDtype = at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType);
const c10::TypedOperatorHandle<MmDtype>& mm_dtype();
// out = A @ B^T with block scales (cuda_gemm._fp8_blockwise); see native_linear.cpp
void block_gemm(const Plan& p, const at::Tensor& a, const at::Tensor& a_s, const at::Tensor& b,
                const at::Tensor& b_s, bool b_2d, at::Tensor& out);
// the bf16 emulated GEMM's result in `out` (MXFP8)
void mx_gemm(const at::Tensor& a16, const at::Tensor& b16t, at::Tensor& out);

// The forward of `p`'s recipe (native_linear.cpp).  `state`: the layer's
// delayed-scaling buffers, then the weight cache's, then main_grad (see
// Plan); `given`: x's copies where a fused module's norm made them; `steps`:
// delayed scaling's new history and scales (undefined: the step writes
// state[0] and state[1] in place).
Forward forward_of(const Plan& p, const at::Tensor& x, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias, int64_t lo, int64_t hi,
                   const std::vector<at::Tensor>& state, const GivenX* given,
                   const at::Tensor& new_history, const at::Tensor& new_scale);

// The backward's GEMMs and bias gradient from `dy` (plain, of the plan's
// activation dtype) and the saved copies (native_linear_grads.cpp):
// dx where `want_dx`, dW where `want_dw`, the bias gradient where `want_db`
// (each only where the plan computes it); `d`: delayed scaling's state.
Grads grads_of(const Plan& p, const at::Tensor& dy, const Saved& s, bool want_dx, bool want_dw,
               bool want_db, const DelayedState& d, int64_t lo, int64_t hi);

// native_linear_op.cpp's entries, added to the extension's module
void register_linear_op(py::module& m);

}  // namespace te_native
