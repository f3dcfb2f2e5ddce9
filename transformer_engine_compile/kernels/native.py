"""The native (C++) eager path's extension: building it, describing launches.

``native_linear.cpp`` runs an eager ``te.Linear`` call (module/linear/native.py
says which) as one C++ call whose backward is a C++ autograd node, and
``native_norm.cpp`` the normalisation of an eager ``te.LayerNormLinear``
(module/layernorm/linear_native.py) the same way: the
Python eager path costs ~150 us of Python per layer forward + backward, and
the autograd engine runs a Python backward on its device thread, which ran
that Python up to 2x slower on the lent H200 hosts (``benchmarks --configs
host``).  The C++ side launches the very Triton kernels the
Python path compiled, through the driver, with the arguments a plan fixed
(:func:`launch_spec`), and calls torch's ``_scaled_mm`` as the Python path
does, so both give the same bits.  ``native_alloc.cpp`` also serves the
Python op impls: their outputs from one call (:func:`empty_many`).

The extension is compiled with torch's extension loader on first use, in a
background thread (about half a minute, once per machine: torch caches the
build), and the Python path runs until it is ready.  CUDA only; without a
compiler, CUDA headers or Triton, or with ``TE_COMPILE_NATIVE=0``, nothing
is built and the Python path runs.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading
import time
import warnings

import torch

from . import tracing, triton_launch

ENABLED = os.environ.get("TE_COMPILE_NATIVE", "1") == "1"
_DIR = os.path.dirname(__file__)
_SOURCES = [os.path.join(_DIR, name) for name in (
    "native_linear.cpp", "native_linear_grads.cpp", "native_linear_op.cpp", "native_norm.cpp",
    "native_act.cpp", "native_alloc.cpp")]
_HEADERS = [os.path.join(_DIR, name) for name in ("native_common.h", "native_linear.h")]
_KINDS = {"i32": 1, "i64": 2, "fp32": 3}  # native_linear.cpp's Kind; 0 tensor, 4 lo, 5 hi
_SIZES = {0: 8, 1: 4, 2: 8, 3: 4, 4: 4, 5: 4}
_lock = threading.Lock()
_state = {"ext": None, "thread": None, "failed": None}


# torch's extension loader waits for as long as its build directory's lock
# file exists, and a process killed mid-build leaves that file behind: then
# every later process would wait forever (the Python path running meanwhile).
# A build takes about half a minute, so a lock this old is such a leftover.
_STALE_LOCK_S = 600


def _clear_stale_lock(name: str = "te_compile_native") -> bool:
    """Remove the build directory's lock file if it is older than any build
    (:data:`_STALE_LOCK_S`); whether one was removed."""
    try:
        from torch.utils import cpp_extension
        lock = os.path.join(cpp_extension._get_build_directory(name, False), "lock")
        if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            os.remove(lock)
            return True
    except (OSError, AttributeError):  # no lock (the usual case), another torch
        pass
    return False


def _finish_build_at_exit() -> None:
    """At interpreter exit, let a running build finish (the build thread is a
    daemon, killed at exit, which would leave the lock file): at most once
    per machine, a script that ends within the build's half minute waits
    for it, and the next process finds the extension built."""
    thread = _state["thread"]
    if thread is not None and thread.is_alive():
        print("transformer_engine_compile: finishing the native extension's build before "
              "exiting (once per machine)", file=sys.stderr)
        thread.join(timeout=_STALE_LOCK_S)


def _build():
    try:
        from torch.utils import cpp_extension
        _clear_stale_lock()
        # torch rebuilds when a source or a flag changes: the headers' digest is a flag
        sha = hashlib.sha256()
        for header in _HEADERS:
            with open(header, "rb") as f:
                sha.update(f.read())
        digest = sha.hexdigest()[:16]
        ext = cpp_extension.load(name="te_compile_native", sources=_SOURCES,
                                 extra_cflags=["-O2", f"-DTE_NATIVE_COMMON_H={digest}"],
                                 with_cuda=True, verbose=False)
    except Exception as e:  # no compiler, no CUDA headers, a torch without these internals
        _state["failed"] = f"{type(e).__name__}: {e}"
        warnings.warn("transformer_engine_compile: the native eager path could not be "
                      f"built, eager te.Linear stays in Python ({_state['failed'][:300]})")
        return
    _state["ext"] = ext


def extension(wait: bool = False):
    """The built module, or None: still building (the first call starts the
    build in a background thread; ``wait=True`` waits for it), failed, or
    disabled."""
    ext = _state["ext"]
    if ext is not None or not ENABLED or _state["failed"] is not None:
        return ext
    with _lock:
        thread = _state["thread"]
        if thread is None:
            if not (torch.cuda.is_available() and triton_launch.Launcher.enabled):
                _state["failed"] = "no CUDA device or fast launches off"
                return None
            thread = _state["thread"] = threading.Thread(target=_build, daemon=True,
                                                         name="te_compile_native_build")
            atexit.register(_finish_build_at_exit)
            thread.start()
    if wait:
        thread.join()
    return _state["ext"]


def empty_many(like: torch.Tensor, *specs) -> tuple:
    """``torch.empty(shape, dtype=dtype, device=like.device)`` for each
    ``(shape, dtype)`` spec (shape a tuple of ints), each its own allocation.
    On CUDA with the extension built, one C++ call (native_alloc.cpp): about
    1 us per tensor against 3-5 us for ``torch.empty`` from Python; the op
    impls allocate 3-17 outputs per call.  While kernels are traced
    (kernels/tracing.py) the allocations must be ``torch.empty`` calls."""
    if like.is_cuda and not tracing.active:
        ext = _state["ext"] or extension()  # the first call starts the build
        if ext is not None:
            return ext.empty_many(like, *specs)
    return tuple(torch.empty(shape, dtype=dtype, device=like.device) for shape, dtype in specs)


def launch_spec(ext, launcher, device: int, grid: tuple, key: tuple, args: tuple, slots: list):
    """A native ``Launch`` for the kernel ``launcher`` compiled for ``key``
    on CUDA device ``device``,
    with ``args`` (every parameter in signature order) fixed, except the
    tensors, which become indices into ``slots`` (matched by identity), and
    the ints named ``lo`` / ``hi`` (grid_state's counter slot, given per
    call).  None where the compiled kernel is not one this can launch
    (scratch memory, cooperative or cluster launches, a parameter type it
    does not pack) or the driver's parameter layout disagrees."""
    entry = launcher.handles.get((device, key))
    if not entry:
        return None
    compiled = entry.compiled
    md = compiled.metadata
    if (md.global_scratch_size or md.profile_scratch_size or md.launch_cooperative_grid
            or md.launch_pdl or md.num_ctas != 1):
        return None
    index = {}
    for i, t in enumerate(slots):
        index.setdefault(id(t), i)
    kinds, ints, floats = [], [], []
    for (name, ty), value in zip(compiled.src.signature.items(), args):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if id(value) not in index:
                return None
            kinds.append(0), ints.append(index[id(value)]), floats.append(0.0)
        elif name in ("lo", "hi") and ty == "i32":
            kinds.append(4 if name == "lo" else 5), ints.append(0), floats.append(0.0)
        elif ty in _KINDS:
            kinds.append(_KINDS[ty])
            ints.append(int(value) if ty != "fp32" else 0)
            floats.append(float(value) if ty == "fp32" else 0.0)
        else:
            return None
    layout = ext.param_info(compiled.function)
    scratch = len(layout) - len(kinds)
    sizes = [_SIZES[k] for k in kinds] + [8] * scratch
    if not 0 <= scratch <= 2 or [s for _, s in layout] != sizes:
        return None
    return ext.make_launch(compiled.function, list(grid) + [1] * (3 - len(grid)),
                           32 * md.num_warps, md.shared, scratch, kinds, ints, floats)
