"""``parameters_split``: one GEMM weight (and bias) held as several named
parameters, as Transformer Engine's ``Linear(..., parameters_split=...)``.

A fused q/k/v (or gate/up) projection runs one GEMM but keeps ``query_weight``,
``key_weight``, ``value_weight`` as parameters of their own (checkpoints,
per-part optimizer groups, loading a model whose weights are stored apart).
The parts are row slices of one buffer.  A call that records a gradient,
and any call inside ``torch.compile``, concatenates them (one copy of the
weight per forward; the backward hands each part its rows of the weight
gradient).  A call without gradients (validation, inference) reads the
buffer in place where the parts still lie one after another in one
storage (:func:`join_rows`).  Both give the same values, so compiled still
equals eager bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch


def split_layout(parameters_split, out_features: int, parallel_mode: Optional[str],
                 tp_size: int, owner: str) -> Optional[tuple]:
    """``((name, rows on this rank), ...)`` for ``parameters_split`` (None:
    no split), with names stripped of trailing underscores.

    A tuple or list of names splits ``out_features`` equally; a dict gives
    each name its rows.  The rows must add up to ``out_features`` and, under
    column tensor parallelism, each part must divide by ``tp_size`` (each
    rank holds its share of every part)."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif (isinstance(parameters_split, (tuple, list))
          and all(isinstance(n, str) for n in parameters_split)):
        n = len(parameters_split)
        if n and out_features % n:
            raise ValueError(f"{owner}: parameters_split names {n} equal parts, which do not "
                             f"divide out_features ({out_features}); give a dict of sizes")
        items = [(name, out_features // n) for name in parameters_split] if n else []
    else:
        raise TypeError(f"{owner}: parameters_split must be None, a tuple or list of names, or "
                        f"a dict of name -> rows, got {type(parameters_split).__name__}")
    if not items:
        raise ValueError(f"{owner}: parameters_split cannot split the weight into 0 parameters")
    names = []
    for name, size in items:
        if not isinstance(name, str) or not name.rstrip("_").isidentifier():
            raise ValueError(f"{owner}: parameters_split name {name!r} must be an identifier "
                             "(it becomes '<name>_weight')")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{owner}: parameters_split size of {name!r} must be a positive "
                             f"int, got {size!r}")
        names.append(name.rstrip("_"))
    if len(set(names)) != len(names):
        raise ValueError(f"{owner}: parameters_split names must differ after trailing "
                         f"underscores are stripped, got {names}")
    sizes = [size for _, size in items]
    if sum(sizes) != out_features:
        raise ValueError(f"{owner}: parameters_split sizes {sizes} must add up to "
                         f"out_features ({out_features})")
    if parallel_mode == "column":
        bad = [s for s in sizes if s % tp_size]
        if bad:
            raise ValueError(f"{owner}: parallel_mode='column' gives each rank its share of "
                             f"every parameters_split part; sizes {bad} are not divisible by "
                             f"tp_size {tp_size}")
        sizes = [s // tp_size for s in sizes]
    return tuple(zip(names, sizes))


def register_rows(module, names, full, rows) -> None:
    """Register ``full`` (``rows`` None) or its row slices of ``rows`` rows
    as the parameters ``names`` of ``module``; ``full`` None registers None
    (a layer without a bias)."""
    parts = [None] * len(names) if full is None else (
        (full,) if rows is None else full.split(rows))
    for name, part in zip(names, parts):
        module.register_parameter(name, None if part is None else torch.nn.Parameter(part))


@torch.no_grad()
def pack_rows(parts) -> None:
    """Lay plain parameters out as adjacent rows of one buffer again (their
    objects stay: ``.data`` moves), after something moved each on its own
    (``module.to()``, a deep copy).  Parts that are None, meta, of other
    tensor types, dtypes or devices, or already adjacent, are left alone."""
    if (parts[0] is None or any(type(p) is not torch.nn.Parameter for p in parts)
            or len({(p.dtype, p.device, p.shape[1:]) for p in parts}) != 1
            or parts[0].is_meta or adjacent_rows(parts)):
        return
    full = torch.cat([p.detach() for p in parts])
    for p, part in zip(parts, full.split([p.shape[0] for p in parts])):
        p.data = part


def adjacent_rows(parts) -> bool:
    """Whether ``parts`` are plain, contiguous tensors of one dtype lying one
    after another in one storage (the views the layer made), so the whole
    is a view of that storage."""
    first = parts[0]
    if type(first) not in (torch.Tensor, torch.nn.Parameter) or not first.is_contiguous():
        return False
    ptr, offset, tail = first.untyped_storage().data_ptr(), first.storage_offset(), first.shape[1:]
    for p in parts:
        if (type(p) not in (torch.Tensor, torch.nn.Parameter) or p.dtype != first.dtype
                or p.device != first.device or p.shape[1:] != tail or not p.is_contiguous()
                or p.storage_offset() != offset
                or p.untyped_storage().data_ptr() != ptr):
            return False
        offset += p.numel()
    return True


def join_rows(parts) -> Optional[torch.Tensor]:
    """``torch.cat(parts)`` (None for no parts; the part itself for one).

    Where no gradient is recorded (validation, inference) and the parts are
    adjacent rows of one storage, the whole is a view of that storage, with
    no copy.  A recorded gradient takes ``torch.cat``, whose backward (row
    slices) is C++: an ``autograd.Function`` aliasing the parts would save
    the copy but put a Python node on the autograd engine's device thread,
    measured slower per call than the copy (docs/linear.md, "Split
    parameters")."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if (not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(p.requires_grad for p in parts))
            and adjacent_rows(parts)):
        first = parts[0]
        return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]),
                                first.stride())
    return torch.cat(parts, dim=0)
