"""Where one training step's time goes, per CUDA stream: a torch.profiler
trace of the step summarised as the benchmarks print it.

Under data parallelism a step's time is the compute stream's kernels, the
collectives on NCCL's streams, the side streams' copies (FSDP2's copy-in
stream: the all-gather inputs, and the quantization the quantized gather
adds) and whatever the compute stream waits for.  :func:`summarize` reads a
Chrome trace (``prof.export_chrome_trace``) and returns, in milliseconds:

* ``step``: the GPU span of the step (first kernel start to last kernel end);
* ``compute``: the compute stream's busy time (the union of its kernels,
  copies and memsets) and ``compute_idle`` (the span less it: what the
  compute stream waited for, collectives it could not overlap or the host);
* ``nccl``: the NCCL kernels' union, ``nccl_exposed`` its part while the
  compute stream was idle, and the time per collective kind;
* ``side``: the other streams' busy time (their kernels listed apart);
* ``kernels``: the compute stream's kernels by total time, and ``classes``
  their total per :data:`KERNEL_CLASSES` class (GEMMs, the library's
  quantization kernels, attention, ...);
* ``host``: the CPU ranges (``record_function`` names: FSDP2's
  ``FSDP::...`` hooks and the ``te.fsdp.*`` extension) by total time;
* ``waits``: the CUDA runtime calls that block the host until the GPU
  catches up (stream, event and device synchronisation, synchronous
  copies, ``cudaFree``), by total time: where a step whose host time
  nears its GPU time waits rather than works.

:func:`profile_step` profiles one training step on every rank of a
distributed benchmark and returns the ranks' summaries.

The compute stream is the one with the most busy time outside NCCL's
kernels (a collective issued with ``async_op=False`` runs on the issuing
stream, so NCCL kernels are told apart by name).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile

import torch
import torch.distributed as dist


def _union(intervals):
    """Merged (start, end) intervals, sorted."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(merged):
    return sum(e - s for s, e in merged)


def _minus(a, b):
    """Length of the merged intervals ``a`` outside the merged intervals ``b``."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


# (class, name patterns), the first match wins: what a single GPU's step
# spends its compute stream on.  The library's own Triton kernels are named
# ``_<what>_kernel`` (kernels/triton_*.py); inductor's start with ``triton_``.
KERNEL_CLASSES = (
    ("GEMM", ("nvjet", "gemm", "Gemm", "xmma", "cutlass", "_nvfp4_epilogue")),
    ("attention", ("sdpa", "flash", "fmha", "attention", "cudnn")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("inductor", ("triton_",)),
    ("te quantization", ("_fp8_", "_amax", "_cast", "_mxfp8", "_nvfp4", "_transpose_kernel",
                         "_grouped_scales", "_delayed_step", "_token_cast", "_stacked_cast")),
    ("te norm / activation / bias", ("_norm_", "_act_", "_bias_add", "_col_sum",
                                     "_row_block_sums")),
)


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a kernel's name ("other" if none)."""
    for label, patterns in KERNEL_CLASSES:
        if any(p in name for p in patterns):
            return label
    return "other"


def _is_nccl(name: str) -> bool:
    return name.startswith("nccl")


# CUDA runtime calls that return only once the GPU has caught up
_BLOCKING = ("Synchronize", "cudaMemcpy", "cudaFree", "cuMemFree", "cuMemcpyDtoH")


def _blocks_host(name: str) -> bool:
    return any(b in name for b in _BLOCKING) and "Async" not in name


def _collective(name: str) -> str:
    for kind in ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv"):
        if kind in name:
            return kind
    return "other"


def summarize(trace_path: str, top: int = 12) -> dict:
    """The step's breakdown from a Chrome trace of one step (see the module
    docstring); times in ms."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    by_stream = collections.defaultdict(list)
    host = collections.Counter()
    host_calls = collections.Counter()
    waits = collections.Counter()
    wait_calls = collections.Counter()
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = ev.get("args", {}).get("stream")
            iv = (ev["ts"] / 1e3, (ev["ts"] + ev["dur"]) / 1e3)
            by_stream[stream].append((iv, ev["name"]))
        elif cat == "user_annotation":
            host[ev["name"]] += ev["dur"] / 1e3
            host_calls[ev["name"]] += 1
        elif cat in ("cuda_runtime", "cuda_driver") and _blocks_host(ev["name"]):
            waits[ev["name"]] += ev["dur"] / 1e3
            wait_calls[ev["name"]] += 1
    # a sync collective (async_op=False) runs on the stream that issued it,
    # the compute stream too: NCCL kernels are told apart by name, not stream
    work = {s: [(iv, n) for iv, n in evs if not _is_nccl(n)] for s, evs in by_stream.items()}
    busy = {s: _union(iv for iv, _ in evs) for s, evs in work.items() if evs}
    if not busy:
        return {}
    compute = max(busy, key=lambda s: _length(busy[s]))
    everything = _union(iv for evs in by_stream.values() for iv, _ in evs)
    step = everything[-1][1] - everything[0][0]
    per_kind = collections.Counter()
    nccl_ivs = []
    for evs in by_stream.values():
        for iv, n in evs:
            if _is_nccl(n):
                nccl_ivs.append(iv)
                per_kind[_collective(n)] += iv[1] - iv[0]
    nccl = _union(nccl_ivs)
    kernels = collections.Counter()
    counts = collections.Counter()
    classes = collections.Counter()
    for (a, b), n in work[compute]:
        kernels[n] += b - a
        counts[n] += 1
        classes[kernel_class(n)] += b - a
    side = collections.Counter()
    side_kernels = collections.Counter()
    for s in busy:
        if s != compute:
            side[str(s)] = _length(busy[s])
            for (a, b), n in work[s]:
                side_kernels[n] += b - a
    return {
        "step": step,
        "compute": _length(busy[compute]),
        "compute_idle": step - _length(busy[compute]),
        "nccl": _length(nccl),
        "nccl_exposed": _minus(nccl, busy[compute]),
        "nccl_by_kind": dict(per_kind),
        "side": dict(side),
        "side_kernels": [(n, t) for n, t in side_kernels.most_common(top)],
        "kernels": [(n, counts[n], t) for n, t in kernels.most_common(top)],
        "kernel_count": sum(counts.values()),
        "classes": dict(classes.most_common()),
        "host": [(n, host_calls[n], t) for n, t in host.most_common(top)],
        "waits": [(n, wait_calls[n], t) for n, t in waits.most_common(top)],
    }


def format_summary(label: str, s: dict) -> str:
    """A readable block of :func:`summarize`'s result."""
    if not s:
        return f"### {label}\n(no GPU events)\n"
    lines = [f"### {label}",
             f"step {s['step']:.2f} ms: compute stream busy {s['compute']:.2f}, idle "
             f"{s['compute_idle']:.2f}; NCCL {s['nccl']:.2f} "
             f"(exposed {s['nccl_exposed']:.2f}; "
             + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["nccl_by_kind"].items())) + ")",
             "side streams: " + (", ".join(f"{k}: {v:.2f}" for k, v in s["side"].items()) or "none"),
             f"compute-stream kernels: {s.get('kernel_count', 0)}; by class (ms): "
             + ", ".join(f"{k} {v:.2f}" for k, v in s.get("classes", {}).items()),
             "", "| compute-stream kernel | calls | ms |", "|---|---:|---:|"]
    lines += [f"| {n[:90]} | {c} | {t:.2f} |" for n, c, t in s["kernels"]]
    lines += ["", "| side-stream kernel | ms |", "|---|---:|"]
    lines += [f"| {n[:90]} | {t:.2f} |" for n, t in s["side_kernels"]]
    lines += ["", "| host range | calls | ms |", "|---|---:|---:|"]
    lines += [f"| {n[:90]} | {c} | {t:.2f} |" for n, c, t in s["host"]]
    lines += ["", "| host waits for the GPU | calls | ms |", "|---|---:|---:|"]
    lines += [f"| {n} | {c} | {t:.2f} |" for n, c, t in s.get("waits", [])] or ["| none | | |"]
    return "\n".join(lines) + "\n"


def trace_step(step, x, target, top: int = 12) -> dict:
    """One step under ``torch.profiler`` (after an unprofiled one) in this
    process, summarised per stream (:func:`summarize`; empty without GPU
    events)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            for _ in range(2):
                step(x, target)
                prof.step()
        return summarize(path, top) if os.path.exists(path) else {}


def profile_step(step, x, target):
    """:func:`trace_step` on every rank of a distributed benchmark, with the
    host's part by Python function: the list of the ranks' summaries, the
    same on every rank."""
    summary = trace_step(step, x, target)
    if summary:  # GPU events: the host's part by Python function too
        summary["python"] = python_profile(step, x, target)
    summaries = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, summary)
    return summaries


def python_profile(step, x, target, top=35) -> str:
    """cProfile of one step, its backward run on the calling thread: the
    functions by own time and by cumulative time (the host's share of a
    host-bound step, by function)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    # the backward on this thread (not the autograd engine's device thread,
    # which cProfile would not see): FSDP2's backward hooks are host work too
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        step(x, target)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    stats.print_callers("sleep|synchronize")  # where the host waits, if anywhere
    return out.getvalue()
