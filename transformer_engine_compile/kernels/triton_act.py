"""LayerNormMLP's activations for CUDA, in Triton: one launch forward, one
backward, for every activation of ``kernels.reference.ACTIVATIONS``.

Same signatures and formulas as ``reference.activation_forward`` /
``activation_backward`` (fp32 math, one rounding to the input's dtype);
equal to them up to the last fp32 bit of ``exp`` / ``tanh`` (the GPU tests
bound the difference to one rounding of the output dtype).  The reference
runs 6-15 elementwise torch kernels with fp32 temporaries of fc1's whole
output; these read it once and write once.  Launched through
:class:`triton_launch.Launcher`; nothing reads back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .triton_launch import Launcher, cdiv, int_key, ptr_key

try:  # CUDA's tanhf, as torch.tanh uses.  Named ``libdevice``: inductor
    # re-emits a lowered kernel's source under its own imports, which
    # define that name (an alias would be undefined there)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - other Triton versions
    libdevice = None
_HAS_LIBDEVICE = tl.constexpr(libdevice is not None)

# activation codes (constexpr): the function, and its parameter for the sigmoid family
_CODES = {"gelu": (0, 0.0), "geglu": (0, 0.0), "relu": (1, 0.0), "reglu": (1, 0.0),
          "srelu": (2, 0.0), "sreglu": (2, 0.0), "silu": (3, 1.0), "swiglu": (3, 1.0),
          "qgelu": (3, 1.702), "qgeglu": (3, 1.702)}
_BM, _BN = 16, 256


@triton.jit
def _tanh_of(u):
    if _HAS_LIBDEVICE:
        return libdevice.tanh(u)
    return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0  # saturates correctly at both ends


@triton.jit
def _act(x, ACT: tl.constexpr, ALPHA: tl.constexpr, GRAD: tl.constexpr):
    """(act(x), act'(x) if GRAD else 0), the reference's formulas in fp32."""
    if ACT == 0:  # gelu, tanh approximation
        value = x * (0.5 + 0.5 * _tanh_of(x * (0.79788456 + 0.03567741 * x * x)))
        if GRAD:
            t = _tanh_of(0.79788456 * x * (1 + 0.044715 * x * x))
            d = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        else:
            d = value
    elif ACT == 1:  # relu
        value = tl.maximum(x, 0.0)
        d = tl.where(x > 0, 1.0, 0.0)
    elif ACT == 2:  # squared relu
        value = tl.where(x > 0, x * x, 0.0)
        d = tl.maximum(2 * x, 0.0)
    else:  # x * sigmoid(alpha x)
        s = 1.0 / (1.0 + tl.exp(-(ALPHA * x)))
        value = x * s
        d = ALPHA * x * s * (1 - s) + s
    return value, d


@triton.jit
def _act_fwd_kernel(x_ptr, y_ptr, M, N, F, ACT: tl.constexpr, ALPHA: tl.constexpr,
                    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """y (M, F) from x (M, N): N = 2F gated (act(first half) * second half), else N = F."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < F)[None, :]
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    a = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    value, _ = _act(a, ACT, ALPHA, False)
    if GATED:
        b = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
        value = value * b
    out = rm[:, None].to(tl.int64) * F + rn[None, :]
    tl.store(y_ptr + out, value.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(dy_ptr, x_ptr, dx_ptr, M, N, F, ACT: tl.constexpr, ALPHA: tl.constexpr,
                    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < F)[None, :]
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    dy = tl.load(dy_ptr + rm[:, None].to(tl.int64) * F + rn[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    a = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    value, d = _act(a, ACT, ALPHA, True)
    ty = dx_ptr.dtype.element_ty
    if GATED:
        b = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, (d * b * dy).to(ty), mask=mask)
        tl.store(dx_ptr + offs + F, (value * dy).to(ty), mask=mask)
    else:
        tl.store(dx_ptr + offs, (d * dy).to(ty), mask=mask)


_fwd_launch = Launcher(_act_fwd_kernel, num_warps=4)
_bwd_launch = Launcher(_act_bwd_kernel, num_warps=4)


def _plain(x) -> bool:
    return x.is_contiguous() and x.numel() > 0 and x.dtype in (torch.bfloat16, torch.float16,
                                                               torch.float32)


def forward_call(x, name: str):
    """The forward launch for a plain ``x``: ``(grid, key, args, y)``, with
    ``y`` allocated (module/layernorm/mlp_native.py fixes these arguments
    in a native launch)."""
    gated = ref.ACTIVATIONS[name][1]
    n = x.shape[-1]
    m, f = x.numel() // n, n // 2 if gated else n
    y = torch.empty((*x.shape[:-1], f), dtype=x.dtype, device=x.device)
    code, alpha = _CODES[name]
    key = (x.dtype, int_key(m), int_key(n), int_key(f), ptr_key(x), code, alpha, gated)
    return ((cdiv(m, _BM), cdiv(f, _BN)), key, (x, y, m, n, f, code, alpha, gated, _BM, _BN), y)


def backward_call(dy, x, name: str):
    """The backward launch for plain ``dy`` and ``x``: ``(grid, key, args, dx)``."""
    gated = ref.ACTIVATIONS[name][1]
    n = x.shape[-1]
    m, f = x.numel() // n, n // 2 if gated else n
    dx = torch.empty_like(x)
    code, alpha = _CODES[name]
    key = (dy.dtype, x.dtype, int_key(m), int_key(n), int_key(f), ptr_key(x), ptr_key(dy),
           code, alpha, gated)
    return ((cdiv(m, _BM), cdiv(f, _BN)), key,
            (dy, x, dx, m, n, f, code, alpha, gated, _BM, _BN), dx)


def activation_forward(x, name: str):
    if not _plain(x):
        return ref.activation_forward(x, name)
    grid, key, args, y = forward_call(x, name)
    _fwd_launch(grid, key, *args)
    return y


def activation_backward(dy, x, name: str):
    if not (_plain(x) and _plain(dy)):
        return ref.activation_backward(dy, x, name)
    grid, key, args, dx = backward_call(dy, x, name)
    _bwd_launch(grid, key, *args)
    return dx
