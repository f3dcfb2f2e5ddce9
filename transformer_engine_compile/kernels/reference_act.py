"""Reference numerics of the activations (te.LayerNormMLP) and the bias
kernels, in plain torch; ``kernels.reference`` re-exports them (the kernel
dispatch looks every op up there).  Split from ``reference.py`` by
responsibility: nothing here quantizes."""

from __future__ import annotations

import torch


# -- activations (LayerNormMLP), as Transformer Engine defines them -----------------
def _sigmoid_act(alpha: float):
    def act(x, grad: bool):  # x * sigmoid(alpha x) [and its derivative]
        s = torch.sigmoid(alpha * x)
        return x * s if not grad else (x * s, alpha * x * s * (1 - s) + s)
    return act


def _gelu(x, grad: bool):  # the tanh approximation
    value = x * (0.5 + 0.5 * torch.tanh(x * (0.79788456 + 0.03567741 * x * x)))
    if not grad:
        return value
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    return value, 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)


def _relu(x, grad: bool):
    value = x.clamp_min(0)
    return value if not grad else (value, (x > 0).to(x.dtype))


def _srelu(x, grad: bool):  # squared ReLU
    value = torch.where(x > 0, x * x, 0.0)
    return value if not grad else (value, (2 * x).clamp_min(0))


# name -> (fn(fp32 x, grad) -> act(x), or (act(x), act'(x)) with grad, gated)
ACTIVATIONS = {
    "gelu": (_gelu, False), "geglu": (_gelu, True),
    "qgelu": (_sigmoid_act(1.702), False), "qgeglu": (_sigmoid_act(1.702), True),
    "relu": (_relu, False), "reglu": (_relu, True),
    "srelu": (_srelu, False), "sreglu": (_srelu, True),
    "silu": (_sigmoid_act(1.0), False), "swiglu": (_sigmoid_act(1.0), True),
}


def activation_forward(x, name: str):
    """``act(x)``, or for a gated activation ``act(a) * b`` with ``a, b`` the
    first and second half of x's last dim (Transformer Engine's convention:
    the first half goes through the activation).  fp32, rounded once to x's dtype."""
    fn, gated = ACTIVATIONS[name]
    xf = x.float()
    if not gated:
        return fn(xf, False).to(x.dtype)
    a, b = xf.chunk(2, dim=-1)
    return (fn(a, False) * b).to(x.dtype)


def activation_backward(dy, x, name: str):
    """The gradient of :func:`activation_forward` w.r.t. x, from ``dy``
    (fp32, rounded once to x's dtype)."""
    fn, gated = ACTIVATIONS[name]
    xf, dyf = x.float(), dy.float()
    if not gated:
        return (fn(xf, True)[1] * dyf).to(x.dtype)
    a, b = xf.chunk(2, dim=-1)
    act, dact = fn(a, True)
    return torch.cat([dact * b * dyf, act * dyf], dim=-1).to(x.dtype)


# -- bias ---------------------------------------------------------------------------------
def bias_add(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out += bias`` (broadcast over the rows) in ``out``'s dtype; returns ``out``."""
    return out.add_(bias.to(out.dtype))


def column_sum(x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum over the rows of ``x2d`` (a bias gradient), in ``dtype``."""
    return x2d.sum(0).to(dtype)
