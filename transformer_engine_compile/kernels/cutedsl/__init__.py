"""Kernels written with NVIDIA's CuTe DSL (``nvidia-cutlass-dsl``).

Nothing here is imported until a ``run_kernel`` family builds its runner
(``kernels/runner.py``): the package imports without the DSL, and on CPU.
"""
