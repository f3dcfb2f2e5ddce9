// What the native eager path's sources share (kernels/native.py builds
// them into one extension): launching a compiled Triton kernel with the
// arguments a plan fixed, autograd node holders across torch versions, a
// Python callable a plan keeps, and the operand checks.
#pragma once

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <dlfcn.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

// hidden, as pybind11's own types are: the extension exports nothing else
namespace te_native __attribute__((visibility("hidden"))) {

// Autograd nodes are held by std::shared_ptr up to torch 2.12 and by
// c10::intrusive_ptr after: make one the way this torch holds them.
using NodeHolder = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;
template <class T, class H>
struct NodeMaker;
template <class T>
struct NodeMaker<T, std::shared_ptr<torch::autograd::Node>> {
  static std::shared_ptr<T> make() { return std::make_shared<T>(); }
};
template <class T>
struct NodeMaker<T, c10::intrusive_ptr<torch::autograd::Node>> {
  static c10::intrusive_ptr<T> make() { return c10::make_intrusive<T>(); }
};

// -- driver entry points (libcuda, as Triton loads it) -------------------------
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using ParamInfoFn = int (*)(void*, size_t, size_t*, size_t*);

inline void* libcuda() {
  static void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "te native: cannot load libcuda.so.1");
  return handle;
}

inline LaunchFn launch_fn() {
  static auto fn = reinterpret_cast<LaunchFn>(dlsym(libcuda(), "cuLaunchKernel"));
  TORCH_CHECK(fn != nullptr, "te native: libcuda has no cuLaunchKernel");
  return fn;
}

// The driver launches on the calling thread's current context, and a thread
// that has done no CUDA runtime work has none: the autograd engine's device
// threads among them (torch makes a context current lazily, and skips
// setting device 0 on a fresh thread; Triton's launcher guards the same
// way).  A launch there without one crashed (a native node being the first
// CUDA work of the engine's thread).  Makes the device's primary context
// current where none is; one thread-local read otherwise.
using CtxGetCurrentFn = int (*)(void**);
using DeviceGetFn = int (*)(int*, int);
using PrimaryCtxRetainFn = int (*)(void**, int);
using CtxSetCurrentFn = int (*)(void*);

inline void ensure_context(int64_t device) {
  static auto get = reinterpret_cast<CtxGetCurrentFn>(dlsym(libcuda(), "cuCtxGetCurrent"));
  void* ctx = nullptr;
  TORCH_CHECK(get != nullptr, "te native: libcuda has no cuCtxGetCurrent");
  if (get(&ctx) == 0 && ctx != nullptr) return;
  static auto dev_get = reinterpret_cast<DeviceGetFn>(dlsym(libcuda(), "cuDeviceGet"));
  static auto retain =
      reinterpret_cast<PrimaryCtxRetainFn>(dlsym(libcuda(), "cuDevicePrimaryCtxRetain"));
  static auto set = reinterpret_cast<CtxSetCurrentFn>(dlsym(libcuda(), "cuCtxSetCurrent"));
  int handle = 0;
  TORCH_CHECK(dev_get != nullptr && retain != nullptr && set != nullptr &&
                  dev_get(&handle, static_cast<int>(device)) == 0 &&
                  retain(&ctx, handle) == 0 && set(ctx) == 0,
              "te native: cannot make device ", device, "'s CUDA context current");
}

// -- one compiled Triton kernel with its arguments fixed by a plan -------------
enum Kind : int64_t { kSlot = 0, kI32 = 1, kI64 = 2, kF32 = 3, kLo = 4, kHi = 5 };

struct Launch {
  int64_t function = 0;
  std::array<int64_t, 3> grid{1, 1, 1};
  int64_t threads = 0, shared = 0, n_scratch = 0;
  std::vector<int64_t> kinds;  // per kernel parameter, in order
  std::vector<int64_t> ints;   // slot index or integer value
  std::vector<double> floats;

  void run(const std::vector<at::Tensor>& slots, int64_t lo, int64_t hi,
           cudaStream_t stream) const {
    const size_t n = kinds.size();
    for (size_t i = 0; i < n; ++i) {  // a plan's slot table must match its launches
      TORCH_CHECK(kinds[i] != kSlot || (ints[i] >= 0 && static_cast<size_t>(ints[i]) < slots.size()),
                  "te native: a launch reads slot ", ints[i], " of ", slots.size());
    }
    std::vector<uint64_t> cells(n + n_scratch, 0);
    std::vector<void*> params(n + n_scratch);
    for (size_t i = 0; i < n; ++i) {
      void* cell = &cells[i];
      switch (kinds[i]) {
        case kSlot: cells[i] = reinterpret_cast<uint64_t>(slots[ints[i]].data_ptr()); break;
        case kI32: *static_cast<int32_t*>(cell) = static_cast<int32_t>(ints[i]); break;
        case kI64: *static_cast<int64_t*>(cell) = ints[i]; break;
        case kF32: *static_cast<float*>(cell) = static_cast<float>(floats[i]); break;
        case kLo: *static_cast<int32_t*>(cell) = static_cast<int32_t>(lo); break;
        case kHi: *static_cast<int32_t*>(cell) = static_cast<int32_t>(hi); break;
        default: TORCH_CHECK(false, "te native: bad parameter kind");
      }
      params[i] = cell;
    }
    for (size_t i = n; i < n + n_scratch; ++i) params[i] = &cells[i];  // null scratch
    for (const at::Tensor& t : slots) {  // the launch's device: its tensors'
      if (t.defined() && t.is_cuda()) {
        ensure_context(t.get_device());
        break;
      }
    }
    int err = launch_fn()(reinterpret_cast<void*>(function), grid[0], grid[1], grid[2],
                          threads, 1, 1, shared, stream, params.data(), nullptr);
    TORCH_CHECK(err == 0, "te native: cuLaunchKernel failed with CUresult ", err);
  }
};

// A Python callable kept by a plan; released under the GIL from any thread.
struct PyCallable {
  PyObject* fn = nullptr;
  PyCallable() = default;
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (fn != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(fn);
    }
  }
};

inline at::ScalarType dtype_named(const std::string& name) {
  if (name == "float8_e4m3fn") return at::kFloat8_e4m3fn;
  if (name == "float8_e5m2") return at::kFloat8_e5m2;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float32") return at::kFloat;
  TORCH_CHECK(false, "te native: unsupported dtype ", name);
}

// Whether the kernels a plan fixed take `t` as it is: a CUDA tensor on the
// plan's device, of its dtype, not a tensor subclass.
inline bool plain_on(const at::Tensor& t, int64_t device, at::ScalarType dtype) {
  return t.is_cuda() && t.get_device() == device && t.scalar_type() == dtype &&
         !t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
}

inline bool aligned(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The kernels were compiled for contiguous, 16-byte aligned inputs; a copy
// holds the same values.
inline at::Tensor operand(const at::Tensor& t, int64_t rows, int64_t cols) {
  at::Tensor m = t.reshape({rows, cols});
  return aligned(m) ? m : m.clone(at::MemoryFormat::Contiguous);
}

// A node's gradients under create_graph=True: as with @once_differentiable,
// they refuse only a second backward through them (`what`: the layer).
inline torch::autograd::variable_list once_differentiable(
    const torch::autograd::variable_list& grads, torch::autograd::variable_list out,
    const char* what) {
  bool tracked = false;
  for (const auto& g : grads) tracked = tracked || (g.defined() && g.requires_grad());
  if (!at::GradMode::is_enabled() || !tracked) return out;
  for (auto& v : out) {
    if (v.defined()) {
      v = v.detach();
      v.set_requires_grad(true);
    }
  }
  torch::autograd::DelayedError err(
      std::string(what) + " (native eager path): double backward is not supported",
      static_cast<int64_t>(out.size()));
  return err.apply(std::move(out));
}

// native_norm.cpp's and native_act.cpp's classes and functions, added to the
// extension's module
void register_norm(py::module& m);
// native_norm.cpp's FP8-writing norm (delayed scaling), which
// native_linear.cpp's norm_linear runs ahead of a fused module's first GEMM:
// the plan behind a Python NormPlan; -1 where the plan does not fit the
// call, else whether it records for autograd; the norm run and recorded.
struct NormPlan;
struct NormFp8 {
  at::Tensor ln_out;  // what autograd sees of y (y itself only where the plan writes it)
  at::Tensor data, t, sinv;  // y's FP8 copy, its transpose (where planned), scale_inv
  bool with_y = false;  // whether ln_out holds y
};
std::shared_ptr<NormPlan> norm_plan_of(py::handle plan);
int norm_fp8_fits(const NormPlan& p, const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& b);
NormFp8 norm_fp8(const std::shared_ptr<NormPlan>& plan, const at::Tensor& x,
                 const at::Tensor& w, const c10::optional<at::Tensor>& b,
                 const at::Tensor& scale, const at::Tensor& amaxes, bool record);
void register_act(py::module& m);
// native_alloc.cpp's empty_many
void register_alloc(py::module& m);

}  // namespace te_native
