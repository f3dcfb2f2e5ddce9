"""What the torchrun benchmarks (``benchmarks.fsdp``, ``benchmarks.tp``) share: the
process group and device of this rank, rank 0's log, the rows written as
JSON, the native extension built before anything is timed, and the same
benchmark spawned on CPU processes for the tests."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import tempfile

import torch
import torch.distributed as dist


def csv(choices):
    """argparse type: a comma-separated list of ``choices``."""
    def parse(text):
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def start(device_name: str) -> tuple:
    """``(device, own_group)``: this rank's device (``LOCAL_RANK``'s GPU, or
    the CPU) and whether the process group was started here (NCCL on
    CUDA, gloo on CPU; one that exists is used as it is)."""
    cuda = device_name == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return device, own_group


@contextlib.contextmanager
def collection_schedule(every: int):
    """torchtitan's garbage-collection policy (``training.gc_freq``) over the
    enclosed steps: yields ``schedule(step) -> step``, whose steps run with
    Python's automatic collection off and collect generation 1 every
    ``every`` steps, on every rank at the same step.  Under data or tensor
    parallelism an automatic collection starts on one rank at a time, mid
    step, and every collective of the other ranks waits for it (tens of
    milliseconds once compiled models fill the heap).  ``every <= 0`` leaves
    Python's automatic collection on."""
    if every <= 0:
        yield lambda step: step
        return
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()

    def schedule(step):
        count = [0]

        def scheduled(*args, **kwargs):
            count[0] += 1
            if count[0] % every == 0:
                gc.collect(1)
            return step(*args, **kwargs)
        return scheduled

    try:
        yield schedule
    finally:
        if enabled:
            gc.enable()


def add_gc_argument(parser) -> None:
    """``--gc-every``: :func:`collection_schedule`'s ``every``."""
    parser.add_argument("--gc-every", type=int, default=50,
                        help="Python garbage collection as torchtitan schedules it: automatic "
                             "collection off, generation 1 collected every N steps on every "
                             "rank (default 50, torchtitan's gc_freq); 0: Python's automatic "
                             "collection")


def rank0_log():
    """``log(text)``: printed (and flushed) by rank 0 only."""
    if dist.get_rank() == 0:
        return lambda text: print(text, flush=True)
    return lambda text: None


def machine(device: torch.device) -> str:
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu (a smoke run: times mean nothing)")


def native_first(device: torch.device, log) -> None:
    """On CUDA, build (or load) the native eager extension before anything
    is timed: a build in the background would share the host with the
    timed steps."""
    if device.type != "cuda":
        return
    from ..kernels import native

    ext = native.extension(wait=True)
    log("native eager path: " + ("built" if ext is not None
                                 else f"not used ({native._state['failed'] or 'disabled'})"))


def save_rows(path, device, rows) -> None:
    """Rank 0 writes the rows (with the machine, torch and world size) to ``path``."""
    if path and dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"machine": machine(device), "torch": torch.__version__,
                       "world_size": dist.get_world_size(), "rows": rows}, f, indent=1)


def table_row(row: dict, cells) -> str:
    """A markdown row: config, candidate and mode, then ``cells(row)`` (the
    benchmark's own columns, joined by ``|``), or the row's error."""
    head = f"| {row['config']} | {row['candidate']} | {row['mode']} |"
    if "error" in row:
        return f"{head} ERROR: {row['error'].replace('|', '/')} |"
    return f"{head} {cells(row)} |"


def add_row(rows: list, row: dict, measure, baseline: str, format_row, log, device) -> None:
    """``row`` filled with ``measure()``'s fields and its ratio to
    ``baseline`` in the same mode (or the error: one failing candidate must
    not hide the others), appended to ``rows`` and logged; then the
    candidate's compiled code and memory are let go."""
    from . import llama

    try:
        row.update(measure())
        row["x_bf16"] = llama._ratio(rows + [row], row, baseline, row["mode"])
    except Exception as e:
        row["error"] = llama.error_text(e)
    rows.append(row)
    log(format_row(row))
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_rows(configs, candidates, modes, only, measure, baseline: str, header: str, format_row,
             log, device) -> list:
    """Every (config, candidate, mode) row: ``candidates`` are tuples whose
    first item is the label (those not in ``only``, when given, are
    skipped), ``measure(config, candidate, mode)`` a row's fields."""
    rows = []
    for cname in configs:
        log(header)
        for cand in candidates:
            if only and cand[0] not in only:
                continue
            for mode in modes:
                add_row(rows, {"config": cname, "candidate": cand[0], "mode": mode},
                        lambda: measure(cname, cand, mode), baseline, format_row, log, device)
        log("")
    return rows


def run_main(device_name: str, json_path, what: str, body) -> int:
    """A torchrun benchmark's main after its arguments: start this rank,
    log the machine, torch and ``what`` (the run's layout), build the native
    extension, ``rows = body(device, log)``, save the rows, end the process
    group if it was started here.  0 when no row failed, else 1."""
    device, own_group = start(device_name)
    log = rank0_log()
    rows = []
    try:
        log(f"{machine(device)}, torch {torch.__version__}, {what} "
            f"({dist.get_world_size()} ranks, {dist.get_backend()})\n")
        native_first(device, log)
        rows = body(device, log)
        save_rows(json_path, device, rows)
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


def _cpu_worker(rank, world, tmp, main, argv):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        main(["--device", "cpu", *argv, "--json", os.path.join(tmp, "rows.json")])
    finally:
        dist.destroy_process_group()


def cpu_run(main, argv=(), nprocs=2) -> list:
    """Run a benchmark's ``main`` on ``nprocs`` CPU processes (gloo, a file
    store in a temporary directory) with ``argv`` after one warm-up and one
    timed step; returns rank 0's rows."""
    import torch.multiprocessing as mp

    argv = ["--steps", "1", "--warmup", "1", *argv]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_cpu_worker, args=(nprocs, tmp, main, list(argv)), nprocs=nprocs)
        with open(os.path.join(tmp, "rows.json")) as f:
            return json.load(f)["rows"]
