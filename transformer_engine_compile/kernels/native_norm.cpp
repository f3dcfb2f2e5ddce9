// The normalisation of an eager te.LayerNormLinear or te.LayerNormMLP
// (LayerNorm or RMSNorm) as one C++ call and a C++ autograd node, ahead of
// the module's native linear call (module/layernorm_linear_native.py builds
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
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Forward slots: 0 x (M, K), 1 gamma, 2 beta (gamma for RMSNorm), 3 y,
// 4 mean (x for RMSNorm), 5 rstd.  Backward slots: 0 dy, 1 x, 2 gamma,
// 3 mean (rstd for RMSNorm), 4 rstd, 5 dx (x when not needed), 6 the fp32
// partial sums, 7 the (n_sums, K) dgamma / dbeta sums (partials when none).
// An argument the kernels never touch (their flags are constexpr) points
// at a tensor of the table, as the Python path points it at an input.
struct NormPlan {
  Launch fwd, bwd, sums;
  bool rms = false, zero_centered = false;  // gamma = 1 + weight (fp32) when zero_centered
  bool dx = false, dw = false, db = false;  // the gradients the backward launches make
  at::ScalarType act_dtype = at::kBFloat16, w_dtype = at::kBFloat16;
  int64_t device = 0, m = 0, k = 0, part_rows = 0, n_sums = 0;
  std::vector<int64_t> shape;  // x's (and y's)
  // the Python path's backward, for a gradient these launches do not take
  PyCallable python_backward;
};

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

// norm(x) with gamma (`w`, or 1 + w when zero-centred) and beta (`b`,
// LayerNorm), recorded for autograd when grad mode is on and x, w or b needs
// a gradient; None (an undefined tensor) where the plan does not fit this
// call: the caller then takes the Python path.
at::Tensor norm(const std::shared_ptr<NormPlan>& plan, const at::Tensor& x, const at::Tensor& w,
                const c10::optional<at::Tensor>& b) {
  const NormPlan& p = *plan;
  if (!x.is_cuda() || x.get_device() != p.device || x.scalar_type() != p.act_dtype ||
      x.sizes() != at::IntArrayRef(p.shape) || !plain_param(w, p) || b.has_value() == p.rms ||
      (b.has_value() && !plain_param(*b, p))) {
    return at::Tensor();
  }
  bool b_req = b.has_value() && b->requires_grad();
  bool record = at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || b_req);
  if (record && (x.requires_grad() != p.dx || w.requires_grad() != p.dw || b_req != p.db)) {
    return at::Tensor();  // planned for other gradients
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor x2d, gamma, mean, rstd, y;
  {
    at::NoGradGuard no_grad;
    x2d = operand(x, p.m, p.k);
    gamma = p.zero_centered ? w.to(at::kFloat).add(1) : w;  // norm_ops._gamma
    auto f32 = x.options().dtype(at::kFloat);
    rstd = at::empty({p.m}, f32);
    mean = p.rms ? x2d : at::empty({p.m}, f32);
    y = at::empty(p.shape, x.options());
    auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    p.fwd.run({x2d, gamma, p.rms ? gamma : *b, y.view({p.m, p.k}), mean, rstd}, 0, 0, stream);
  }
  if (!record) return y;
  auto node = NodeMaker<NormBackward, NodeHolder>::make();
  node->plan = plan;
  node->x_grad = x.requires_grad();
  node->w_grad = w.requires_grad();
  node->b_grad = b_req;
  torch::autograd::edge_list edges;
  if (node->x_grad) edges.push_back(torch::autograd::impl::gradient_edge(x));
  if (node->w_grad) edges.push_back(torch::autograd::impl::gradient_edge(w));
  if (node->b_grad) edges.push_back(torch::autograd::impl::gradient_edge(*b));
  node->set_next_edges(std::move(edges));
  node->x_ = SavedVariable(x2d, false);
  if (!p.rms) node->mean_ = SavedVariable(mean, false);
  node->rstd_ = SavedVariable(rstd, false);
  node->gamma_ = SavedVariable(gamma, false);
  torch::autograd::set_history(y, NodeHolder(node));
  return y;
}

}  // namespace

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
      }));
  m.def("norm", &norm);
}

}  // namespace te_native
