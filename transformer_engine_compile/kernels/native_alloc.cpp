// One call allocating several uninitialised tensors on a tensor's device.
//
// The op impls allocate 3-17 outputs per call (copies, scales, amaxes,
// dequantized operands), and each torch.empty from Python costs 3-5 us of
// host time on the lent H200 hosts against about 1 us from here
// (benchmarks --configs host).  Each tensor is an
// allocation of its own, as with torch.empty: no output shares storage.
#include "native_common.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace te_native {
namespace {

int64_t as_dim(PyObject* item) {
  int64_t d = PyLong_AsLongLong(item);
  if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
  return d;
}

// empty_many(like, (shape, dtype), ...) -> tuple of tensors on like's device
py::tuple empty_many(const at::Tensor& like, const py::args& specs) {
  const auto n = static_cast<Py_ssize_t>(specs.size());
  py::tuple out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* spec = PyTuple_GET_ITEM(specs.ptr(), i);
    TORCH_CHECK(PyTuple_Check(spec) && PyTuple_GET_SIZE(spec) == 2,
                "empty_many: each spec is a (shape, dtype) tuple");
    PyObject* shape = PyTuple_GET_ITEM(spec, 0);
    PyObject* dtype = PyTuple_GET_ITEM(spec, 1);
    TORCH_CHECK(PyTuple_Check(shape) && THPDtype_Check(dtype),
                "empty_many: a spec's shape is a tuple of ints and its dtype a torch.dtype");
    c10::SmallVector<int64_t, 4> sizes;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(shape); ++j)
      sizes.push_back(as_dim(PyTuple_GET_ITEM(shape, j)));
    at::Tensor t = at::empty(sizes, like.options().dtype(
        reinterpret_cast<THPDtype*>(dtype)->scalar_type));
    PyTuple_SET_ITEM(out.ptr(), i, THPVariable_Wrap(std::move(t)));  // steals the reference
  }
  return out;
}

}  // namespace

void register_alloc(py::module& m) { m.def("empty_many", &empty_many); }

}  // namespace te_native
