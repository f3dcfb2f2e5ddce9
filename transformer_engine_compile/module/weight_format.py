"""The weight a te layer's GEMM takes when the weight is already quantized.

FSDP2's quantized all-gather (``te.fsdp``) installs the gathered weight as
a quantized tensor in the format of the recipe it was sharded with; an FP8
primary weight is one too.  :func:`check_gathered_weight` lets the layer
use it under that recipe's format family and refuses a mismatch while
gradients are on (the gradient could not reach the high-precision weight
through a dequantized copy).
"""

from __future__ import annotations

from ..quantization import factory
from ..quantization.base import QuantizedTensorStorage


def check_gathered_weight(owner: str, weight, recipe, grad_enabled: bool):
    """The weight a layer's GEMM takes: ``weight`` itself, unless it is
    quantized (gathered by FSDP2 through ``te.fsdp.QuantizedAllGatherWeight``,
    or an FP8 primary weight) in another format than the active recipe's:
    then its dequantized values without gradients, a clear error with them."""
    if not isinstance(weight, QuantizedTensorStorage):
        return weight
    if recipe is not None and isinstance(weight, factory.weight_storage_class(recipe)):
        return weight  # the recipe's format family (the GEMM checks the rest)
    if grad_enabled and weight.requires_grad:
        active = "no recipe" if recipe is None else type(recipe).__name__
        raise RuntimeError(
            f"{owner}: the weight is a {type(weight).__name__} (FSDP2 gathers it so for "
            f"the recipe given to te.fsdp.fully_shard), but the forward runs under "
            f"{active}; training needs the high-precision weight for its gradient. Shard "
            "with the recipe you train with (or recipe=None to gather high precision)")
    return weight.dequantize()
