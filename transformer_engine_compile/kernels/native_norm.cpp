// The normalisation of an eager te.LayerNormLinear or te.LayerNormMLP
// (LayerNorm or RMSNorm) as one C++ call and a C++ autograd node, ahead of
// the module's native linear call (module/layernorm/linear_native.py builds
// the plans and says when; layernorm_mlp_native.py for te.LayerNormMLP).
//
// The same Triton kernels as the Python path, with the same arguments: the
// forward launch (y, mean, rstd per row), and in the backward the launch
// making dx and the per-program partial sums of dgamma / dbeta, then the one
// summing those per column (kernels/triton_norm.py).  So the results are bit
// for bit the Python path's, and the node saves what its op saves: x, mean
// (LayerNorm), rstd and gamma.
#include "native_common.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace te_native __attribute__((visibility("hidden"))) {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Forward slots: 0 x (M, K), 1 gamma, 2 beta (gamma for RMSNorm), 3 y,
// 4 mean (x for RMSNorm), 5 rstd; under delayed scaling (`fp8`) also 6 the
// call's zeroed amax vector, 7 the layer's forward scale[0], 8 y's FP8
// data, 9 its scale_inv, 10 the data's transpose (the transpose launch's
// output; x without it), and y is x where not written.  Backward slots:
// 0 dy, 1 x, 2 gamma, 3 mean (rstd for RMSNorm), 4 rstd, 5 dx (x when not
// needed), 6 the fp32 partial sums, 7 the (n_sums, K) dgamma / dbeta sums
// (partials when none).  An argument the kernels never touch (their flags
// are constexpr) points at a tensor of the table, as the Python path points
// it at an input.
struct NormPlan {
  Launch fwd, bwd, sums;
  bool rms = false, zero_centered = false;  // gamma = 1 + weight (fp32) when zero_centered
  bool dx = false, dw = false, db = false;  // the gradients the backward launches make
  at::ScalarType act_dtype = at::kBFloat16, w_dtype = at::kBFloat16;
  int64_t device = 0, m = 0, k = 0, part_rows = 0, n_sums = 0;
  std::vector<int64_t> shape;  // x's (and y's)
  // delayed scaling: the forward launch writes y's FP8 copy with the layer's
  // scale (y itself only `with_y`), then `transpose` its columnwise copy
  bool fp8 = false, with_y = true, fp8_col = false;
  at::ScalarType fp8_dtype = at::kFloat8_e4m3fn;
  Launch transpose;
  // the Python path's backward, for a gradient these launches do not take
  PyCallable python_backward;
};

namespace {

struct NormBackward : public Node {
  std::shared_ptr<const NormPlan> plan;
  SavedVariable x_, mean_, rstd_, gamma_;
  bool x_grad = false, w_grad = false, b_grad = false;  // next edges, in this order

  std::string name() const override { return "TeNormBackward"; }

  void release_variables() override {
    x_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
    gamma_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const NormPlan& p = *plan;
    variable_list out(num_outputs());
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    at::Tensor x = x_.unpack(), rstd = rstd_.unpack(), gamma = gamma_.unpack();
    at::Tensor mean = p.rms ? rstd : mean_.unpack();
    at::Tensor dx, dw, db;
    if (!plain_on(dy, p.device, p.act_dtype)) {
      py::gil_scoped_acquire gil;
      py::object mean_arg = p.rms ? py::object(py::none()) : py::cast(mean);
      py::tuple res = py::handle(p.python_backward.fn)(dy, x, mean_arg, rstd, gamma);
      auto get = [&](int i) { return res[i].is_none() ? at::Tensor() : res[i].cast<at::Tensor>(); };
      dx = get(0);
      dw = get(1);
      db = get(2);
    } else {
      at::NoGradGuard no_grad;
      at::Tensor dy2d = operand(dy, p.m, p.k);
      auto stream = c10::cuda::getCurrentCUDAStream(dy.device().index()).stream();
      at::Tensor dx2d = p.dx ? at::empty({p.m, p.k}, dy.options()) : x;
      at::Tensor parts = at::empty({p.part_rows, p.k}, dy.options().dtype(at::kFloat));
      at::Tensor sums = p.n_sums ? at::empty({p.n_sums, p.k}, dy.options().dtype(p.w_dtype))
                                 : parts;
      std::vector<at::Tensor> slots{dy2d, x, gamma, mean, rstd, dx2d, parts, sums};
      p.bwd.run(slots, 0, 0, stream);
      if (p.n_sums) p.sums.run(slots, 0, 0, stream);
      if (p.dx) dx = dx2d.view(p.shape);
      if (p.dw) dw = sums.select(0, 0);
      if (p.db) db = sums.select(0, p.n_sums - 1);
    }
    size_t i = 0;
    for (int j = 0; j < 3; ++j) {
      if ((j == 0 && !x_grad) || (j == 1 && !w_grad) || (j == 2 && !b_grad)) continue;
      if (should_compute_output(i)) out[i] = j == 0 ? dx : j == 1 ? dw : db;
      ++i;
    }
    return once_differentiable(grads, std::move(out), "the fused modules' norm");
  }
};

bool plain_param(const at::Tensor& t, const NormPlan& p) {
  return plain_on(t, p.device, p.w_dtype) && t.dim() == 1 && t.size(0) == p.k && aligned(t);
}

// -1 where the plan does not fit this call (the caller then takes the
// Python path), else whether it records for autograd: grad mode on and x,
// w or b needing a gradient (the gradients planned for).
int fits(const NormPlan& p, const at::Tensor& x, const at::Tensor& w,
         const c10::optional<at::Tensor>& b) {
  if (!x.is_cuda() || x.get_device() != p.device || x.scalar_type() != p.act_dtype ||
      x.sizes() != at::IntArrayRef(p.shape) || !plain_param(w, p) || b.has_value() == p.rms ||
      (b.has_value() && !plain_param(*b, p))) {
    return -1;
  }
  bool b_req = b.has_value() && b->requires_grad();
  bool record = at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || b_req);
  if (record && (x.requires_grad() != p.dx || w.requires_grad() != p.dw || b_req != p.db)) {
    return -1;  // planned for other gradients
  }
  return record ? 1 : 0;
}

// The node of a norm call whose output is `y`: it saves what the Python
// path's op saves (x, mean for LayerNorm, rstd, gamma).
void record(const std::shared_ptr<NormPlan>& plan, const at::Tensor& x, const at::Tensor& w,
            const c10::optional<at::Tensor>& b, const at::Tensor& y, const at::Tensor& x2d,
            const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& gamma) {
  auto node = NodeMaker<NormBackward, NodeHolder>::make();
  node->plan = plan;
  node->x_grad = x.requires_grad();
  node->w_grad = w.requires_grad();
  node->b_grad = b.has_value() && b->requires_grad();
  torch::autograd::edge_list edges;
  if (node->x_grad) edges.push_back(torch::autograd::impl::gradient_edge(x));
  if (node->w_grad) edges.push_back(torch::autograd::impl::gradient_edge(w));
  if (node->b_grad) edges.push_back(torch::autograd::impl::gradient_edge(*b));
  node->set_next_edges(std::move(edges));
  node->x_ = SavedVariable(x2d, false);
  if (!plan->rms) node->mean_ = SavedVariable(mean, false);
  node->rstd_ = SavedVariable(rstd, false);
  node->gamma_ = SavedVariable(gamma, false);
  torch::autograd::set_history(y, NodeHolder(node));
}

// What a forward launch reads and writes besides y: x as (M, K), gamma as
// the kernels take it (norm_ops._gamma: 1 + w in fp32 when zero-centred),
// the fp32 mean (x for RMSNorm: not written) and rstd per row.
struct NormInputs {
  at::Tensor x2d, gamma, mean, rstd;
};

NormInputs inputs(const NormPlan& p, const at::Tensor& x, const at::Tensor& w) {
  at::NoGradGuard no_grad;
  NormInputs in;
  in.x2d = operand(x, p.m, p.k);
  in.gamma = p.zero_centered ? w.to(at::kFloat).add(1) : w;
  auto f32 = x.options().dtype(at::kFloat);
  in.rstd = at::empty({p.m}, f32);
  in.mean = p.rms ? in.x2d : at::empty({p.m}, f32);
  return in;
}

// norm(x) with gamma (`w`, or 1 + w when zero-centred) and beta (`b`,
// LayerNorm), recorded for autograd when grad mode is on and x, w or b needs
// a gradient; None (an undefined tensor) where the plan does not fit this
// call: the caller then takes the Python path.
at::Tensor norm(const std::shared_ptr<NormPlan>& plan, const at::Tensor& x, const at::Tensor& w,
                const c10::optional<at::Tensor>& b) {
  const NormPlan& p = *plan;
  int rec = p.fp8 ? -1 : fits(p, x, w, b);  // an FP8-writing plan runs in norm_fp8
  if (rec < 0) return at::Tensor();
  c10::cuda::CUDAGuard guard(x.device());
  NormInputs in = inputs(p, x, w);
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = at::empty(p.shape, x.options());
    auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    p.fwd.run({in.x2d, in.gamma, p.rms ? in.gamma : *b, y.view({p.m, p.k}), in.mean, in.rstd},
              0, 0, stream);
  }
  if (rec) record(plan, x, w, b, y, in.x2d, in.mean, in.rstd, in.gamma);
  return y;
}

}  // namespace

std::shared_ptr<NormPlan> norm_plan_of(py::handle plan) {
  return plan.cast<std::shared_ptr<NormPlan>>();
}

int norm_fp8_fits(const NormPlan& p, const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& b) {
  return p.fp8 ? fits(p, x, w, b) : -1;
}

NormFp8 norm_fp8(const std::shared_ptr<NormPlan>& plan, const at::Tensor& x,
                 const at::Tensor& w, const c10::optional<at::Tensor>& b,
                 const at::Tensor& scale, const at::Tensor& amaxes, bool rec) {
  const NormPlan& p = *plan;
  NormFp8 out;
  out.with_y = p.with_y;
  NormInputs in = inputs(p, x, w);
  const at::Tensor& x2d = in.x2d;
  {
    at::NoGradGuard no_grad;
    auto f32 = x.options().dtype(at::kFloat);
    // what autograd sees of the norm's output where y is not written: its
    // shape and dtype over one element of storage, never read (the linear
    // reads the FP8 copies)
    out.ln_out = p.with_y ? at::empty(p.shape, x.options())
                          : at::empty_strided(p.shape, std::vector<int64_t>(p.shape.size(), 0),
                                              x.options());
    out.data = at::empty({p.m, p.k}, x.options().dtype(p.fp8_dtype));
    out.sinv = at::empty({1}, f32);
    out.t = p.fp8_col ? at::empty({p.k, p.m}, x.options().dtype(p.fp8_dtype)) : x2d;
    auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    std::vector<at::Tensor> slots{x2d,     in.gamma, p.rms ? in.gamma : *b,
                                  p.with_y ? out.ln_out.view({p.m, p.k}) : x2d,
                                  in.mean, in.rstd, amaxes, scale, out.data, out.sinv, out.t};
    p.fwd.run(slots, 0, 0, stream);
    if (p.fp8_col) p.transpose.run(slots, 0, 0, stream);
  }
  if (rec) record(plan, x, w, b, out.ln_out, x2d, in.mean, in.rstd, in.gamma);
  return out;
}

void register_norm(py::module& m) {
  py::class_<NormPlan, std::shared_ptr<NormPlan>>(m, "NormPlan")
      .def(py::init([](Launch fwd, Launch bwd, std::optional<Launch> sums,
                       py::object python_backward, bool rms, bool zero_centered, bool dx, bool dw,
                       bool db, const std::string& act_dtype, const std::string& w_dtype,
                       int64_t device, int64_t part_rows, int64_t n_sums,
                       std::vector<int64_t> shape) {
        TORCH_CHECK(!shape.empty() && n_sums == int64_t(dw) + int64_t(db) &&
                        sums.has_value() == (n_sums > 0) && !(rms && db),
                    "te native: bad norm plan");
        auto p = std::make_shared<NormPlan>();
        p->fwd = std::move(fwd);
        p->bwd = std::move(bwd);
        if (sums) p->sums = std::move(*sums);
        p->python_backward.fn = python_backward.release().ptr();
        p->rms = rms;
        p->zero_centered = zero_centered;
        p->dx = dx;
        p->dw = dw;
        p->db = db;
        p->act_dtype = dtype_named(act_dtype);
        p->w_dtype = dtype_named(w_dtype);
        p->device = device;
        p->k = shape.back();
        p->m = 1;
        for (size_t i = 0; i + 1 < shape.size(); ++i) p->m *= shape[i];
        p->part_rows = part_rows;
        p->n_sums = n_sums;
        p->shape = std::move(shape);
        return p;
      }))
      .def("set_fp8", [](NormPlan& p, std::optional<Launch> transpose,
                         const std::string& fp8_dtype, bool with_y) {
        p.fp8 = true;  // fwd is the FP8-writing launch then
        p.fp8_col = transpose.has_value();
        if (transpose) p.transpose = std::move(*transpose);
        p.fp8_dtype = dtype_named(fp8_dtype);
        p.with_y = with_y;
      });
  m.def("norm", &norm);
}

}  // namespace te_native
