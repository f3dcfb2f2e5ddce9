"""A GEMM output's bias add and the bias gradient (column sums), in Triton.

Same signatures as ``kernels.reference.bias_add`` / ``column_sum``.  They
exist so that a layer with a bias lowers into inductor with the same bits
as eager (dynamo/lowering.py): as torch ops, inductor would fuse the bias
add into its consumers without rounding the sum to the output's dtype
first, and order the gradient's reduction its own way.  As kernels, eager
and inductor's code launch the same ones.

* ``bias_add(out, bias)``: ``out += bias`` in place, each element
  ``round(fp32(out) + fp32(bias in out's dtype))``: torch's
  ``out.add_(bias.to(out.dtype))`` bit for bit.
* ``column_sum(x2d, dtype)``: the sum over the rows, in fp32, rounded once
  to ``dtype``; the rows are split over a few programs per multiprocessor,
  each summing its row blocks in a fixed order, then one small kernel sums
  those partials per column in a fixed order (deterministic, no atomics).
  Equal to torch's ``x2d.sum(0)`` up to the fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from . import triton_launch
from .triton_launch import Launcher, cdiv, int_key, ptr_key

# column sums: programs per multiprocessor over the row blocks (each writes
# one row of fp32 partials), and the block shape
COLSUM_PROGRAMS_PER_SM = 2
_BM, _BN = 32, 128


@triton.jit
def _bias_add_kernel(y_ptr, b_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(y_ptr.dtype.element_ty)
    out = y.to(tl.float32) + b.to(tl.float32)[None, :]
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_block_sums_kernel(x_ptr, part_ptr, M, N, G, BM: tl.constexpr, BN: tl.constexpr):
    """Program (g, j): columns j*BN.. summed over row blocks g, g + G, ...
    into part[g, columns] (fp32)."""
    g, j = tl.program_id(0), tl.program_id(1)
    rn = j * BN + tl.arange(0, BN)
    col_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for blk in range(g, tl.cdiv(M, BM), G):
        rm = blk * BM + tl.arange(0, BM)
        mask = (rm[:, None] < M) & col_ok[None, :]
        acc += tl.load(x_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(part_ptr + g.to(tl.int64) * N + rn, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _col_sum_kernel(part_ptr, out_ptr, G, K, BG: tl.constexpr, BC: tl.constexpr):
    """out[j, c] = sum over g of part[j, g, c] (parts (n, G, K), j = program_id(1))."""
    pid, j = tl.program_id(0), tl.program_id(1)
    rc = pid * BC + tl.arange(0, BC)
    base = part_ptr + j.to(tl.int64) * G * K
    acc = tl.zeros((BG, BC), dtype=tl.float32)
    for g0 in range(0, G, BG):
        rg = g0 + tl.arange(0, BG)
        acc += tl.load(base + rg[:, None].to(tl.int64) * K + rc[None, :],
                       mask=(rg[:, None] < G) & (rc[None, :] < K), other=0.0)
    tl.store(out_ptr + j * K + rc, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=rc < K)


_bias_add_launch = Launcher(_bias_add_kernel, num_warps=4)
_row_sums_launch = Launcher(_row_block_sums_kernel, num_warps=4)
col_sum_launch = Launcher(_col_sum_kernel, num_warps=4)


def col_sums_call(parts: torch.Tensor, out: torch.Tensor, groups: int, k: int) -> tuple:
    """The launch computing ``out[j] = parts[j].sum(0)`` for ``parts`` (n,
    groups, k) fp32 in a fixed order: ``(launcher, grid, key, args)``."""
    bc = 128
    return (col_sum_launch, (cdiv(k, bc), out.shape[0]),
            (int_key(groups), int_key(k), out.dtype), (parts, out, groups, k, 32, bc))


def bias_add_call(out: torch.Tensor, bias: torch.Tensor) -> tuple:
    """The launch of ``bias_add`` on a contiguous, non-empty 2-D ``out``:
    ``(grid, key, args)`` (the native eager path fixes the same launch)."""
    m, n = out.shape
    key = (out.dtype, bias.dtype, ptr_key(out), ptr_key(bias), int_key(m), int_key(n))
    return (cdiv(m, _BM), cdiv(n, _BN)), key, (out, bias, m, n, _BM, _BN)


def bias_add(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if out.dim() != 2 or not out.is_contiguous() or not bias.is_contiguous() or out.numel() == 0:
        return ref.bias_add(out, bias)
    grid, key, args = bias_add_call(out, bias)
    _bias_add_launch(grid, key, *args)
    return out


def column_sum_calls(x2d: torch.Tensor, dtype: torch.dtype):
    """The two launches of ``column_sum`` on a contiguous, non-empty
    ``x2d``: ``(launches, parts, out)`` with each launch ``(launcher, grid,
    key, args)``, ``parts`` the fp32 partial sums between them and ``out``
    the (1, n) result (the native eager path fixes the same launches,
    kernels/native.py)."""
    m, n = x2d.shape
    col_blocks = cdiv(n, _BN)
    groups = max(1, min(cdiv(m, _BM), COLSUM_PROGRAMS_PER_SM * triton_launch.sm_count(x2d.device)
                        // col_blocks))
    parts = torch.empty((groups, n), dtype=torch.float32, device=x2d.device)
    out = torch.empty((1, n), dtype=dtype, device=x2d.device)
    bc = 128
    return ((_row_sums_launch, (groups, col_blocks),
             (x2d.dtype, ptr_key(x2d), int_key(m), int_key(n), int_key(groups)),
             (x2d, parts, m, n, groups, _BM, _BN)),
            (col_sum_launch, (cdiv(n, bc), 1), (int_key(groups), int_key(n), dtype),
             (parts, out, groups, n, 32, bc))), parts, out


def column_sum(x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m, n = x2d.shape
    if m == 0 or n == 0:
        return ref.column_sum(x2d, dtype)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    launches, _, out = column_sum_calls(x2d, dtype)
    for launcher, grid, key, args in launches:
        launcher(grid, key, *args)
    return out.view(n)
