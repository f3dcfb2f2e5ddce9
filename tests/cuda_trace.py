"""Trace the ops' CUDA impls as inductor lowers them, on a machine without a GPU.

CI never sees a GPU, yet the lowering (dynamo/lowering.py) traces the CUDA
fast kernels' Python: launch configurations, buffer allocation, the
``wrap_triton`` nodes and torch's mutation analysis of each Triton kernel.
:func:`lowered_cuda_traces` runs a module's forward and backward on meta
tensors with the CUDA fast kernels registered for the meta device, records
each te op call (its flat arguments and the fake impl's outputs), and
traces the op's entry in inductor's decomposition table on them under
``make_fx``, as inductor's AOT trace does (with the meta device lowered,
so the entry's own checks decide).  Triton builds each kernel's TTIR for
an sm_90 target without a driver; nothing is launched.  Needs Triton.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_engine_compile as te
from transformer_engine_compile import kernels
from transformer_engine_compile.dynamo import lowering


class _Hopper:
    """Stands in for Triton's CUDA driver: TTIR generation only asks the target."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda")


@contextlib.contextmanager
def ttir_launches():
    """Every ``triton_launch.Launcher`` call builds its kernel's TTIR for
    an sm_90 target instead of launching (no driver, any tensors): what
    Triton's frontend refuses on a GPU (a global that is not a constexpr,
    a type error) fails here too, where the interpreter would accept it.
    Yields the kernels' names, one per call."""
    import inspect

    import triton
    from torch._higher_order_ops.triton_kernel_wrap import generate_ttir

    from transformer_engine_compile.kernels import triton_launch

    built = []

    def build(self, grid, key, *args):
        names = list(inspect.signature(self.fn.fn).parameters)
        generate_ttir(self.fn, dict(zip(names, args)), {})
        built.append(self.fn.fn.__name__)

    with mock.patch.object(triton.runtime.driver, "_active", _Hopper()), \
            mock.patch.object(triton_launch.Launcher, "__call__", build):
        yield built


_SLOT = (1 << 20, 0)  # a counter slot's address halves (never dereferenced: nothing launches)


@contextlib.contextmanager
def cuda_kernels_on_meta(one_launch=False):
    """The CUDA fast kernels serve meta tensors, the device queries answer
    as an H100 / H200 would, and modules take their compiled path (the op
    call) although nothing is compiled.  ``one_launch``: current scaling
    gets a counter slot, as a default-mode graph on a GPU does (one launch
    per quantization), instead of the two launches of a graph that names
    no pool (kernels/grid_state.py)."""
    import triton

    from transformer_engine_compile.quantization import cuda_gemm
    from transformer_engine_compile.kernels import grid_state, triton_launch
    kernels._load("cuda")
    added = [(name, "meta") for (name, dev) in list(kernels._FAST) if dev == "cuda"]
    for name, _ in added:
        kernels.register_fast(name, "meta", kernels._FAST[(name, "cuda")])
    loaded = "meta" in kernels._loaded_devices
    kernels._loaded_devices.add("meta")
    lowered = lowering.set_lowered_devices({"meta"})
    try:
        with mock.patch.object(triton.runtime.driver, "_active", _Hopper()), \
                mock.patch.object(triton_launch, "sm_count", lambda device: 132), \
                mock.patch.object(cuda_gemm, "_capability", lambda index: (9, 0)), \
                mock.patch("torch.compiler.is_compiling", lambda: True), \
                mock.patch.object(grid_state, "slot",
                                  (lambda device: _SLOT) if one_launch else grid_state.slot):
            yield
    finally:
        lowering.set_lowered_devices(lowered)
        for key in added:
            kernels._FAST.pop(key, None)
        if not loaded:
            kernels._loaded_devices.discard("meta")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) == "te_compile":
            self.calls.append((func, args, out))
        return out


def lowered_cuda_traces(module, x, recipe=None, computed_input=False, one_launch=False,
                        **call_kwargs) -> list:
    """``[(op, op_outputs, graph_module)]`` for each op call of one forward
    (``module(x, **call_kwargs)``) and backward of ``module`` (built on the
    meta device) on ``x`` (meta): the fake impl's outputs and the graph the
    lowering traces for the call (which returns None where the call is not
    lowered).  ``computed_input``: the op's first argument (x, dy) is
    computed in the traced graph (``2 * t`` of a graph input ``t``), as a
    fused kernel's result in a model's graph, instead of a graph input.
    ``one_launch``: see :func:`cuda_kernels_on_meta`."""
    from torch._inductor.decomposition import decompositions
    with cuda_kernels_on_meta(one_launch):
        record = _RecordOps()
        with record, te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, **call_kwargs)
            ys = y if isinstance(y, tuple) else (y,)
            sum(t.float().sum() for t in ys).backward()

        def traced(op):
            def decomposed(*args):  # None where the call is not lowered
                out = decompositions[op](*args)
                return None if out is NotImplemented else out
            if not computed_input:
                return make_fx(decomposed, tracing_mode="fake")

            def with_computed(t, *args):
                first = args[0]
                return decomposed([2 * t] if isinstance(first, list) else 2 * t, *args[1:])

            return lambda *args: make_fx(with_computed, tracing_mode="fake")(
                args[0][0] if isinstance(args[0], list) else args[0], *args)

        return [(op, out, traced(op)(*args)) for op, args, out in record.calls]
