"""The step breakdown of a profiler trace (benchmarks.step_profile): stream busy
times, exposed collectives and host ranges of a hand-made Chrome trace
whose answer is known."""

import json

import pytest

from transformer_engine_compile.benchmarks import step_profile as bp


def _kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}


def test_summary_of_a_known_trace(tmp_path):
    # compute stream 7: gemm 0-100 us, gemm 150-250 (a 50 us gap), a memset 250-260
    # NCCL stream 20: all-gather 80-180 (30 us of it inside the gap 100-150... 50 exposed)
    #                 reduce-scatter 300-340 (after compute ended: all exposed)
    # side stream 9: a cast 10-30; host ranges on the CPU
    events = [
        _kernel("sm90_gemm", 0, 100, 7),
        _kernel("sm90_gemm", 150, 100, 7),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 250, "dur": 10,
         "args": {"stream": 7}},
        _kernel("ncclDevKernel_AllGather_RING_LL", 80, 100, 20),
        _kernel("ncclDevKernel_ReduceScatter_Sum_bf16", 300, 40, 20),
        _kernel("cast_kernel", 10, 20, 9),
        # a sync all-reduce on the compute stream, after its last kernel
        _kernel("ncclDevKernel_AllReduce_Max_f32", 330, 5, 7),
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward", "ts": 50, "dur": 20},
        {"ph": "X", "cat": "user_annotation", "name": "te.fsdp.pre_all_gather", "ts": 5,
         "dur": 10},
        # the host blocks on the GPU twice (an async copy does not block)
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 95, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 120, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 130, "dur": 5},
        {"ph": "i", "name": "instant"},  # not a range: ignored
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = bp.summarize(str(path))
    assert s["step"] == pytest.approx(0.340)  # 0 to 340 us
    assert s["compute"] == pytest.approx(0.210)
    assert s["compute_idle"] == pytest.approx(0.130)
    assert s["nccl"] == pytest.approx(0.140)  # the all-reduce lies inside the reduce-scatter
    # all-gather 80-180 outside compute: 100-150 (50 us); reduce-scatter 40 us
    assert s["nccl_exposed"] == pytest.approx(0.090)
    assert s["nccl_by_kind"] == pytest.approx(
        {"AllGather": 0.100, "ReduceScatter": 0.040, "AllReduce": 0.005})
    assert s["side"] == pytest.approx({"9": 0.020})
    assert s["kernels"][0] == ("sm90_gemm", 2, pytest.approx(0.200))
    assert s["host"][0] == ("FSDP::pre_forward", 2, pytest.approx(0.060))
    assert s["waits"] == [("cudaStreamSynchronize", 2, pytest.approx(0.050))]
    text = bp.format_summary("case", s)
    assert "compute stream busy 0.21, idle 0.13" in text and "| sm90_gemm | 2 | 0.20 |" in text
    assert "| cudaStreamSynchronize | 2 | 0.05 |" in text


def test_interval_arithmetic():
    a = bp._union([(0, 10), (5, 15), (20, 30)])
    assert a == [[0, 15], [20, 30]] and bp._length(a) == 25
    b = bp._union([(2, 4), (12, 22)])
    # a outside b: 0-2, 4-12, 22-30
    assert bp._minus(a, b) == pytest.approx(2 + 8 + 8)
    assert bp._minus(a, []) == 25 and bp._minus([], b) == 0


def test_no_gpu_events_gives_an_empty_summary(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    assert bp.summarize(str(path)) == {}
    assert "(no GPU events)" in bp.format_summary("cpu", {})
