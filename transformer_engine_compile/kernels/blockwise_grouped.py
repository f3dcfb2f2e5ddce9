"""FP8 blockwise grouped GEMM (CuTeDSL on Hopper) as a ``run_kernel`` family.

``torch._scaled_grouped_mm`` takes rowwise scales only on Hopper, so the
GEMMs of ``te.GroupedLinear`` under ``Float8BlockScaling`` (1x128 tiles
for activations and gradients, 128x128 blocks for weights) run this
kernel (``cutedsl/blockwise_grouped_gemm.py``) when
``nvidia-cutlass-dsl`` imports and the GPU is a Hopper; elsewhere the
dequantized path runs (``module/grouped/blocked.py``).

:func:`grouped_gemm` takes torch tensors:

* ``grouped_k=False`` (fprop, dgrad): ``a (rows, K)`` with the groups'
  rows padded to whole 128-row tiles, ``b (groups, N, K)`` (any strides, K
  contiguous), ``scale_a (rows, K/128)``, ``scale_b (groups, N/128, >=
  K/128)``, ``sched (rows/128,)`` int32: each row tile's group, -1 for a
  tile of padding only (skipped); ``sources (rows,)`` int32: the output
  row of each row of ``a`` (-1: padding, not written), ``dest (tokens,)``:
  its inverse (its length is the output's).  Returns ``(tokens, N)``: the
  padding never leaves the kernel.
* ``grouped_k=True`` (wgrad): ``a (M, T)``, ``b (N, T)``, ``scale_a (M,
  T/128)``, ``scale_b (N, T/128)``, ``sched (groups, 2)`` int32: each
  group's first and end 128-tile along T.  Returns ``(groups, M, N)``.

The operands are FP8 (E4M3 or E5M2), rows and N multiples of 128, K
(T) a multiple of 128.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .runner import RUNNERS, KernelConfig, RunnerKind, run_kernel

KIND = "fp8_blockwise_grouped_gemm"
TILE = 128

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
# every configuration, made once: a dict lookup is what torch.compile traces
# (it does not trace the opaque class's constructor)
# the TMA-store wgrad's tile shapes (rows, columns); the others' are 128 x 128
_TMA_STORE_TILES = ((TILE, TILE), (TILE, 192), (192, TILE))
_CONFIGS = {(k, a, b, o, p, t, m, n): KernelConfig.make(KIND, grouped_k=k, a_dtype=str(a),
                                                        b_dtype=str(b), out_dtype=str(o),
                                                        persistent=p, tma_store=t, tile_m=m,
                                                        tile_n=n)
            for k in (False, True) for a in _FP8 for b in _FP8 for o in _OUT
            for p in (False, True) for t in ((False, True) if k and p else (False,))
            for m, n in (_TMA_STORE_TILES if t else ((TILE, TILE),))}
# wgrad's tiles: 192 x 128 with three consumer warpgroups, through the
# TMA-store epilogue (cutedsl/blockwise_grouped_gemm.py)
WGRAD_TILE = (192, TILE)


def config(grouped_k: bool, a_dtype: torch.dtype, b_dtype: torch.dtype,
           out_dtype: torch.dtype, persistent: bool = True,
           tma_store: bool = False, tile_n: int = TILE, tile_m: int = TILE) -> KernelConfig:
    """The kernel's configuration.  ``persistent``: one CTA per SM, each
    looping over tiles and loading the next tile's operands while it
    stores this one, rather than one CTA per tile.  Measured on H200 at
    the Mixtral, DeepSeek-V3 and Qwen3-MoE expert shapes
    (docs/benchmarks.md), persistent CTAs ran fprop 1.05-1.26x faster and
    wgrad up to 1.41x (DeepSeek's 2 K tiles per expert; Mixtral's within
    2%).  One CTA per tile stays as the other schedule, which the GPU
    tests check the persistent one against, bit for bit.

    ``tma_store`` (persistent wgrad only): the epilogue sends the tile out
    with TMA stores that drain while the next tile computes.  ``tile_m`` x
    ``tile_n`` (with ``tma_store``): C's tiles are 128 x 128, 128 x 192 or
    192 x 128 (three consumer warpgroups); a larger tile reads each operand
    tile for more of C, and the TMA loads and stores clip a partial last
    tile.  On H200 the 128 x 192 TMA-store wgrad ran 1.08-1.20x faster than
    the default epilogue on the Mixtral, DeepSeek-V3 and Qwen3-MoE expert
    shapes, and the 192 x 128 one 1.00-1.16x faster than that, bit for bit
    the same (docs/benchmarks.md), so :func:`grouped_gemm` runs every wgrad
    that way (``WGRAD_TILE``)."""
    tma_store = bool(tma_store and grouped_k and persistent)
    if (tile_m, tile_n) != (TILE, TILE) and not tma_store:
        raise ValueError(f"tile_m x tile_n = {tile_m} x {tile_n} is for the TMA-store "
                         "wgrad only")
    key = (bool(grouped_k), a_dtype, b_dtype, out_dtype, bool(persistent), tma_store, tile_m,
           tile_n)
    if key not in _CONFIGS:
        raise TypeError(f"the FP8 blockwise grouped GEMM takes FP8 operands, a "
                        f"{'/'.join(map(str, _OUT))} output and tiles of 128 x 128, "
                        f"128 x 192 or 192 x 128, not {key[1:4]}, {tile_m} x {tile_n}")
    return _CONFIGS[key]


def grouped_gemm(a, b, scale_a, scale_b, sched, grouped_k: bool, out_dtype: torch.dtype,
                 sources=None, dest=None) -> torch.Tensor:
    """The grouped GEMM through ``te_compile::run_kernel`` (shapes: module
    docstring)."""
    tile_m, tile_n = WGRAD_TILE if grouped_k else (TILE, TILE)
    cfg = config(grouped_k, a.dtype, b.dtype, out_dtype, tma_store=grouped_k, tile_m=tile_m,
                 tile_n=tile_n)
    rows = [] if grouped_k else [sources, dest]
    return run_kernel(cfg, [a, b, scale_a, scale_b, sched, *rows])[0]


def reference(a, b, scale_a, scale_b, sched, grouped_k: bool, out_dtype: torch.dtype,
              sources=None, dest=None) -> torch.Tensor:
    """The kernel's result on any device: fp32 GEMMs of the dequantized
    operands (the kernel differs by its accumulation's rounding alone)."""
    def rows(q, s):  # (R, K) with (R, >= K/128) scales
        return q.float() * s[:, :q.shape[1] // TILE].float().repeat_interleave(TILE, 1)

    if grouped_k:
        ad, bd = rows(a, scale_a), rows(b, scale_b)
        out = a.new_zeros((sched.shape[0], a.shape[0], b.shape[0]), dtype=torch.float32)
        for g, (lo, hi) in enumerate(sched.tolist()):
            out[g] = ad[:, lo * TILE:hi * TILE] @ bd[:, lo * TILE:hi * TILE].t()
        return out.to(out_dtype)
    ad = rows(a, scale_a)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32)
    for t, g in enumerate(sched.tolist()):
        if g >= 0:
            bs = scale_b[g][:, :b.shape[2] // TILE].float()
            bd = b[g].float() * bs.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)
            out[t * TILE:(t + 1) * TILE] = ad[t * TILE:(t + 1) * TILE] @ bd.t()
    return out[dest.long()].to(out_dtype)


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """Why the kernel cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the kernel is built for Hopper (sm_90a), not sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        import cutlass.cute  # noqa: F401
    except Exception as e:  # ImportError, or a DSL that cannot load its libraries
        return f"nvidia-cutlass-dsl does not import ({type(e).__name__}: {e}); pip install -e '.[cutedsl]'"
    return None


def _out_shape(config: KernelConfig, inputs: list) -> tuple:
    a, b, sched = inputs[0], inputs[1], inputs[4]
    if config.as_dict()["grouped_k"]:
        return (sched.shape[0], a.shape[0], b.shape[0])
    return (inputs[6].shape[0], b.shape[1])


class BlockwiseGroupedGemmKind(RunnerKind):
    name = KIND

    def unavailable(self) -> Optional[str]:
        return unavailable_reason()

    def fake(self, config: KernelConfig, inputs: list) -> list:
        dtype = getattr(torch, config.as_dict()["out_dtype"].replace("torch.", ""))
        return [inputs[0].new_empty(_out_shape(config, inputs), dtype=dtype)]

    def build(self, config: KernelConfig):
        from .cutedsl.blockwise_grouped_gemm import build
        return build(config, _out_shape)


RUNNERS.register(BlockwiseGroupedGemmKind())
