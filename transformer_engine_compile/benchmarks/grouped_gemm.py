"""The FP8 blockwise grouped GEMM (CuTeDSL, ``kernels/blockwise_grouped.py``)
against bf16 ``torch._grouped_mm`` on the expert GEMMs of ``benchmarks.moe``'s
configs, one kernel at a time, side by side in one process.

    python -m transformer_engine_compile.benchmarks.grouped_gemm [--configs mixtral deepseek qwen3]

Per config, the gate/up and the down projection, each as fprop (groups
along the rows: ``x W^T``) and wgrad (groups along the tokens: ``dy^T x``),
with the tokens routed evenly; the FP8 operands carry their block scales
(1x128, weights 128x128).  Prints ms, TFLOPS and the ratio to bf16.  Needs
a Hopper GPU and ``nvidia-cutlass-dsl``; elsewhere it says why and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from .moe import CONFIGS

TILE = 128


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    groups: int
    rows: int   # routed tokens: tokens x top-k
    k: int      # fprop's reduced dim (the layer's input features)
    n: int      # the layer's output features

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.k * self.n


def shapes(config: str) -> list:
    """The expert GEMMs of a ``benchmarks.moe`` config: gate/up (hidden ->
    2 ffn) and down (ffn -> hidden) over every routed token."""
    cfg = CONFIGS[config]
    rows = cfg.tokens * cfg.top_k
    return [Shape(f"{config} gate_up", cfg.experts, rows, cfg.hidden, 2 * cfg.ffn),
            Shape(f"{config} down", cfg.experts, rows, cfg.ffn, cfg.hidden)]


def _ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _fprop(s: Shape, per: int) -> tuple:
    """(kernel ms, bf16 ms) of ``x W^T`` with the rows grouped by expert."""
    from ..kernels import blockwise_grouped as bg

    dev = "cuda"
    a = torch.randn(s.rows, s.k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(s.groups, s.n, s.k, device=dev).to(torch.float8_e4m3fn)
    sa = torch.ones(s.k // TILE, s.rows, device=dev).t()
    sb = torch.ones(s.groups, s.n // TILE, s.k // TILE, device=dev)
    sched = (torch.arange(s.rows // TILE, device=dev) * TILE // per).int()
    ident = torch.arange(s.rows, device=dev, dtype=torch.int32)
    kernel = _ms(lambda: bg.grouped_gemm(a, b, sa, sb, sched, False, torch.bfloat16,
                                         ident, ident))
    ab, bb = a.bfloat16(), b.bfloat16()
    offs = torch.arange(1, s.groups + 1, device=dev, dtype=torch.int32) * per
    return kernel, _ms(lambda: torch._grouped_mm(ab, bb.transpose(-2, -1), offs=offs))


def _wgrad(s: Shape, per: int) -> tuple:
    """(kernel ms, bf16 ms) of ``dy^T x`` with the tokens grouped by expert."""
    from ..kernels import blockwise_grouped as bg

    dev = "cuda"
    dy_t = torch.randn(s.n, s.rows, device=dev).to(torch.float8_e4m3fn)
    x_t = torch.randn(s.k, s.rows, device=dev).to(torch.float8_e4m3fn)
    sa = torch.ones(s.rows // TILE, s.n, device=dev).t()
    sb = torch.ones(s.rows // TILE, s.k, device=dev).t()
    k_tiles = (torch.stack([torch.arange(s.groups), torch.arange(1, s.groups + 1)], 1)
               * (per // TILE)).int().to(dev)
    kernel = _ms(lambda: bg.grouped_gemm(dy_t, x_t, sa, sb, k_tiles, True, torch.bfloat16))
    dyb, xb = dy_t.bfloat16(), x_t.bfloat16().t().contiguous()
    offs = torch.arange(1, s.groups + 1, device=dev, dtype=torch.int32) * per
    return kernel, _ms(lambda: torch._grouped_mm(dyb, xb, offs=offs))


def time_shape(s: Shape) -> list:
    """Rows ``{"gemm", "kernel_ms", "bf16_ms", ...}`` for fprop and wgrad."""
    per = s.rows // s.groups
    if per % TILE:
        raise ValueError(f"{s.name}: {per} tokens per expert is no whole number of 128-tiles")
    rows = []
    for what, timer in (("fprop", _fprop), ("wgrad", _wgrad)):
        kernel, ref = timer(s, per)
        torch.cuda.empty_cache()
        rows.append({"gemm": f"{s.name} {what}", "kernel_ms": kernel, "bf16_ms": ref,
                     "kernel_tflops": s.flops / kernel / 1e9, "bf16_tflops": s.flops / ref / 1e9,
                     "x_bf16": ref / kernel})
    return rows


def format_row(r: dict) -> str:
    return (f"{r['gemm']:>24}  kernel {r['kernel_ms']:7.3f} ms {r['kernel_tflops']:5.0f} TFLOPS"
            f"  bf16 {r['bf16_ms']:7.3f} ms {r['bf16_tflops']:5.0f} TFLOPS  {r['x_bf16']:5.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["mixtral", "deepseek", "qwen3"],
                        choices=sorted(c for c in CONFIGS if c != "tiny"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from ..kernels.blockwise_grouped import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"the FP8 blockwise grouped GEMM cannot run here: {why}")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for config in args.configs:
        for s in shapes(config):
            for r in time_shape(s):
                rows.append(r)
                print(format_row(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
