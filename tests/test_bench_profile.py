"""The step breakdown of a profiler trace (benchmarks.step_profile): stream busy
times, exposed collectives and host ranges of a hand-made Chrome trace
whose answer is known."""

import json

import pytest
import torch

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
    assert s["kernel_count"] == 3  # the compute stream's two GEMMs and its memset
    assert s["classes"] == pytest.approx({"GEMM": 0.200, "other": 0.010})
    assert s["host"][0] == ("FSDP::pre_forward", 2, pytest.approx(0.060))
    assert s["waits"] == [("cudaStreamSynchronize", 2, pytest.approx(0.050))]
    text = bp.format_summary("case", s)
    assert "compute stream busy 0.21, idle 0.13" in text and "| sm90_gemm | 2 | 0.20 |" in text
    assert "| cudaStreamSynchronize | 2 | 0.05 |" in text
    assert "compute-stream kernels: 3; by class (ms): GEMM 0.20, other 0.01" in text


@pytest.mark.parametrize("name, label", [
    ("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>", "GEMM"),
    ("_nvfp4_gemm_kernel", "GEMM"),  # the emulated NVFP4 product
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
    ("triton_red_fused__to_copy_add_linear_fwd_mean_mul_pow_rsqrt_11", "inductor"),
    ("_fp8_current_kernel", "te quantization"),
    ("_amax_partials_kernel", "te quantization"),
    ("_mxfp8_pair_kernel", "te quantization"),
    ("_norm_fwd_kernel", "te norm / activation / bias"),
    ("Memset (Device)", "other"),
])
def test_kernel_classes(name, label):
    assert bp.kernel_class(name) == label


def test_every_registered_triton_kernel_has_a_class():
    """A new kernel of the library's own falls into a named class, not
    "other" (the launch handles name every kernel the library launches)."""
    import re
    from pathlib import Path

    import transformer_engine_compile.kernels as k

    names = set()
    for f in Path(k.__file__).parent.glob("triton_*.py"):
        names |= set(re.findall(r"Launcher\((_\w+_kernel)", f.read_text()))
    assert len(names) > 20
    assert {n for n in names if bp.kernel_class(n) == "other"} == set()


def test_profile_row_without_gpu_events():
    from transformer_engine_compile.benchmarks import llama

    row, lines = {"config": "c", "candidate": "x", "mode": "eager"}, []
    llama.profile_row(row, lambda x, t: float((x * t).sum()), torch.ones(2), torch.ones(2),
                      lines.append)
    assert row["profile"] == {} and "(no GPU events)" in lines[0]


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
