"""Shared fixtures: one factory per quantizer configuration of every format."""

import os

import pytest
import torch

import transformer_engine_compile as te


def _share_the_cores() -> None:
    """Under ``pytest -n N`` each worker gets its share of the cores for
    torch's intra-op threads, and so do the processes it starts (gloo ranks,
    ``torchrun``) unless ``OMP_NUM_THREADS`` says otherwise.  Left at torch's default, every worker runs as many
    threads as there are cores, and OpenMP's waiting threads then compete
    for them: on 2 cores with 2 workers, tests/test_convergence.py took
    775 s so, and 170 s with one thread per worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_the_cores()


@pytest.fixture(scope="session", autouse=True)
def _native_extension_built():
    """On CUDA, the native eager path (kernels/native.py) runs from the first
    eager call of a test: its extension is built (or loaded from torch's
    cache) before any test, so which path a test takes never depends on the
    build's timing.  ``TE_COMPILE_NATIVE=0`` runs the tests on the Python
    eager path instead."""
    if torch.cuda.is_available():
        from transformer_engine_compile.kernels import native
        native.extension(wait=True)


def _delayed(fmt="e4m3"):
    return te.Float8Quantizer(torch.full((1,), 4.0), torch.zeros(1), fmt)


# name -> factory(rowwise, columnwise); value-opaque (stateless) quantizers only
STATELESS = {
    "fp8_current_e4m3": lambda r, c: te.Float8CurrentScalingQuantizer("e4m3", rowwise_usage=r, columnwise_usage=c),
    "fp8_current_e5m2": lambda r, c: te.Float8CurrentScalingQuantizer("e5m2", rowwise_usage=r, columnwise_usage=c),
    "fp8_current_pow2": lambda r, c: te.Float8CurrentScalingQuantizer(force_pow_2_scales=True, rowwise_usage=r, columnwise_usage=c),
    "mxfp8_e4m3": lambda r, c: te.MXFP8Quantizer("e4m3", rowwise_usage=r, columnwise_usage=c),
    "mxfp8_e5m2": lambda r, c: te.MXFP8Quantizer("e5m2", rowwise_usage=r, columnwise_usage=c),
    "block_1d": lambda r, c: te.Float8BlockQuantizer(block_scaling_dim=1, rowwise_usage=r, columnwise_usage=c),
    "block_2d": lambda r, c: te.Float8BlockQuantizer(block_scaling_dim=2, rowwise_usage=r, columnwise_usage=c),
    "block_1d_nopow2_e5m2": lambda r, c: te.Float8BlockQuantizer("e5m2", block_scaling_dim=1, force_pow_2_scales=False, rowwise_usage=r, columnwise_usage=c),
    "nvfp4": lambda r, c: te.NVFP4Quantizer(rowwise_usage=r, columnwise_usage=c),
    "nvfp4_rht": lambda r, c: te.NVFP4Quantizer(with_rht=True, rowwise_usage=r, columnwise_usage=c),
    "nvfp4_2d": lambda r, c: te.NVFP4Quantizer(with_2d_quantization=True, rowwise_usage=r, columnwise_usage=c),
}
ALL = dict(STATELESS)
ALL["fp8_delayed"] = lambda r, c: te.Float8Quantizer(
    torch.full((1,), 4.0), torch.zeros(1), "e4m3", rowwise_usage=r, columnwise_usage=c)

USAGES = [(True, False), (False, True), (True, True)]
USAGE_IDS = ["row", "col", "both"]


@pytest.fixture(params=sorted(STATELESS))
def stateless_name(request):
    return request.param


@pytest.fixture(params=sorted(ALL))
def any_name(request):
    return request.param


@pytest.fixture(params=USAGES, ids=USAGE_IDS)
def usage(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# -- the native eager path's GPU tests (tests/gpu/test_gpu_native*.py) ---------------------
@pytest.fixture(scope="module")
def ext():
    """The native eager path's extension (built now if need be); skips where it cannot be."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native
    ext = native.extension(wait=True)
    if ext is None:
        pytest.skip(f"native extension not built: {native._state['failed']}")
    return ext


@pytest.fixture
def calls(monkeypatch):
    """Counts the linear calls the native path ran (a plan that declines is
    not counted)."""
    from transformer_engine_compile.module.linear import native_node as linear_native_node
    n = {"native": 0}

    def counting(real):
        def counted(self, *args):
            out = real(self, *args)
            n["native"] += out is not None
            return out
        return counted

    # with_norm: a fused module's norm and first GEMM under DelayedScaling
    for name in ("__call__", "with_norm"):
        monkeypatch.setattr(linear_native_node.NativeLinear, name,
                            counting(getattr(linear_native_node.NativeLinear, name)))
    return n


@pytest.fixture
def compile_caches_off():
    """Inductor's and AOTAutograd's compile caches off (a cached graph is not
    traced again), through the config modules' own ``patch``: pytest's
    monkeypatch restores a torch 2.15 config entry by deleting it, which
    hides it from torch itself."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """te.GroupedLinear's FP8 blockwise kernel path taken on CPU, the
    kernel's reference computing the GEMMs; the list of each call's
    ``grouped_k`` (fprop and dgrad False, wgrad True)."""
    from transformer_engine_compile.kernels import blockwise_grouped as kernel
    from transformer_engine_compile.module.grouped import blockwise_gemm

    calls = []

    def gemm(*args):
        calls.append(args[5])
        return kernel.reference(*args)

    monkeypatch.setattr(blockwise_gemm, "applies", lambda *a: True)
    monkeypatch.setattr(kernel, "grouped_gemm", gemm)
    return calls
