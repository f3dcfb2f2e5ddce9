"""Groups of rows padded to whole blocks: each group's rows moved into a
zero-filled buffer where every group starts on a multiple of ``align``
rows and spans at least ``align`` (an empty group too).  The buffer's size
depends on the token count and the number of groups alone, never on the
routing, so nothing syncs and CUDA graphs replay it.  Zero rows add
nothing to a GEMM's sums and leave every block's amax as it is.

Users: the FP8 wgrad GEMM (16-row groups: its operands are cast into the
padded layout, ``quantize.py``), the
block-scaled recipes (whole 128-row blocks per expert, ``blocked.py``) and
the torchao baseline of ``benchmarks.moe``."""

from __future__ import annotations

import torch


def padded_offsets(offs: torch.Tensor, tokens: int, align: int) -> torch.Tensor:
    """End rows of the groups padded to whole ``align``-row blocks: each
    group rounded up to a multiple of ``align`` rows (at least ``align``),
    the last one ending at the buffer's static :func:`padded_rows`."""
    experts = offs.shape[0]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = ((counts + align - 1) // align).clamp_min(1) * align
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    return torch.cat([ends[:-1], ends.new_full((1,), padded_rows(tokens, experts, align))])


def padded_rows(tokens: int, experts: int, align: int) -> int:
    """The padded buffer's rows: enough for every group rounded up, itself a
    multiple of ``align`` (for the FP8 kernel: its rule for the reduced
    dim's total)."""
    return -(-tokens // align) * align + align * experts


def padded_rows_of(offs: torch.Tensor, rows: torch.Tensor, align: int) -> tuple:
    """``(dest, padded offsets, buffer rows)``: where each of the grouped
    rows (``rows``: each one's group) goes in the zero-padded buffer of
    :func:`padded_offsets`."""
    tokens, experts = rows.shape[0], offs.shape[0]
    pad_offs = padded_offsets(offs, tokens, align)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    pad_starts = torch.cat([pad_offs.new_zeros(1), pad_offs[:-1]])
    dest = torch.arange(tokens, device=rows.device) + (pad_starts - starts)[rows]
    return dest, pad_offs, padded_rows(tokens, experts, align)


def padded_sources(offs: torch.Tensor, rows: torch.Tensor, align: int) -> tuple:
    """``(sources, dest, padded offsets)``: the row of the grouped rows each
    row of the padded buffer takes (int32, -1 for padding), and
    :func:`padded_rows_of`'s ``dest`` and offsets: what a kernel that writes
    the padded layout itself reads (``kernels.cast_fp8_grouped``,
    ``kernels.quantize_fp8_blockwise_rows``)."""
    dest, pad_offs, size = padded_rows_of(offs, rows, align)
    sources = torch.full((size,), -1, dtype=torch.int32, device=rows.device)
    sources = sources.index_put((dest,), torch.arange(rows.shape[0], dtype=torch.int32,
                                                      device=rows.device))
    return sources, dest, pad_offs


def scatter_rows(t: torch.Tensor, dest: torch.Tensor, size: int) -> torch.Tensor:
    """``t``'s rows written at rows ``dest`` of a zero ``(size, cols)``
    buffer (differentiable; FP8 moved as its bytes: ``index_put`` takes no
    float8 on every torch)."""
    if t.element_size() == 1 and t.dtype.is_floating_point:
        buf = torch.zeros(size, t.shape[1], dtype=torch.uint8, device=t.device)
        return buf.index_put((dest,), t.view(torch.uint8)).view(t.dtype)
    return t.new_zeros(size, t.shape[1]).index_put((dest,), t)
