"""``te.LayerNormLinear``: LayerNorm or RMSNorm fused with the linear layer
that follows it (Transformer Engine's QKV projection), on its own pair of
custom ops (``layernorm/linear_ops.py``).  Everything but the
normalisation is ``te.Linear``'s: recipes, state, TP/SP, fallbacks.
"""

from __future__ import annotations

from typing import Optional

import torch

from .linear_native import plan_for_layernorm_linear
from .linear_ops import LAYERNORM_LINEAR_OPS, LayerNormLinearFwdArgs
from ..linear.layer import Linear
from ..norm.layer import reset_norm_parameters
from ..norm.ops import NORMALIZATIONS

__all__ = ["LayerNormLinear"]


def check_norm_config(owner: str, normalization: str, eps) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{owner}: normalization must be one of {NORMALIZATIONS}, "
                         f"got {normalization!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{owner}: eps must be a non-negative float, got {eps!r}")


class LayerNormLinear(Linear):
    """``y = norm(x) W^T + b`` with Transformer Engine's argument names.

    ``normalization``: ``"LayerNorm"`` (parameters ``layer_norm_weight``,
    ``layer_norm_bias``) or ``"RMSNorm"`` (``layer_norm_weight`` only).
    ``zero_centered_gamma``: the norm scales by ``1 + layer_norm_weight``
    (initialised to zeros).  ``return_layernorm_output``: also return the
    normalised input (high precision).  ``parallel_mode`` is None or
    ``"column"``; with ``sequence_parallel`` each rank normalises its own
    tokens and the linear layer all-gathers them (quantized where the
    recipe allows), and the norm parameters' gradients are summed over the
    group inside the backward (Transformer Engine leaves that sum to the
    training framework).  Other arguments: :class:`te.Linear`.
    """

    _OPS = LAYERNORM_LINEAR_OPS
    _native_plan = staticmethod(plan_for_layernorm_linear)

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *,
                 bias: bool = True, normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 return_bias: bool = False, parallel_mode: Optional[str] = None, tp_group=None,
                 tp_size: int = 1, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, parameters_split=None,
                 name: Optional[str] = None):
        check_norm_config("te.LayerNormLinear", normalization, eps)
        if parallel_mode not in (None, "column"):
            raise ValueError("te.LayerNormLinear: parallel_mode must be None or 'column' (the "
                             f"norm needs the whole input row), got {parallel_mode!r}")
        super().__init__(in_features, out_features, bias, params_dtype=params_dtype,
                         device=device, init_method=init_method, return_bias=return_bias,
                         parallel_mode=parallel_mode, tp_group=tp_group, tp_size=tp_size,
                         sequence_parallel=sequence_parallel,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         parameters_split=parameters_split, name=name)
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        dtype = self._weights()[0].dtype
        self.layer_norm_weight = torch.nn.Parameter(
            torch.empty(in_features, dtype=dtype, device=device))
        self.layer_norm_bias = (torch.nn.Parameter(
            torch.empty(in_features, dtype=dtype, device=device))
            if normalization == "LayerNorm" else None)
        for p in self._norm_parameters():
            p.sequence_parallel = self.sequence_parallel  # as Transformer Engine marks them
        self.reset_layer_norm_parameters()

    def _memo_parameters(self) -> tuple:
        return super()._memo_parameters() + (self.layer_norm_weight, self.layer_norm_bias)

    def _memo_extra(self) -> tuple:
        """The norm's configuration and its parameters' flags: the memo's
        arguments hold them."""
        w, b = self.layer_norm_weight, self.layer_norm_bias
        return (self.normalization, self.eps, self.zero_centered_gamma,
                self.return_layernorm_output, w.dtype, w.requires_grad,
                None if b is None else (b.dtype, b.requires_grad))

    def _norm_parameters(self) -> list:
        return [p for p in (getattr(self, "layer_norm_weight", None),
                            getattr(self, "layer_norm_bias", None)) if p is not None]

    @torch.no_grad()
    def reset_layer_norm_parameters(self) -> None:
        """gamma = 1 (0 with ``zero_centered_gamma``), beta = 0."""
        reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                              self.zero_centered_gamma)

    def reset_parameters(self) -> None:
        """The linear layer's parameters (:meth:`te.Linear.reset_parameters`) and the norm's."""
        super().reset_parameters()
        if getattr(self, "layer_norm_weight", None) is not None:
            self.reset_layer_norm_parameters()

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, normalization={self.normalization!r}, eps={self.eps}"
                + (", zero_centered_gamma=True" if self.zero_centered_gamma else ""))

    def _new_args(self, grad_enabled: bool, **fields) -> LayerNormLinearFwdArgs:
        inp, w, b = fields["inp"], self.layer_norm_weight, self.layer_norm_bias
        x_rg = grad_enabled and inp.requires_grad
        w_rg = grad_enabled and w.requires_grad
        b_rg = grad_enabled and b is not None and b.requires_grad
        fields["input_requires_grad"] = x_rg or w_rg or b_rg  # the norm's output needs dgrad
        return LayerNormLinearFwdArgs(
            **fields, ln_weight=w, ln_bias=b, eps=self.eps, normalization=self.normalization,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.return_layernorm_output,
            norm_input_requires_grad=x_rg, ln_weight_requires_grad=w_rg,
            ln_bias_requires_grad=b_rg)

    def _check_fp8_grad(self, recipe) -> None:
        raise NotImplementedError("te.LayerNormLinear: fp8_grad=True is not supported (the "
                                  "input's gradient comes from the norm's backward, in high "
                                  "precision)")

    def _finish(self, outputs: dict):
        """Transformer Engine's order: ``out[, bias][, ln_out]``."""
        out = (outputs["out"],)
        if self.return_bias:
            out = out + (self._returned_bias(),)
        if self.return_layernorm_output:
            out = out + (outputs["ln_out"],)
        return out[0] if len(out) == 1 else out
