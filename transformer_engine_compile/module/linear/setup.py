"""What a GEMM layer sets up for a call (``te.Linear``, and ``te.LayerNormMLP``
for each of its two GEMMs): its tensor-parallel configuration, the recipe's
quantizers, the DelayedScaling state buffers and their binding, the
``is_first_microbatch`` flag, the GEMM shape checks and the weight init."""

from __future__ import annotations

from typing import Optional

import torch

from ... import distributed as D
from ...autocast import get_amax_reduction_group
from ...quantization import factory
from ...quantization.base import QuantizedTensorStorage
from ..extra_state import delayed_state_names
from .args import LinearFwdArgs, _input_usage


def _torch_autocast_dtype(inp) -> Optional[torch.dtype]:
    """The ``torch.autocast`` dtype active for ``inp``'s device, or None."""
    device_type = inp.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


_DELAYED_STATE = delayed_state_names()


def _parallel_config(parallel_mode, tp_group, tp_size, sequence_parallel,
                     owner: str = "te.Linear") -> tuple:
    """Validated ``(parallel_mode, tp_group, tp_size)``: the group's size wins
    over ``tp_size``; more than one rank needs a group."""
    if parallel_mode not in D.PARALLEL_MODES:
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', "
                         f"got {parallel_mode!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    if sequence_parallel and parallel_mode is None:
        raise ValueError(f"{owner}: sequence_parallel=True needs parallel_mode "
                         "'column' or 'row'")
    if tp_group is not None:
        group_size = torch.distributed.get_world_size(tp_group)
        if tp_size not in (1, group_size):
            raise ValueError(f"{owner}: tp_size={tp_size} but tp_group has "
                             f"{group_size} ranks")
        tp_size = group_size
    elif tp_size > 1:
        raise ValueError(f"{owner}: tp_size={tp_size} needs tp_group (the process group "
                         "the layer is split over)")
    if parallel_mode is None:
        return None, tp_group, 1  # not split: no collectives
    return parallel_mode, tp_group, tp_size


def first_microbatch_flag(owner: str, is_first_microbatch):
    """``is_first_microbatch`` as True, False or None (a tensor is refused)."""
    if is_first_microbatch is None:
        return None
    if isinstance(is_first_microbatch, torch.Tensor):
        raise TypeError(f"{owner}: is_first_microbatch must be a Python bool (or "
                        "None), not a tensor: it selects the graph")
    # may be ``step % accum == 0`` on a step counter Dynamo made dynamic (a
    # SymBool, which Dynamo reports as a bool): branching specialises it
    # to a constant with a guard, one graph per value
    return True if is_first_microbatch else False


# -- one GEMM's module logic (te.Linear, and each GEMM of te.LayerNormMLP) ----------------
def set_quantizers(args: LinearFwdArgs, recipe, fp8_output: bool = False,
                   fp8_grad: bool = False) -> None:
    """The recipe's quantizers of one GEMM into ``args``."""
    # eager calls share memoized quantizers; traced code builds its own
    make = (factory.quantizer_for if torch.compiler.is_compiling()
            else factory.shared_quantizer_for)
    args.fprop_fast_accum, args.dgrad_fast_accum, args.wgrad_fast_accum = \
        recipe.fast_accumulation()
    args.input_quantizer = make(recipe, "input", internal=True)
    args.weight_quantizer = make(recipe, "weight", internal=True)
    args.grad_output_quantizer = make(recipe, "grad_output", internal=True)
    if fp8_output:
        args.output_quantizer = make(recipe, "output")
    if fp8_grad and args.input_requires_grad:  # both copies: the consumer's dgrad, wgrad
        args.grad_input_quantizer = make(recipe, "grad_input").usage_variant(
            True, True)  # (under DelayedScaling: scale_bwd[1])


def main_grad_of(weight, owner: str, what: str) -> torch.Tensor:
    """``weight.main_grad`` (fuse_wgrad_accumulation), or a RuntimeError."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(f"{owner} needs {what}.main_grad (an fp32 tensor shaped like the "
                           "weight)")
    return main_grad


def state_plan(args: LinearFwdArgs, recipe, is_first_microbatch):
    """``(delayed recipe or None, first microbatch or None)`` when the GEMM
    keeps state in module buffers (DelayedScaling, weight caching), else None."""
    delayed = recipe is not None and recipe.delayed()
    cache = (is_first_microbatch is not None and args.weight_quantizer is not None
             and not isinstance(args.weight, QuantizedTensorStorage))
    if not (delayed or cache):
        return None
    return recipe if delayed else None, None if not cache else bool(is_first_microbatch)


def gemm_state(module, prefix: str, owner: str, args: LinearFwdArgs, delayed_recipe,
               first_microbatch, save_original_input: bool = False) -> tuple:
    """``(layout, bind)``: one GEMM's buffers on ``module`` (names prefixed by
    ``prefix``: its DelayedScaling amax histories and scales, and the FP8
    weight cache, written on the first microbatch (``cache_weight``) and
    read on the others) for ``ensure_buffers``, and a function that binds
    them into ``args`` once allocated.  A module with several GEMMs
    allocates all their layouts in one ``ensure_buffers`` call."""
    layout = ()
    if delayed_recipe is not None:
        if save_original_input:
            raise ValueError(f"{owner}(save_original_input=True) cannot re-quantize the "
                             "input in the backward under DelayedScaling (its scale has "
                             "moved on); use recipe.Float8CurrentScaling()")
        n, f32 = delayed_recipe.constant("amax_history_len"), torch.float32
        hist_fwd, scale_fwd, hist_bwd, scale_bwd = delayed_state_names(prefix)
        layout = ((hist_fwd, (n, 2), f32, 0.0, None), (scale_fwd, (2,), f32, 1.0, None),
                  (hist_bwd, (n, 2), f32, 0.0, None), (scale_bwd, (2,), f32, 1.0, None))
    weight_layout = ()
    if first_microbatch is not None:
        q = args.weight_quantizer.with_usage(rowwise=True, columnwise=True)
        shape = tuple(args.weight.shape)
        weight_layout = q.flatten_layout(shape)
        missing = None if first_microbatch else (
            f"{owner}: is_first_microbatch=False reuses the FP8 weight cached by an "
            "earlier is_first_microbatch=True call under the same recipe, and there is none")
        layout = layout + tuple((f"{prefix}fp8_weight_{name}", size, dtype, None, missing)
                                for name, size, dtype in weight_layout)

    def bind():
        if delayed_recipe is not None:
            args.amax_group = get_amax_reduction_group()
            args.amax_history_fwd, args.scale_fwd, args.amax_history_bwd, args.scale_bwd = (
                getattr(module, name) for name in delayed_state_names(prefix))
        if first_microbatch is not None:
            buffers = {name: getattr(module, f"{prefix}fp8_weight_{name}")
                       for name, _, _ in weight_layout}
            args.weight_workspace = q.create_metadata(shape, args.weight.dtype).build(
                shape, buffers)
            args.cache_weight = first_microbatch

    return layout, bind


def check_gemm_shapes(owner: str, args: LinearFwdArgs, m: int, n: int, k: int) -> None:
    """Clear errors for sizes the recipe's formats cannot take, before any
    kernel: a GEMM of ``m`` rows (gathered under SP), ``n`` local output and
    ``k`` local input features.  Reads ``divisibility()`` and tests the (maybe
    symbolic) sizes here: an exception raised inside an opaque member is not
    catchable."""
    checks = (
        ("input", args.input_quantizer, (m, k), _input_usage(args)),
        ("weight", args.weight_quantizer, (n, k),
         {"rowwise": True, "columnwise": args.input_requires_grad}),
        ("grad_output", args.grad_output_quantizer, (m, n),
         {"rowwise": args.input_requires_grad, "columnwise": args.weight_requires_grad}),
        ("gradient of the input (fp8_grad)", args.grad_input_quantizer, (m, k),
         {"rowwise": True, "columnwise": True}),
    )
    for role, q, (rows, cols), usage in checks:
        if q is None:
            continue
        if role == "weight" and isinstance(args.weight, QuantizedTensorStorage):
            continue
        if not (usage["rowwise"] or usage["columnwise"]):
            continue
        k_mult, m_mult, label = q.usage_variant(**usage).divisibility()
        if cols % k_mult != 0 or rows % m_mult != 0:
            needs = [f"the {dim} divisible by {mult}" for dim, mult in
                     (("rows", m_mult), ("columns", k_mult)) if mult > 1]
            raise ValueError(
                f"{owner}: the {role} as a {rows} x {cols} matrix does not fit the recipe: "
                f"{label} needs {' and '.join(needs)}")


@torch.no_grad()
def init_weight_(weight: torch.Tensor, init_method=None) -> None:
    """``init_method(weight)``, else ``torch.nn.Linear``'s initialisation."""
    if init_method is not None:
        init_method(weight)
    else:
        torch.nn.init.kaiming_uniform_(weight, a=5 ** 0.5)


_PLAIN_TENSORS = (torch.nn.Parameter, torch.Tensor)
