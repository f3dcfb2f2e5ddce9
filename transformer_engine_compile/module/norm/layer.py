"""``te.LayerNorm`` and ``te.RMSNorm``: the normalisation on its own.

Plain torch code, no custom op: under ``torch.compile`` inductor fuses it
into one kernel (and with what surrounds it), and autograd differentiates
it.  The numerics are those of the normalisation inside
``te.LayerNormLinear`` / ``te.LayerNormMLP`` (``kernels.reference.norm_forward``):
the input, gamma and beta upcast to fp32, the statistics and the affine
transform in fp32 (``1 + gamma`` added in fp32 with ``zero_centered_gamma``),
the output rounded once to the input's dtype.  So ``te.RMSNorm`` followed
by ``te.Linear`` computes, in eager mode, exactly the forward of
``te.LayerNormLinear(normalization="RMSNorm")`` with the same parameters.

Transformer Engine's names: ``LayerNorm(normalized_shape, eps=1e-5,
sequence_parallel=False, params_dtype=None, zero_centered_gamma=False,
device=None)`` with parameters ``weight`` and ``bias``; ``RMSNorm`` the
same with ``weight`` only.  ``hidden_size`` is accepted as the older name of
``normalized_shape``.  ``sequence_parallel`` only marks the parameters
(``param.sequence_parallel``), as Transformer Engine does: with sequence
parallelism each rank normalises its own tokens and the training framework
sums the parameters' gradients over the group.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

__all__ = ["LayerNorm", "RMSNorm", "norm_reference"]


def norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   eps: float, rms: bool, zero_centered_gamma: bool = False) -> torch.Tensor:
    """LayerNorm (``rms`` False) or RMSNorm of ``x`` over its last dim with
    ``kernels.reference.norm_forward``'s arithmetic, differentiable."""
    k = x.shape[-1]
    xf = x.float()
    wf = weight.float() + 1 if zero_centered_gamma else weight.float()
    if rms:
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        y = xf * rstd * wf
    else:
        y = torch.nn.functional.layer_norm(xf, [k], wf, None if bias is None else bias.float(),
                                           eps)
    return y.to(x.dtype)


@torch.no_grad()
def reset_norm_parameters(weight, bias, zero_centered_gamma: bool) -> None:
    """gamma = 1 (0 with ``zero_centered_gamma``), beta = 0 (meta: nothing)."""
    if weight.is_meta:
        return
    weight.fill_(0.0 if zero_centered_gamma else 1.0)
    if bias is not None:
        bias.zero_()


class _Norm(torch.nn.Module):
    _RMS = False
    _NAME = ""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device=None, *, hidden_size=None):
        super().__init__()
        if normalized_shape is None:
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise TypeError(f"te.{self._NAME}: give normalized_shape or hidden_size, not both")
        if (isinstance(normalized_shape, numbers.Integral)
                and not isinstance(normalized_shape, bool)):
            normalized_shape = (int(normalized_shape),)
        try:
            normalized_shape = tuple(int(d) for d in normalized_shape)
        except TypeError:
            raise ValueError(f"te.{self._NAME}: normalized_shape must be an int or a tuple of "
                             f"ints, got {normalized_shape!r}") from None
        if not normalized_shape or any(d <= 0 for d in normalized_shape):
            raise ValueError(f"te.{self._NAME}: normalized_shape must be positive, "
                             f"got {normalized_shape!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"te.{self._NAME}: eps must be a non-negative float, got {eps!r}")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if not params_dtype.is_floating_point:
            raise TypeError(f"te.{self._NAME}: params_dtype must be a floating dtype, "
                            f"got {params_dtype}")
        self.normalized_shape = normalized_shape
        self.eps = float(eps)
        self.sequence_parallel = bool(sequence_parallel)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.weight = torch.nn.Parameter(torch.empty(normalized_shape, dtype=params_dtype,
                                                     device=device))
        self.bias = None if self._RMS else torch.nn.Parameter(
            torch.empty(normalized_shape, dtype=params_dtype, device=device))
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel  # as Transformer Engine marks them
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """gamma = 1 (0 with ``zero_centered_gamma``), beta = 0."""
        reset_norm_parameters(self.weight, self.bias, self.zero_centered_gamma)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        n = len(self.normalized_shape)
        if inp.dim() < n or tuple(inp.shape[inp.dim() - n:]) != self.normalized_shape:
            raise ValueError(f"te.{self._NAME}: input of shape {tuple(inp.shape)} does not end "
                             f"in normalized_shape {self.normalized_shape}")
        if n == 1:
            return norm_reference(inp, self.weight, self.bias, self.eps, self._RMS,
                                  self.zero_centered_gamma)
        # several normalised dims: the same over their flattening
        flat = inp.reshape(*inp.shape[:inp.dim() - n], -1)
        y = norm_reference(flat, self.weight.reshape(-1),
                           None if self.bias is None else self.bias.reshape(-1),
                           self.eps, self._RMS, self.zero_centered_gamma)
        return y.view(inp.shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}"
                + (", zero_centered_gamma=True" if self.zero_centered_gamma else "")
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last
    dims (``normalized_shape``); ``gamma`` is ``1 + weight`` with
    ``zero_centered_gamma``.  Parameters ``weight``, ``bias``.  fp32 math,
    one rounding to the input's dtype (see the module docstring)."""

    _RMS = False
    _NAME = "LayerNorm"


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last dims
    (``normalized_shape``); ``gamma`` is ``1 + weight`` with
    ``zero_centered_gamma``.  Parameter ``weight``.  fp32 math, one rounding
    to the input's dtype (see the module docstring)."""

    _RMS = True
    _NAME = "RMSNorm"
