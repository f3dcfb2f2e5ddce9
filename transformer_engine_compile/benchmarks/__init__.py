"""Benchmarks, run with ``python -m``; each prints ratios against baselines
run side by side in one process (docs/benchmarks.md).

* ``transformer_engine_compile.benchmarks`` (:mod:`.compare`): single layers,
  whole training steps (``--configs llama-a llama-b hf-llama-a hf-llama-b``)
  and host time per op call (``--configs host``) against ``torch.nn.Linear``
  bf16 and torchao;
* ``.benchmarks.norm``: the LayerNorm modules' host time and kernels;
* ``.benchmarks.fsdp`` and ``.benchmarks.tp`` (under ``torchrun``): whole
  steps under FSDP2 and under tensor parallelism, ``--profile`` for where a
  step's time goes (:mod:`.step_profile`);
* ``.benchmarks.moe``: mixture-of-experts blocks (router, permutation,
  te.GroupedExperts) per recipe against the same block on
  ``torch._grouped_mm`` in bf16; ``.benchmarks.grouped_gemm``: the FP8
  blockwise grouped GEMM (CuTeDSL) against bf16 ``torch._grouped_mm`` on
  those blocks' expert GEMMs;
* ``.benchmarks.convergence``: a 100M-parameter Llama trained for 2,000
  steps on the standard library's bytes in bf16 and every recipe, the
  loss curves compared (also under FSDP2 with ``torchrun ... --fsdp``);
* ``.benchmarks.plots``: docs/benchmarks.md's figures from docs/results.

The library never imports this package (``.importlinter``).
"""
