"""Quantizer for each tensor role of a GEMM layer under a recipe."""

from __future__ import annotations

from .. import recipe as R
from .blockwise import Float8BlockQuantizer
from .float8 import Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer

ROLES = ("input", "weight", "output", "grad_output", "grad_input")
_BACKWARD_ROLES = ("grad_output", "grad_input")


def quantizer_for(recipe: R.Recipe, role: str, *, internal: bool = False):
    """A fresh quantizer for ``role`` (one of ROLES) under ``recipe``.

    ``internal=True`` makes it produce plain storages (tensors that live only
    inside a layer) instead of wrapper tensors."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    backward = role in _BACKWARD_ROLES
    if isinstance(recipe, R.Float8CurrentScaling):
        fmt = recipe.fp8_format.bwd() if backward else recipe.fp8_format.fwd()
        return Float8CurrentScalingQuantizer(fmt, force_pow_2_scales=recipe.use_power_2_scales,
                                             amax_epsilon=recipe.constant("amax_epsilon"),
                                    internal=internal)
    if isinstance(recipe, R.Float8BlockScaling):
        fmt = recipe.fp8_format.bwd() if backward else recipe.fp8_format.fwd()
        field = {"input": "x", "weight": "w", "output": "x"}.get(role, "grad")
        dim = recipe.constant(f"{field}_block_scaling_dim")
        return Float8BlockQuantizer(fmt, block_scaling_dim=dim,
                                    force_pow_2_scales=recipe.use_power_2_scales,
                                    amax_epsilon=recipe.constant("amax_epsilon"),
                                    internal=internal)
    if isinstance(recipe, R.MXFP8BlockScaling):
        fmt = recipe.fp8_format.bwd() if backward else recipe.fp8_format.fwd()
        return MXFP8Quantizer(fmt, internal=internal)
    if isinstance(recipe, R.NVFP4BlockScaling):
        wgrad_operand = role in ("input", "grad_output")
        return NVFP4Quantizer(
            with_rht=wgrad_operand and not recipe.disable_rht,
            with_2d_quantization=role == "weight" and not recipe.disable_2d_quantization,
            stochastic_rounding=role == "grad_output" and not recipe.disable_stochastic_rounding,
            internal=internal,
        )
    if isinstance(recipe, R.DelayedScaling):
        # the configuration only: the scale and amax history are the layer's buffers
        fmt = recipe.fp8_format.bwd() if backward else recipe.fp8_format.fwd()
        return Float8DelayedScalingQuantizer(fmt, margin=recipe.constant("margin"),
                                             amax_compute_algo=recipe.amax_compute_algo,
                                             internal=internal)
    raise TypeError(f"unknown recipe {type(recipe).__name__}")


_WEIGHT_QUANTIZER = (  # recipe type -> the quantizer class of its weights
    (R.Float8CurrentScaling, Float8CurrentScalingQuantizer),
    (R.Float8BlockScaling, Float8BlockQuantizer),
    (R.MXFP8BlockScaling, MXFP8Quantizer),
    (R.NVFP4BlockScaling, NVFP4Quantizer),
    (R.DelayedScaling, Float8DelayedScalingQuantizer),
)


def weight_storage_class(recipe: R.Recipe) -> type:
    """The storage class of ``recipe``'s quantized weights, from the recipe's
    type alone (traced code may not compare opaque quantizers on torch 2.11)."""
    for recipe_cls, quantizer_cls in _WEIGHT_QUANTIZER:
        if isinstance(recipe, recipe_cls):
            return quantizer_cls.storage_cls
    raise TypeError(f"unknown recipe {type(recipe).__name__}")


_SHARED: dict = {}


def shared_quantizer_for(recipe: R.Recipe, role: str, *, internal: bool = False):
    """:func:`quantizer_for`, memoized by the recipe's value: eager layers ask
    for the same quantizers on every call.  The result is shared between
    callers and must never be mutated (``with_usage`` returns copies).
    Compiled code calls :func:`quantizer_for` instead (Dynamo would trace
    the memo's writes as side effects)."""
    key = (quantizer_for, recipe, role, internal)  # (a patched quantizer_for: new entries)
    q = _SHARED.get(key)
    if q is None:
        q = _SHARED[key] = quantizer_for(recipe, role, internal=internal)
    return q
