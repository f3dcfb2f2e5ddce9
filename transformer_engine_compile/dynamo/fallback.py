"""Eager fallback: configurations the custom ops do not model.

A layer whose arguments name a reason (``compile_unsupported_reason()``)
leaves the compiled graph at that layer (a graph break, so
``fullgraph=True`` raises) and runs eagerly.  Each (module, reason) pair
warns once, and is recorded so users can ask which layers fell back.
"""

from __future__ import annotations

import warnings

import torch

REASONS = {
    "quantizer_not_value_opaque": "a quantizer is not value-opaque (holds state or is not "
                                  "registered), so it cannot cross a custom-op boundary",
    "no_opaque_api": "this torch lacks the opaque-object API the custom ops need",
    "fp8_grad_graph_input": "fp8_grad=True on a graph input: AOTAutograd cannot return a "
                            "quantized gradient for a plain graph input, so the layer runs "
                            "eagerly with a high-precision input gradient",
}


def describe(reason: str) -> str:
    return f"{reason}: {REASONS[reason]}"


def record_fallback(module: torch.nn.Module, reason: str) -> None:
    """Note (and warn once) that ``module`` ran eagerly for ``reason``. Eager code only."""
    seen = module.__dict__.setdefault("_te_fallback_reasons", [])
    if reason not in seen:
        seen.append(reason)
        warnings.warn(f"{type(module).__name__} falls back to eager under torch.compile "
                      f"({describe(reason)})", RuntimeWarning, stacklevel=3)


def fallback_reasons(module: torch.nn.Module) -> tuple:
    """Reasons ``module`` itself fell back for, in first-seen order."""
    return tuple(module.__dict__.get("_te_fallback_reasons", ()))


def fallback_report(model: torch.nn.Module) -> dict:
    """``{submodule name: reasons}`` for every submodule that fell back."""
    return {name: fallback_reasons(m) for name, m in model.named_modules() if fallback_reasons(m)}
