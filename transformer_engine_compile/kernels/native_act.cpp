// The activation of an eager te.LayerNormMLP (between its two native linear
// calls) as one C++ call and a C++ autograd node; module/layernorm/mlp_native.py
// builds the plans and says when.
//
// The same Triton kernels as the Python path with the same arguments
// (kernels/triton_act.py: one launch forward, one backward), so the bits are
// the Python path's; the node saves what its op saves: the activation's
// input (fc1's output).
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

// Forward slots: 0 x (fc1's output), 1 y.  Backward slots: 0 dy, 1 x, 2 dx.
struct ActPlan {
  Launch fwd, bwd;
  at::ScalarType dtype = at::kBFloat16;
  int64_t device = 0;
  std::vector<int64_t> in_shape, out_shape;  // x's and y's (y halves a gated x's last dim)
  // the Python path's backward (dy, x) -> dx, for a gradient the launch does not take
  PyCallable python_backward;
};

bool fits(const at::Tensor& t, const ActPlan& p, const std::vector<int64_t>& shape) {
  return plain_on(t, p.device, p.dtype) && aligned(t) && t.sizes() == at::IntArrayRef(shape);
}

struct ActBackward : public Node {
  std::shared_ptr<const ActPlan> plan;
  SavedVariable x_;

  std::string name() const override { return "TeActivationBackward"; }

  void release_variables() override { x_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    const ActPlan& p = *plan;
    variable_list out(1);
    const at::Tensor& dy = grads[0];
    if (!dy.defined() || !should_compute_output(0)) return out;
    at::Tensor x = x_.unpack();
    if (!fits(dy, p, p.out_shape)) {  // the Python path's kernel choice for it
      py::gil_scoped_acquire gil;
      out[0] = py::handle(p.python_backward.fn)(dy, x).cast<at::Tensor>();
    } else {
      at::NoGradGuard no_grad;
      at::Tensor dx = at::empty(p.in_shape, x.options());
      auto stream = c10::cuda::getCurrentCUDAStream(dy.device().index()).stream();
      p.bwd.run({dy, x, dx}, 0, 0, stream);
      out[0] = dx;
    }
    return once_differentiable(grads, std::move(out), "te.LayerNormMLP's activation");
  }
};

// act(x) (gated: act(first half) * second half), recorded for autograd when
// grad mode is on and x needs a gradient; None (an undefined tensor) where
// the plan does not fit x: the caller then takes the Python path.
at::Tensor act(const std::shared_ptr<ActPlan>& plan, const at::Tensor& x) {
  const ActPlan& p = *plan;
  if (!fits(x, p, p.in_shape)) return at::Tensor();
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = at::empty(p.out_shape, x.options());
    auto stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
    p.fwd.run({x, y}, 0, 0, stream);
  }
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return y;
  auto node = NodeMaker<ActBackward, NodeHolder>::make();
  node->plan = plan;
  node->set_next_edges({torch::autograd::impl::gradient_edge(x)});
  node->x_ = SavedVariable(x, false);
  torch::autograd::set_history(y, NodeHolder(node));
  return y;
}

}  // namespace

void register_act(py::module& m) {
  py::class_<ActPlan, std::shared_ptr<ActPlan>>(m, "ActPlan")
      .def(py::init([](Launch fwd, Launch bwd, py::object python_backward,
                       const std::string& dtype, int64_t device, std::vector<int64_t> in_shape,
                       std::vector<int64_t> out_shape) {
        TORCH_CHECK(!in_shape.empty() && in_shape.size() == out_shape.size(),
                    "te native: bad activation plan");
        auto p = std::make_shared<ActPlan>();
        p->fwd = std::move(fwd);
        p->bwd = std::move(bwd);
        p->python_backward.fn = python_backward.release().ptr();
        p->dtype = dtype_named(dtype);
        p->device = device;
        p->in_shape = std::move(in_shape);
        p->out_shape = std::move(out_shape);
        return p;
      }));
  m.def("act", &act);
}

}  // namespace te_native
