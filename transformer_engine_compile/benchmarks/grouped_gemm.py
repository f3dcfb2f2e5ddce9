"""The FP8 blockwise grouped GEMM (CuTeDSL, ``kernels/blockwise_grouped.py``)
against bf16 ``torch._grouped_mm`` on the expert GEMMs of ``benchmarks.moe``'s
configs, one kernel at a time, side by side in one process.

    python -m transformer_engine_compile.benchmarks.grouped_gemm [--configs mixtral deepseek qwen3] \
        [--tokens 8192 32768]
    python -m transformer_engine_compile.benchmarks.grouped_gemm --dense hf-llama-a hf-llama-b

``--dense``: the dense ``te.Linear`` GEMMs of ``benchmarks.llama``'s
configs instead, the kernel run as one group, against what te.Linear runs
for them: bf16 ``torch.mm``, FP8 per-tensor ``torch._scaled_mm`` and
cuBLAS's FP8 blockwise GEMM (``Float8BlockScaling``'s path); each timed
as 20 calls captured in one CUDA graph, so the GPU's time alone.

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

from .moe import CONFIGS, config_with_tokens, token_count

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


def shapes(config: str, tokens=None) -> list:
    """The expert GEMMs of a ``benchmarks.moe`` config (at ``tokens`` per
    step where given): gate/up (hidden -> 2 ffn) and down (ffn -> hidden)
    over every routed token."""
    cfg = config_with_tokens(config, tokens)
    rows = cfg.tokens * cfg.top_k
    name = config if tokens is None else f"{config}@{tokens}"
    return [Shape(f"{name} gate_up", cfg.experts, rows, cfg.hidden, 2 * cfg.ffn),
            Shape(f"{name} down", cfg.experts, rows, cfg.ffn, cfg.hidden)]


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


def _fprop_operands(s: Shape, per: int) -> tuple:
    """The kernel's fprop arguments after its two operands: unit block
    scales, each 128-row tile's expert (``per`` rows each), the identity
    row maps, bf16 output."""
    dev = "cuda"
    ident = torch.arange(s.rows, device=dev, dtype=torch.int32)
    return (torch.ones(s.k // TILE, s.rows, device=dev).t(),
            torch.ones(s.groups, s.n // TILE, s.k // TILE, device=dev),
            (torch.arange(s.rows // TILE, device=dev) * TILE // per).int(), False,
            torch.bfloat16, ident, ident)


def _wgrad_operands(s: Shape, per: int) -> tuple:
    """The kernel's wgrad arguments after its two operands: unit block
    scales along the tokens, each expert's first and end token tile."""
    dev = "cuda"
    k_tiles = (torch.stack([torch.arange(s.groups), torch.arange(1, s.groups + 1)], 1)
               * (per // TILE)).int().to(dev)
    return (torch.ones(s.rows // TILE, s.n, device=dev).t(),
            torch.ones(s.rows // TILE, s.k, device=dev).t(), k_tiles, True, torch.bfloat16)


def _fprop(s: Shape, per: int) -> tuple:
    """(kernel ms, bf16 ms) of ``x W^T`` with the rows grouped by expert."""
    from ..kernels import blockwise_grouped as bg

    dev = "cuda"
    a = torch.randn(s.rows, s.k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(s.groups, s.n, s.k, device=dev).to(torch.float8_e4m3fn)
    args = _fprop_operands(s, per)
    kernel = _ms(lambda: bg.grouped_gemm(a, b, *args))
    ab, bb = a.bfloat16(), b.bfloat16()
    offs = torch.arange(1, s.groups + 1, device=dev, dtype=torch.int32) * per
    return kernel, _ms(lambda: torch._grouped_mm(ab, bb.transpose(-2, -1), offs=offs))


def _wgrad(s: Shape, per: int) -> tuple:
    """(kernel ms, bf16 ms) of ``dy^T x`` with the tokens grouped by expert."""
    from ..kernels import blockwise_grouped as bg

    dev = "cuda"
    dy_t = torch.randn(s.n, s.rows, device=dev).to(torch.float8_e4m3fn)
    x_t = torch.randn(s.k, s.rows, device=dev).to(torch.float8_e4m3fn)
    args = _wgrad_operands(s, per)
    kernel = _ms(lambda: bg.grouped_gemm(dy_t, x_t, *args))
    dyb, xb = dy_t.bfloat16(), x_t.bfloat16().t().contiguous()
    offs = torch.arange(1, s.groups + 1, device=dev, dtype=torch.int32) * per
    return kernel, _ms(lambda: torch._grouped_mm(dyb, xb, offs=offs))


def dense_shapes(config: str) -> list:
    """The projections of a ``benchmarks.llama`` config as one-group shapes
    (``rows``: the step's tokens): q and o, k and v, gate and up, down, and
    a Hugging Face config's LM head."""
    from .llama import ALL_LLAMA

    cfg = ALL_LLAMA[config]
    kv = cfg.kv_heads * (cfg.hidden // cfg.heads)
    out = [Shape(f"{config} q/o", 1, cfg.tokens, cfg.hidden, cfg.hidden),
           Shape(f"{config} k/v", 1, cfg.tokens, cfg.hidden, kv),
           Shape(f"{config} gate/up", 1, cfg.tokens, cfg.hidden, cfg.ffn),
           Shape(f"{config} down", 1, cfg.tokens, cfg.ffn, cfg.hidden)]
    if cfg.vocab:
        out.append(Shape(f"{config} lm_head", 1, cfg.tokens, cfg.hidden, cfg.vocab))
    return out


def _graph_ms(fn, iters: int = 20) -> float:
    """GPU ms per call of ``fn``: ``iters`` calls captured in one CUDA graph
    (after an eager call, which compiles what needs compiling), replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return _ms(graph.replay, 3) / iters


def time_dense(s: Shape) -> list:
    """Rows ``{"gemm", "bf16_ms", "fp8_tensorwise_ms", "cublas_blockwise_ms",
    "kernel_ms", ...}`` for fprop (``x W^T``) and wgrad (``dy^T x``)."""
    import transformer_engine_compile as te

    from ..kernels import blockwise_grouped as bg
    from ..quantization.gemm import gemm

    def block(t, dim):
        return te.Float8BlockQuantizer(block_scaling_dim=dim, rowwise_usage=True,
                                       columnwise_usage=True)(t)

    dev, m, k, n = "cuda", s.rows, s.k, s.n
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    qx, qw, qdy = block(x, 1), block(w, 2), block(dy, 1)
    one = torch.ones((), device=dev)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    dy_t8, x_t8 = (t.t().contiguous().to(torch.float8_e4m3fn) for t in (dy, x))
    # the kernel's other arguments, one group (made here, not inside the
    # captured calls)
    f_args, w_args, w8_groups = _fprop_operands(s, m), _wgrad_operands(s, m), w8[None]
    fprop = {
        "bf16": lambda: torch.mm(x, w.t()),
        "fp8_tensorwise": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                   use_fast_accum=True),
        "cublas_blockwise": lambda: gemm(qx, "rowwise", qw, "rowwise", torch.bfloat16),
        "kernel": lambda: bg.grouped_gemm(x8, w8_groups, *f_args),
    }
    wgrad = {
        "bf16": lambda: torch.mm(dy.t(), x),
        "fp8_tensorwise": lambda: torch._scaled_mm(dy_t8, x_t8.t(), one, one,
                                                   out_dtype=torch.bfloat16),
        "cublas_blockwise": lambda: gemm(qdy, "columnwise", qx, "columnwise", torch.bfloat16),
        "kernel": lambda: bg.grouped_gemm(dy_t8, x_t8, *w_args),
    }
    rows = []
    for what, fns in (("fprop", fprop), ("wgrad", wgrad)):
        r = {"gemm": f"{s.name} {what}"}
        for name, fn in fns.items():
            try:
                r[f"{name}_ms"] = _graph_ms(fn)
            except RuntimeError as e:  # not capturable: timed eagerly, and said so
                torch.cuda.synchronize()
                r[f"{name}_ms"], r[f"{name}_eager"] = _ms(fn), str(e).splitlines()[0]
        r["kernel_x_cublas"] = r["cublas_blockwise_ms"] / r["kernel_ms"]
        r["blockwise_x_tensorwise"] = r["fp8_tensorwise_ms"] / r["cublas_blockwise_ms"]
        rows.append(r)
    return rows


def format_dense_row(r: dict) -> str:
    return (f"{r['gemm']:>26}  bf16 {r['bf16_ms']:6.3f}  fp8 tensorwise "
            f"{r['fp8_tensorwise_ms']:6.3f}  cuBLAS blockwise {r['cublas_blockwise_ms']:6.3f}  "
            f"kernel {r['kernel_ms']:6.3f} ms  kernel x cuBLAS {r['kernel_x_cublas']:5.2f}"
            + "".join(f"  ({k[:-6]} timed eagerly: {v})" for k, v in r.items()
                      if k.endswith("_eager")))


def time_shape(s: Shape) -> list:
    """Rows ``{"gemm", "kernel_ms", "bf16_ms", ...}`` for fprop and wgrad."""
    per = s.rows // s.groups
    if s.rows % s.groups or per % TILE:
        raise ValueError(f"{s.name}: {s.rows / s.groups:g} tokens per expert is no whole "
                         "number of 128-tiles")
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
    parser.add_argument("--dense", nargs="+", default=None, metavar="LLAMA_CONFIG",
                        help="the dense te.Linear GEMMs of these benchmarks.llama configs "
                             "instead (e.g. hf-llama-a hf-llama-b)")
    parser.add_argument("--tokens", type=token_count, nargs="+", default=[None], metavar="N",
                        help="tokens per step instead of each config's own, one run of "
                             "the configs per count (each expert's share a whole number "
                             "of 128-tiles)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.dense:
        from .llama import ALL_LLAMA
        unknown = [c for c in args.dense if c not in ALL_LLAMA]
        if unknown:
            parser.error(f"--dense: unknown configs {unknown} (choose from {sorted(ALL_LLAMA)})")
    from ..kernels.blockwise_grouped import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"the FP8 blockwise grouped GEMM cannot run here: {why}")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    if args.dense:
        for config in args.dense:
            for s in dense_shapes(config):
                for r in time_dense(s):
                    rows.append(r)
                    print(format_dense_row(r), flush=True)
    for config, tokens in [] if args.dense else [(c, t) for c in args.configs
                                                 for t in args.tokens]:
        for s in shapes(config, tokens):
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
