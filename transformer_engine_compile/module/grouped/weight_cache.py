"""FP8 weight caching across gradient-accumulation microbatches
(Transformer Engine's ``is_first_microbatch``) for the grouped GEMMs of a
module: ``te.GroupedLinear``'s one, ``te.GroupedExperts``' gate/up and down.

A first microbatch quantizes a GEMM's stacked expert weights and writes
their FP8 copies into the module's non-persistent buffers
``<prefix>fp8_weight_*`` (update outputs of the forward op); a later one
reads them instead of the weights.  The buffers are allocated at trace time
with the module's DelayedScaling state (``state.bind_delayed_state``), so
this module only says which buffers a recipe needs and how the forward op
takes them.
"""

from __future__ import annotations

import torch

from ...autocast import get_autocast_recipe
from ...kernels.reference import FP8_DTYPE
from ...quantization import factory
from . import blockwise_gemm
from .compute import tensorwise_fp8

__all__ = ["weight_cache"]

# per-expert FP8: each expert's two FP8 copies and its scale; the forward
# op's fields are ``weight_cache_<name>``
_PER_EXPERT = ("data", "transposed", "scale_inv")


def weight_cache(module: torch.nn.Module, prefix: str, weight: torch.Tensor, first: bool,
                 owner: str) -> tuple:
    """``(layout, bind)`` of the cache of ``module``'s grouped GEMM over the
    stacked ``weight`` ``(experts, out, in)``: its buffers under the active
    recipe (an ``ensure_buffers`` layout, named ``<prefix>fp8_weight_*``;
    on a later microbatch they must exist already) and a function giving
    the forward op's cache fields once they are allocated; ``((), None)``
    without a recipe, where the flag changes nothing.

    Per-expert FP8 (current and delayed scaling) keeps each expert's two
    FP8 copies and scales; FP8 blockwise on the CuTeDSL kernel keeps all
    experts' W as the kernel reads it, one quantized ``(experts * out,
    in)`` matrix with both copies.  Other recipes raise
    ``NotImplementedError``."""
    recipe = get_autocast_recipe()
    if recipe is None:
        return (), None
    q_x, q_w, q_dy = (factory.quantizer_for(recipe, role, internal=True)
                      for role in ("input", "weight", "grad_output"))
    experts, out_features, in_features = weight.shape
    missing = None if first else (
        f"{owner}: is_first_microbatch=False reuses the FP8 weights cached by an earlier "
        "is_first_microbatch=True call under the same recipe, and there are none")
    name = f"{prefix}fp8_weight_{{}}".format
    if tensorwise_fp8(q_w):
        fp8 = FP8_DTYPE[q_w.fp8_format]
        shapes = {"data": ((experts, out_features, in_features), fp8),
                  "transposed": ((experts, in_features, out_features), fp8),
                  "scale_inv": ((experts,), torch.float32)}
        layout = tuple((name(part), *shapes[part], None, missing) for part in _PER_EXPERT)
        return layout, lambda: {f"weight_cache_{part}": getattr(module, name(part))
                                for part in _PER_EXPERT}
    if blockwise_gemm.applies(weight, in_features, out_features, q_x, q_w, q_dy):
        q = blockwise_gemm.weight_cache_quantizer(q_w)
        shape = (experts * out_features, in_features)
        parts = q.flatten_layout(shape)
        layout = tuple((name(part), size, dtype, None, missing) for part, size, dtype in parts)

        def bind():
            buffers = {part: getattr(module, name(part)) for part, _, _ in parts}
            return {"weight_cache_blockwise": q.create_metadata(shape, weight.dtype)
                    .build(shape, buffers)}
        return layout, bind
    raise NotImplementedError(
        f"{owner} caches FP8 weights across microbatches (is_first_microbatch) under "
        f"Float8CurrentScaling, DelayedScaling and, on the CuTeDSL grouped GEMM, "
        f"Float8BlockScaling, not {type(recipe).__name__} here: call it with "
        "is_first_microbatch=None (the weights are quantized at every call)")
