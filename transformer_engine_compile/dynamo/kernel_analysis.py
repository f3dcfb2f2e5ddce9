"""One access analysis per kernel signature for the package's Triton kernels.

A lowered op call puts its Triton kernels into the graph as user-defined
kernels (dynamo/lowering.py).  For each such node torch works out which
arguments the kernel reads and writes by compiling the kernel to TTIR and
walking it: tens of milliseconds, and torch (2.11 and 2.13 checked)
repeats it for every node at each stage that asks (AOTAutograd's
functionalization, inductor's graph lowering, on 2.13 its kernel IR node),
with no cache.  A llama-a step under Float8CurrentScaling has 112 kernel
nodes, all of one kernel: about half of te's compile time over torch's own
model went there (the first compiled step, timed on an H200).

The answer depends only on the kernel and on what ``generate_ttir`` hands
Triton's code generator: a tensor becomes an empty tensor of its dtype, a
symbolic value the integer 2, and any other value is passed as it is.  Of
a value, the generated code sees a ``constexpr``'s value itself, and of an
integer argument its type and what Triton specializes on (equal to 1,
divisible by 16); a float argument is an fp32 scalar whatever its value.
That is the signature.  (Shapes and buffer addresses, such as a counter
slot's, differ from call to call; only their specialization enters it.)
:func:`install` wraps torch's analysis so that, for this package's kernels
only, it runs once per (kernel, signature) and later calls get a copy of
the result; every other kernel goes through torch's analysis untouched.  A
signature with a value that cannot be hashed, or with TMA descriptors, is
not cached.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch

from .. import compat

_PACKAGE = __name__.split(".")[0] + "."
_MISSING = object()


def _python_function(kernel):
    """The Python function under a JITFunction / Autotuner / heuristics wrapper."""
    fn = kernel
    for _ in range(8):
        inner = getattr(fn, "fn", None)
        if inner is None or inner is fn:
            break
        fn = inner
    return fn


def is_own_kernel(kernel) -> bool:
    """Whether ``kernel`` is one of this package's Triton kernels."""
    return getattr(_python_function(kernel), "__module__", "").startswith(_PACKAGE)


def _constexpr_names(kernel) -> frozenset | None:
    """Names of the kernel's ``tl.constexpr`` parameters (None: unknown)."""
    fn = kernel
    for _ in range(8):
        params = getattr(fn, "params", None)
        if params is not None:
            return frozenset(p.name for p in params if p.is_constexpr)
        fn = getattr(fn, "fn", None)
        if fn is None:
            break
    return None


def _value_key(value, constexpr: bool):
    """What TTIR generation sees of one argument (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbolic",)
    sympy = sys.modules.get("sympy")
    if sympy is not None and isinstance(value, sympy.Expr):
        return ("symbolic",)
    get_dtype = getattr(value, "get_dtype", None)  # inductor's TensorBox and IR nodes
    if callable(get_dtype):
        return ("tensor", get_dtype())
    if not constexpr and type(value) is int:
        return ("int", value == 1, value % 16 == 0, -2**31 <= value < 2**31,
                -2**63 <= value < 2**63)
    if not constexpr and type(value) is float:
        return ("float",)
    hash(value)  # TypeError: not cacheable
    return ("value", type(value), value)


def signature_key(kernel, kwargs: dict, tma_descriptor_metadata) -> tuple | None:
    """The cache key of one analysis, or None where it must not be cached.

    torch wraps a launch with options (``num_warps``) into an ``Autotuner``
    of one config, a new one per graph node; ``generate_ttir`` analyses the
    function under it with that config's keyword arguments added, so the key
    holds those two, not the wrapper."""
    if not is_own_kernel(kernel) or tma_descriptor_metadata:
        return None
    extra = ()
    configs = getattr(kernel, "configs", None)
    if configs is not None:  # an Autotuner
        extra = tuple(sorted(configs[0].kwargs.items())) if configs else ()
        kernel = kernel.fn
    constexprs = _constexpr_names(kernel)
    try:
        key = (kernel, extra, tuple(sorted(
            (name, _value_key(v, constexprs is None or name in constexprs))
            for name, v in kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


def memoized(analysis):
    """``analysis(kernel, kwargs, tma_descriptor_metadata)`` run once per
    :func:`signature_key`; a key of None always calls through.  The memo is
    the wrapper's ``memo`` attribute, the wrapped function ``__wrapped__``."""
    memo: dict = {}

    @functools.wraps(analysis)
    def wrapper(kernel, kwargs, tma_descriptor_metadata=None, *rest, **options):
        key = None if rest or options else signature_key(kernel, kwargs,
                                                         tma_descriptor_metadata)
        if key is None:
            return analysis(kernel, kwargs, tma_descriptor_metadata, *rest, **options)
        result = memo.get(key, _MISSING)
        if result is _MISSING:
            result = memo[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(result)  # callers own what they get, as before

    wrapper.memo = memo
    return wrapper


def install() -> bool:
    """Wrap torch's analysis with :func:`memoized` (once; where inductor's
    ``ir`` module has already bound the function, there too).  Returns
    whether it is installed."""
    found = compat.triton_access_analysis()
    if found is None:
        return False
    module, name = found
    current = getattr(module, name)
    if hasattr(current, "memo"):
        return True
    wrapped = memoized(current)
    setattr(module, name, wrapped)
    ir = sys.modules.get("torch._inductor.ir")
    if ir is not None and getattr(ir, name, None) is current:
        setattr(ir, name, wrapped)
    return True
