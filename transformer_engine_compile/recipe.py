"""Quantization recipes, with Transformer Engine's field names where it has them.

A recipe is a frozen dataclass: it says how tensors are quantized, never
holds state, and compares by value (compiled code guards on it).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional


class Format(enum.Enum):
    """FP8 formats of forward (activations, weights) and backward (gradients)."""

    E4M3 = ("e4m3", "e4m3")
    E5M2 = ("e5m2", "e5m2")
    HYBRID = ("e4m3", "e5m2")

    def fwd(self) -> str:
        return self.value[0]

    def bwd(self) -> str:
        return self.value[1]


@dataclasses.dataclass(frozen=True)
class MMParams:
    """How an FP8 GEMM accumulates (Transformer Engine's name).
    ``use_split_accumulator=True`` promotes the tensor cores' partial sums
    into full fp32 as it goes (``torch._scaled_mm``'s ``use_fast_accum=False``);
    False keeps the faster, less precise accumulation."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        if not isinstance(self.use_split_accumulator, bool):
            raise TypeError("use_split_accumulator must be a bool, got "
                            f"{self.use_split_accumulator!r}")


class Recipe:
    """Base of all recipes; the predicates mirror Transformer Engine's."""

    def fast_accumulation(self) -> tuple:
        """``(fprop, dgrad, wgrad)``: whether each FP8 GEMM accumulates fast:
        a recipe's ``fp8_gemm_*`` where given, else Transformer Engine's
        defaults (fprop only)."""
        return tuple(default if p is None else not p.use_split_accumulator
                     for p, default in zip((getattr(self, f"fp8_gemm_{g}", None)
                                            for g in ("fprop", "dgrad", "wgrad")),
                                           (True, False, False)))

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def constant(self, name: str):
        """Numeric field ``name`` as a trace-time constant.

        Under ``torch.compile(dynamic=True)`` Dynamo turns float and int
        attributes into SymFloat / SymInt, which cannot enter a value-opaque
        quantizer.  The field's exact text (kept at construction) is a
        string, which Dynamo guards by value; ``float.fromhex`` / ``int`` of
        it folds to a constant, so a changed value still recompiles."""
        text = getattr(self, f"_{name}_text")
        return int(text[2:]) if text.startswith("i:") else float.fromhex(text[2:])

    def _keep_texts(self, **kinds) -> None:
        """Validate numeric fields (``name=float`` or ``name=int``) and keep their text."""
        for name, kind in kinds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float
                                                         else int):
                raise TypeError(f"{name} must be {kind.__name__}, got {value!r}")
            text = f"f:{float(value).hex()}" if kind is float else f"i:{value}"
            if kind is float:
                object.__setattr__(self, name, float(value))
            object.__setattr__(self, f"_{name}_text", text)


def _check_format(fmt):
    if not isinstance(fmt, Format):
        raise TypeError(f"fp8_format must be a recipe.Format, got {fmt!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from an amax history of past steps."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self):
        _check_format(self.fp8_format)
        self._keep_texts(margin=int, amax_history_len=int)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {self.amax_compute_algo!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 scaled by the amax of the tensor being quantized."""

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    # each GEMM's accumulation; None: Transformer Engine's default, fast for
    # fprop (MMParams(use_split_accumulator=False)), split for dgrad and wgrad
    # (a plain None default, so that compiled code can build the recipe)
    fp8_gemm_fprop: Optional[MMParams] = None
    fp8_gemm_dgrad: Optional[MMParams] = None
    fp8_gemm_wgrad: Optional[MMParams] = None

    def __post_init__(self):
        _check_format(self.fp8_format)
        self._keep_texts(amax_epsilon=float)
        for g in ("fprop", "dgrad", "wgrad"):
            value = getattr(self, f"fp8_gemm_{g}")
            if value is not None and not isinstance(value, MMParams):
                raise TypeError(f"fp8_gemm_{g} must be a recipe.MMParams or None, got "
                                f"{value!r}")


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with 1x128 (dim 1) or 128x128 (dim 2) blocks and fp32 scales."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    use_power_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_format(self.fp8_format)
        self._keep_texts(amax_epsilon=float, x_block_scaling_dim=int, w_block_scaling_dim=int,
                        grad_block_scaling_dim=int)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: blocks of 32 with E8M0 (power-of-two) scales."""

    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        _check_format(self.fp8_format)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 in blocks of 16 with E4M3 scales and a per-tensor scale.

    By default weights use 16x16 (2D) scales, wgrad inputs the random
    Hadamard transform, gradients stochastic rounding; each can be disabled.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False


# short names used by the demos, the benchmark and the tests; "bf16" = no recipe
_BY_NAME = {
    "fp8_current": Float8CurrentScaling,
    "mxfp8": MXFP8BlockScaling,
    "fp8_block": Float8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
RECIPE_NAMES = ("bf16",) + tuple(_BY_NAME)


def by_name(name: str):
    """A default-configured recipe for a short name, None for ``"bf16"``."""
    if name == "bf16":
        return None
    try:
        return _BY_NAME[name]()
    except KeyError:
        raise ValueError(f"unknown recipe name {name!r}; known: {RECIPE_NAMES}") from None
