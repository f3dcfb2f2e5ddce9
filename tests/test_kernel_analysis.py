"""dynamo/kernel_analysis.py: torch's access analysis of a user Triton kernel
runs once per (kernel, signature) for this package's kernels and every time
for anyone else's.  Most tests put a counting stand-in in place of torch's
analysis; one runs the real analysis over a lowering traced on CPU (TTIR
for an sm_90 target, tests/cuda_trace.py), and the GPU test
(tests/gpu/test_gpu_lowering.py) counts it in a real compile."""

import types

import pytest
import sympy
import torch

import transformer_engine_compile  # noqa: F401 - installs the memo with the ops
from transformer_engine_compile import compat
from transformer_engine_compile.dynamo import kernel_analysis as ka


class _StandIn:
    """Hashable by identity, as Triton's kernel objects are."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _kernel(module="transformer_engine_compile.kernels.example", constexprs=("BLOCK",)):
    """A JITFunction-like object: ``fn`` (the Python function) and ``params``."""
    def body():
        pass
    body.__module__ = module
    params = [types.SimpleNamespace(name=n, is_constexpr=n in constexprs)
              for n in ("x_ptr", "n", "scale", "BLOCK")]
    return _StandIn(fn=body, params=params)


def _autotuner(kernel, **config_kwargs):
    """What torch makes of a launch with options: a one-config Autotuner."""
    return _StandIn(fn=kernel, configs=[types.SimpleNamespace(kwargs=config_kwargs)])


def _args(dtype=torch.float32, n=4096, scale=0.5, block=128):
    return {"x_ptr": torch.empty(2, dtype=dtype), "n": n, "scale": scale, "BLOCK": block}


_FOUND = compat.triton_access_analysis()
# torch's own analysis, under the memo the package installed at import
_TORCH_ANALYSIS = None if _FOUND is None else getattr(*_FOUND).__wrapped__


def counted_analyses(monkeypatch) -> list:
    """A fresh memo over torch's own analysis, recording (in the list
    returned) each kernel torch really analyses, until the test ends."""
    module, name = _FOUND
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return _TORCH_ANALYSIS(*args, **kwargs)

    monkeypatch.setattr(module, name, ka.memoized(counted))
    return calls


@pytest.fixture
def counted():
    calls = []

    def analysis(kernel, kwargs, tma_descriptor_metadata):
        calls.append(kernel)
        return ["x_ptr"]

    return ka.memoized(analysis), calls


def test_one_analysis_per_signature(counted):
    memo, calls = counted
    k = _kernel()
    first = memo(k, _args(), {})
    first.append("changed by a caller")
    # other sizes with the same specialization, another float value: same TTIR
    assert memo(k, _args(n=2048, scale=3.0), {}) == ["x_ptr"]
    assert len(calls) == 1


@pytest.mark.parametrize("change", [
    {"dtype": torch.bfloat16},  # a pointer of another type
    {"block": 64},  # a constexpr's value
    {"n": 1},  # Triton specializes an integer equal to 1
    {"n": 4100},  # ... and one not divisible by 16
    {"n": 2**40},  # ... and one that needs 64 bits
])
def test_what_the_generated_code_sees_is_in_the_key(counted, change):
    memo, calls = counted
    k = _kernel()
    memo(k, _args(), {})
    memo(k, _args(**change), {})
    assert len(calls) == 2


def test_symbolic_values_share_an_analysis(counted):
    """generate_ttir passes every symbolic value as the integer 2."""
    memo, calls = counted
    k = _kernel()
    memo(k, _args(n=sympy.Symbol("s0")), {})
    memo(k, _args(n=sympy.Symbol("s1") * 16), {})
    assert len(calls) == 1


def test_autotuner_wrappers_of_one_kernel_share_an_analysis(counted):
    """torch wraps each launch node in a new Autotuner: the key is the
    function under it and the config's keyword arguments."""
    memo, calls = counted
    k = _kernel()
    memo(_autotuner(k), _args(), {})
    memo(_autotuner(k), _args(), {})
    assert len(calls) == 1
    memo(_autotuner(k, GROUP=4), _args(), {})
    assert len(calls) == 2


@pytest.mark.parametrize("kernel, args, tma", [
    (_kernel(module="someone_else.kernels"), _args(), {}),  # not this package's
    (_kernel(), _args(), {"x_ptr": ("stable", ([64],))}),  # TMA descriptors
    (_kernel(), {**_args(), "BLOCK": [128]}, {}),  # a value that cannot be hashed
])
def test_other_calls_go_through_every_time(counted, kernel, args, tma):
    memo, calls = counted
    memo(kernel, args, tma)
    memo(kernel, args, tma)
    assert len(calls) == 2


def test_installed_once_over_torchs_analysis():
    found = compat.triton_access_analysis()
    if found is None:
        pytest.skip("this torch has no user-kernel access analysis")
    module, name = found
    installed = getattr(module, name)
    assert hasattr(installed, "memo")
    assert not hasattr(installed.__wrapped__, "memo")  # torch's own underneath
    assert ka.install() and getattr(module, name) is installed  # not wrapped twice


def test_the_package_kernels_are_recognised():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import triton_current
    kernel = triton_current._fp8_current_kernel
    assert ka.is_own_kernel(kernel) and ka.is_own_kernel(_autotuner(kernel))
    assert {"FMT_MAX", "BM", "BK"} <= ka._constexpr_names(kernel)
    assert "a_ptr" not in ka._constexpr_names(kernel)


def test_a_lowered_trace_analyses_each_kernel_once(monkeypatch):
    """The real analysis (TTIR for an sm_90 target, no GPU: tests/cuda_trace.py)
    over the lowered calls of 1 and of 3 te.Linear layers: three times the
    kernel nodes, the same number of analyses."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces

    import transformer_engine_compile as te

    def trace(layers):
        calls = counted_analyses(monkeypatch)
        model = torch.nn.Sequential(*[te.Linear(256, 256, bias=False, device="meta",
                                                params_dtype=torch.bfloat16)
                                      for _ in range(layers)])
        x = torch.empty(2, 128, 256, dtype=torch.bfloat16, device="meta", requires_grad=True)
        traces = lowered_cuda_traces(model, x, te.recipe.Float8CurrentScaling(),
                                     one_launch=True)
        hop = torch.ops.higher_order.triton_kernel_wrapper_functional
        nodes = sum(n.target is hop for _, _, gm in traces for n in gm.graph.nodes)
        return nodes, len(calls)

    nodes_one, analyses_one = trace(1)
    nodes_three, analyses_three = trace(3)
    assert nodes_three == 3 * nodes_one > 0
    assert analyses_three == analyses_one > 0
