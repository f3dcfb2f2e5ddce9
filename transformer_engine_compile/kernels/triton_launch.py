"""Launch Triton kernels through their compiled handle, skipping ``kernel[grid](...)``.

``kernel[grid](*args)`` costs about 18 us of host time per call on the H200
machine (binding and specializing every argument, reading Triton's knobs,
building launch metadata).  The op impls launch 2-4 kernels per tensor
they quantize, so that is most of their host time.

:class:`Launcher` keeps, per *key*, the ``CompiledKernel`` the first call
compiled, and later calls go straight to its launcher (the C function that
``kernel[grid]`` ends in).  The key is the caller's: it must determine
everything Triton specializes on, namely the constexpr values, the dtype of
each pointer, the 16-byte alignment of pointers that may be unaligned, and
for each int argument whether it is 1, a multiple of 16, and within int32.
Callers build it from the few values that vary (the input's dtype and
alignment, ``M``, ``K``); freshly allocated outputs are always aligned.

A wrong key would launch a kernel specialized for other arguments, so
``TE_COMPILE_CHECK_LAUNCH=1`` (set by the GPU tests) launches every call
through ``kernel[grid]`` and raises if Triton picked another compiled kernel
than the one cached for the key.  Without a usable handle (the interpreter,
launch hooks installed, another Triton's internals) calls take the normal
path.
"""

from __future__ import annotations

import os

import torch

from . import tracing

_INT32 = 2 ** 31


def int_key(v: int):
    """What Triton specializes on for an int argument (a placeholder while traced)."""
    if tracing.active:
        return None
    return 1 if v == 1 else (16 if v % 16 == 0 else 0) + (0 if -_INT32 <= v < _INT32 else 2)


def ptr_key(t: torch.Tensor) -> bool:
    """What Triton specializes on for a pointer argument (besides its dtype)."""
    if tracing.active:
        return None
    return t.data_ptr() % 16 == 0


def args_key(args) -> tuple:
    """A launch key from every argument of a call (for kernels whose
    arguments are few): each tensor's dtype and :func:`ptr_key`, each int's
    :func:`int_key`, any other value (a constexpr) itself."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, ptr_key(a)))
        elif isinstance(a, bool):  # True == 1 as a dict key
            key.append((bool, a))
        elif isinstance(a, int):
            key.append(int_key(a))
        else:
            key.append(a)
    return tuple(key)


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (cached): the grids that stride over
    rows size themselves by it."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grids.  ``triton.cdiv`` is a ``ConstexprFunction`` in
    Triton 3.6 whose Python call costs ~2-3 us; a quantize call needs several."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2``,
    another ``ConstexprFunction`` (~6 us a call)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class _Handle:
    """The launch entry of one compiled kernel (Triton 3.x ``CompiledKernel``).

    ``launch`` is the C function of Triton's launcher module when the kernel
    needs no scratch memory (then ``CudaLauncher.__call__`` adds nothing but
    a Python frame); ``prefix`` its leading arguments up to the kernel's."""

    __slots__ = ("compiled", "launch", "prefix")

    def __init__(self, compiled):
        self.compiled = compiled
        run = compiled.run  # initialises the module on first access
        function, metadata = compiled.function, compiled.packed_metadata
        raw = getattr(run, "launch", None)
        if (type(raw).__name__ == "builtin_function_or_method"
                and not getattr(run, "global_scratch_size", 1)
                and not getattr(run, "profile_scratch_size", 1)):
            self.launch = raw
            self.prefix = (function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                           metadata, None, None, None)
        else:
            self.launch = run
            self.prefix = (function, metadata, None, None, None)


def _hook_set(hook) -> bool:
    """Triton 3.6 keeps launch hooks in an always-present ``HookChain``
    (empty unless something added a hook); older versions use None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    """Whether Triton-level launch hooks (e.g. proton) want to see launches:
    then keep ``kernel[grid]``, which calls them.  Checked when a handle is
    created; torch.profiler does not rely on these hooks."""
    try:
        from triton import knobs
        return (_hook_set(knobs.runtime.launch_enter_hook)
                or _hook_set(knobs.runtime.launch_exit_hook))
    except (ImportError, AttributeError):  # pragma: no cover - other Triton versions
        return True


class Launcher:
    """A ``@triton.jit`` function with a per-key cache of compiled handles."""

    check = os.environ.get("TE_COMPILE_CHECK_LAUNCH", "0") == "1"
    enabled = os.environ.get("TE_COMPILE_FAST_LAUNCH", "1") == "1"  # 0: always kernel[grid]

    def __init__(self, fn, num_warps: int = 8):
        self.fn = fn
        self.num_warps = num_warps
        self.handles: dict = {}

    def __call__(self, grid: tuple, key: tuple, *args) -> None:
        """Launch ``fn[grid](*args)``; ``args`` are every parameter in
        signature order (constexprs included), ``key`` as the module says.
        While traced (kernels/tracing.py) the launch is recorded instead."""
        if tracing.active:
            torch.library.wrap_triton(self.fn)[grid](*args, num_warps=self.num_warps)
            return
        device = torch._C._cuda_getDevice() if args[0].is_cuda else -1
        key = (device, key)
        entry = self.handles.get(key)
        if entry is None or entry is False or self.check or not self.enabled:
            compiled = self.fn[grid](*args, num_warps=self.num_warps)
            if entry is None:
                self.handles[key] = self._handle(compiled)
            elif entry is not False and entry.compiled is not compiled:
                raise RuntimeError(f"{self.fn.__name__}: launch key {key} maps to two "
                                   "compiled kernels; the key misses an argument Triton "
                                   "specializes on")
            return
        entry.launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     torch._C._cuda_getCurrentRawStream(device), *entry.prefix, *args)

    @staticmethod
    def _handle(compiled):
        """A handle, or False: keep using ``kernel[grid]`` for this key."""
        if compiled is None or _hooks_installed():  # interpreter / profiling hooks
            return False
        try:
            return _Handle(compiled)
        except AttributeError:  # pragma: no cover - a Triton without these internals
            return False
