"""Zeroed counter slots for kernels whose programs wait for each other.

Current scaling needs the amax of the whole tensor before any element is
cast.  Done in one launch (``triton_current._fp8_current_kernel``), the
programs share a few counters: they claim amax tiles from one counter, count
the finished ones on another, wait until all are done, and the last program
to leave zeroes the slot again.  A launch saved per quantization is ~11-13
us of host time in a lowered llama-a step, 56 per step (``benchmarks --configs
llama-a`` on an H200).

The counters must be zero when the kernel starts, and zeroing a fresh buffer
would cost the launch saved.  So they live in a persistent, zero-initialised
pool per device, never freed, which every kernel leaves zeroed.  Each slot
serves one kernel at a time; kernels queued on one stream run one after the
other, so the slot a kernel uses is:

* run eagerly (op impls): one slot per CUDA stream, so kernels on two
  streams (FSDP's all-gather stream) never share one.  Not while a CUDA
  graph is captured: a replay costs no host time, and on the GPU the two
  launches are the faster (llama-a on an H200: 1.42 against 1.63 ms of
  quantization per step);
* traced into a lowered graph (``kernels/tracing.py``): a slot per traced
  call, cycling through the rest of the pool.  The graph keeps the slot's
  address as a constant, so the op call puts the pool's address into its
  simple values first (``dynamo/lowering.py``, ``pool_token``): the compile
  caches then never serve code with another process's address, and a call
  whose graph does not name the pool (AOTInductor, whose code leaves the
  process; a pool made after Dynamo traced the call; a graph compiled for
  CUDA graphs, for the reason above) keeps two launches.
  One compiled graph run on two streams at the same time (two threads
  calling it) would share its slots: the one case not covered.

A slot's address reaches Triton as two ints below 2**31 (``lo``, ``hi``):
inductor's launcher of user kernels takes no pointer that is not a tensor,
and an int above int32 fails in its signature code (torch 2.11).
"""

from __future__ import annotations

import threading

import torch

from . import tracing

SLOT_BYTES = 512  # each counter on its own 128-byte line (see the kernel)
STREAM_SLOTS = 256  # slots [0, 256): one per stream; then the traced calls'
POOL_SLOTS = 4096

_POOLS: dict = {}  # (device type, index) -> zeroed int32 pool
_STREAMS: dict = {}  # (device index, raw stream) -> slot
_NEXT_TRACED = [STREAM_SLOTS]
_traced = threading.local()


def pool(device: torch.device) -> torch.Tensor:
    """The device's pool, allocated (zeroed) on first use, outside any trace."""
    key = (device.type, device.index)
    t = _POOLS.get(key)
    if t is None:
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            t = torch.zeros(POOL_SLOTS * SLOT_BYTES // 4, dtype=torch.int32, device=device)
        _POOLS[key] = t
    return t


def pool_address(device_type: str, index) -> int:
    """The address of the pool of a CUDA device (made now if need be), else 0."""
    if device_type != "cuda":
        return 0
    index = torch.cuda.current_device() if index is None else index
    return pool(torch.device("cuda", index)).data_ptr()


def traced_pool(address):
    """Context: while a lowered call is traced, the pool address its graph
    names (None or 0: none, the call keeps two-launch kernels)."""
    return tracing.thread_local_value(_traced, "address", address)


def _aot_compiling() -> bool:
    try:
        from torch._inductor.virtualized import V
        return bool(V.aot_compilation)
    except (ImportError, AttributeError):  # pragma: no cover - another torch
        return True


def _next_traced_slot() -> int:
    slot = _NEXT_TRACED[0]
    _NEXT_TRACED[0] = STREAM_SLOTS + (slot + 1 - STREAM_SLOTS) % (POOL_SLOTS - STREAM_SLOTS)
    return slot


def slot(device: torch.device):
    """``(lo, hi)``, the halves of a free slot's address for a kernel about
    to launch (or be traced) on ``device``; None where none may be used."""
    if tracing.active:
        base = getattr(_traced, "address", None)
        made = _POOLS.get((device.type, device.index))
        if not base or made is None or made.data_ptr() != base or _aot_compiling():
            return None
        index = _next_traced_slot()
    elif torch.cuda.is_current_stream_capturing():
        return None  # a replay costs no host time, and two launches less GPU time
    else:
        base = pool(device).data_ptr()
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
        index = _STREAMS.get(key)
        if index is None:
            if len(_STREAMS) >= STREAM_SLOTS:
                return None
            index = _STREAMS[key] = len(_STREAMS)
    address = base + index * SLOT_BYTES
    return address & 0x7FFFFFFF, address >> 31
