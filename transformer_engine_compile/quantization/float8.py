"""FP8 with one per-tensor scale: delayed scaling and current scaling.

Buffers (``Float8TensorStorage._BUFFERS``): ``data`` is the rowwise copy in
the logical shape, ``transpose`` the columnwise copy as a (K, M) matrix (the
K-major operand Hopper's FP8 GEMMs need), ``scale_inv`` the shared fp32
dequantization scale.
"""

from __future__ import annotations

import torch

from .. import kernels
from .opaque import register_value_opaque_quantizer
from ..kernels import reference as ref
from ..kernels import tracing
from .base import BufferSpec, Quantizer, QuantizedTensorStorage, flat_2d, rows_2d
from .wrapper import QuantizedTensor

_FP8_ALIASES = {
    "e4m3": "e4m3", "E4M3": "e4m3", torch.float8_e4m3fn: "e4m3",
    "e5m2": "e5m2", "E5M2": "e5m2", torch.float8_e5m2: "e5m2",
}


def fp8_format_name(fmt) -> str:
    """Normalise an FP8 format given as "e4m3"/"e5m2" or a torch float8 dtype."""
    try:
        return _FP8_ALIASES[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown FP8 format {fmt!r}; use 'e4m3' or 'e5m2'") from None


class Float8TensorStorage(QuantizedTensorStorage):
    _BUFFERS = (
        BufferSpec("data", "rowwise", "FP8 values in the logical shape (..., K)"),
        BufferSpec("transpose", "columnwise", "FP8 values of the (M, K) view, transposed: (K, M)"),
        BufferSpec("scale_inv", "both", "fp32 (1,): 1 / scale, shared by both copies"),
    )
    _EXTRAS = ("fp8_format",)

    def _rowwise_2d(self):
        m, k = flat_2d(self._te_shape)
        return ref.dequantize_fp8_tensorwise(self._data.reshape(m, k), self._scale_inv)

    def _columnwise_2d(self):
        return ref.dequantize_fp8_tensorwise(self._transpose, self._scale_inv)

    def fp8_operand(self, usage: str):
        """(FP8 data reduced along its last dim, fp32 (1,) scale_inv) of one copy,
        without dequantizing: what a scaled GEMM takes."""
        self.gemm_operand_check(usage)
        if usage == "rowwise":
            return self._data.reshape(flat_2d(self._te_shape)), self._scale_inv
        return self._transpose, self._scale_inv


class Float8Tensor(Float8TensorStorage, QuantizedTensor):
    """FP8 per-tensor-scaled wrapper tensor (e.g. an FP8 primary weight)."""


class _Float8QuantizerBase(Quantizer):
    format_name = "FP8"
    storage_cls = Float8TensorStorage
    tensor_cls = Float8Tensor

    def divisibility(self):
        return (1, 1, "FP8")  # one scale per tensor: any shape

    def _layout(self, shape, m, k):
        dt = ref.FP8_DTYPE[self.fp8_format]
        return {"data": (shape, dt), "transpose": ((k, m), dt), "scale_inv": ((1,), torch.float32)}

    def _storage_extras(self):
        return (("fp8_format", self.fp8_format),)

    def _scale_for(self, x2d) -> torch.Tensor:
        raise NotImplementedError

    def _quantize_2d(self, x2d):
        fn = kernels.get("quantize_fp8_tensorwise", x2d)
        return fn(x2d, self._scale_for(x2d), self.fp8_format,
                  self.rowwise_usage, self.columnwise_usage)

    def _quantize_with_given_scale(self, x: torch.Tensor, scale: torch.Tensor,
                                   checked: bool = True, amax_out=None):
        """Quantize ``x`` with an fp32 scale computed elsewhere (one element);
        ``checked=False`` is the op impls' lean path (see ``quantize_unchecked``);
        ``amax_out`` (one zeroed fp32 element, or a ``kernels.reference.AmaxSlot``)
        receives the amax of ``x``."""
        if checked:
            self._check_input(x)
        x2d = x.detach().reshape(flat_2d(x.shape))
        fn = kernels.get("quantize_fp8_tensorwise", x2d)
        buffers = fn(x2d, scale, self.fp8_format, self.rowwise_usage, self.columnwise_usage,
                     amax_out)
        if checked:
            return self._build(x.shape, x.dtype, buffers)
        return self._from_buffers(x.shape, x.dtype, buffers)


class Float8Quantizer(_Float8QuantizerBase):
    """Delayed scaling: uses ``scale`` (from earlier steps' amaxes) and records
    this tensor's amax into ``amax`` (running max, in place).

    Stateful, so not value-opaque: ``scale`` and ``amax`` are tensors owned by
    the recipe state (see :func:`update_delayed_scaling`).
    """

    _CONFIG_FIELDS = ("fp8_format", "rowwise_usage", "columnwise_usage", "internal")

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_format="e4m3", *,
                 rowwise_usage=True, columnwise_usage=True, internal=False):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        if scale.numel() != 1 or amax.numel() != 1:
            raise ValueError("Float8Quantizer: scale and amax must hold one element each")
        self.scale = scale
        self.amax = amax
        self.fp8_format = fp8_format_name(fp8_format)

    def is_stateful(self):
        return True

    def _scale_for(self, x2d):
        cur = kernels.get("amax", x2d)(x2d).reshape(self.amax.shape)
        self.amax.copy_(torch.maximum(self.amax, cur))
        return self.scale.float()


@register_value_opaque_quantizer
class Float8CurrentScalingQuantizer(_Float8QuantizerBase):
    """Current scaling: scale = fp8_max / amax of the tensor being quantized."""

    gathers_quantized = True

    _CONFIG_FIELDS = ("fp8_format", "rowwise_usage", "columnwise_usage", "internal",
                      "force_pow_2_scales", "amax_epsilon")

    def __init__(self, fp8_format="e4m3", *, rowwise_usage=True, columnwise_usage=True,
                 internal=False, force_pow_2_scales=False, amax_epsilon=0.0):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        self.fp8_format = fp8_format_name(fp8_format)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def _quantize_2d(self, x2d):
        # amax, scale and cast in one kernel op: the scale never leaves the device
        fn = kernels.get("quantize_fp8_current", x2d)
        return fn(x2d, self.fp8_format, self.force_pow_2_scales, self.amax_epsilon,
                  self.rowwise_usage, self.columnwise_usage)

    def pairs_with(self, other) -> bool:
        return (type(other) is Float8CurrentScalingQuantizer
                and other.fp8_format == self.fp8_format
                and other.force_pow_2_scales == self.force_pow_2_scales
                and other.amax_epsilon == self.amax_epsilon)

    def quantize_pair_unchecked(self, x: torch.Tensor, other, w: torch.Tensor) -> tuple:
        """``(self.quantize_unchecked(x), other.quantize_unchecked(w))`` for a
        quantizer ``other`` that :meth:`pairs_with` this one, the same
        buffers made in one amax and one cast launch on the GPU (a layer's
        input and weight: two launches and their host time saved)."""
        return self._pair(other, x, w, "quantize_fp8_current_pair")

    def quantize_pair_with_amax(self, x: torch.Tensor, other, w: torch.Tensor,
                                parts: torch.Tensor, n_x: int) -> tuple:
        """:meth:`quantize_pair_unchecked` with both amaxes given as partial
        maxima, x's the first ``n_x`` of ``parts`` (1-D fp32), then W's: the
        normalisation of ``te.LayerNormLinear`` / ``te.LayerNormMLP`` computes
        them in its own launch (``norm_forward(..., side=W)``), so x and W take
        one more launch, the cast.  The same bytes as quantizing each alone."""
        return self._pair(other, x, w, "quantize_fp8_current_pair_from_parts", parts, n_x)

    def _pair(self, other, x, w, kernel: str, *amaxes) -> tuple:
        """The quantized x and W of one pair kernel (``amaxes``: given partial maxima)."""
        x2d, w2d = rows_2d(x), rows_2d(w)
        bx, bw = kernels.get(kernel, x2d)(
            x2d, w2d, *amaxes, self.fp8_format, self.force_pow_2_scales, self.amax_epsilon,
            (self.rowwise_usage, self.columnwise_usage),
            (other.rowwise_usage, other.columnwise_usage))
        return (self._from_buffers(x.shape, x.dtype, bx),
                other._from_buffers(w.shape, w.dtype, bw))

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, checked: bool = True):
        """Quantize ``x`` with the scale of a given amax instead of its own.

        Tensor parallelism passes the amax all-reduced over the group, so every
        rank's shard gets the scale of the whole tensor; the result equals
        ``quantize`` of the whole tensor, restricted to this shard.  The
        normalisation of ``te.LayerNormLinear`` passes the partial maxima of
        its output (``amax`` may hold several values: their max is the amax).
        ``checked=False`` is the op impls' lean path (``quantize_unchecked``)."""
        if checked:
            self._check_input(x)
        x2d = rows_2d(x)
        if amax.dim() != 1:
            amax = amax.reshape(-1)
        if amax.dtype != torch.float32:
            amax = amax.float()
        buffers = kernels.get("quantize_fp8_current", x2d)(
            x2d, self.fp8_format, self.force_pow_2_scales, self.amax_epsilon,
            self.rowwise_usage, self.columnwise_usage, amax)
        if checked:
            return self._build(x.shape, x.dtype, buffers)
        return self._from_buffers(x.shape, x.dtype, buffers)


@register_value_opaque_quantizer
class Float8DelayedScalingQuantizer(_Float8QuantizerBase):
    """Delayed scaling inside ops: the configuration only (value-opaque).

    The scale and amax history are module buffers that cross the op boundary
    as tensors; the op quantizes with :meth:`quantize_with_scale` and
    computes the new history and scale with :func:`delayed_scaling_step`.
    ``margin`` and ``amax_compute_algo`` come from the recipe."""

    _CONFIG_FIELDS = ("fp8_format", "rowwise_usage", "columnwise_usage", "internal",
                      "margin", "amax_compute_algo")

    def __init__(self, fp8_format="e4m3", *, rowwise_usage=True, columnwise_usage=True,
                 internal=False, margin=0, amax_compute_algo="max"):
        super().__init__(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage,
                         internal=internal)
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {amax_compute_algo!r}")
        self.fp8_format = fp8_format_name(fp8_format)
        self.margin = int(margin)
        self.amax_compute_algo = amax_compute_algo

    def _quantize_2d(self, x2d):
        raise RuntimeError("Float8DelayedScalingQuantizer has no scale of its own: call "
                           "quantize_with_scale(x, scale) with the layer's scale tensor")

    def quantize_with_scale(self, x: torch.Tensor, scale: torch.Tensor, checked: bool = True,
                            amax_out=None):
        """Quantize ``x`` with the layer's fp32 scale (one element); ``amax_out``
        (one fp32 element zeroed by the caller, or a ``kernels.reference.AmaxSlot``
        of a zeroed vector) records ``x``'s amax on the way."""
        return self._quantize_with_given_scale(x, scale, checked, amax_out)

    def pairs_with(self, other) -> bool:
        return type(other) is Float8DelayedScalingQuantizer and other.fp8_format == self.fp8_format

    def quantize_stepped(self, x: torch.Tensor, scales: torch.Tensor, step, other=None,
                         w=None) -> tuple:
        """``(x quantized with scales[0], w quantized by other with scales[1],
        or None without w)``: their amaxes are this step's history columns 0
        and 1, then ``step`` (:meth:`step_after`, which may write over
        ``scales``) runs.  On the GPU one launch and no amax vector to zero
        (kernels/triton_delayed.py).  ``other`` :meth:`pairs_with` this
        quantizer; None with ``w``: w's amax alone is recorded (its FP8
        copy is cached) and the second result is None.  Unchecked: the op
        impls' lean path."""
        x2d = rows_2d(x)
        w2d = None if w is None else rows_2d(w)
        usage_w = (False, False) if other is None else (other.rowwise_usage,
                                                        other.columnwise_usage)
        bx, bw = kernels.get("quantize_fp8_delayed", x2d)(
            x2d, w2d, scales, self.fp8_format, (self.rowwise_usage, self.columnwise_usage),
            usage_w, step)
        return (self._from_buffers(x.shape, x.dtype, bx),
                None if bw is None else other._from_buffers(w.shape, w.dtype, bw))

    def step_after(self, amax_history: torch.Tensor, scale: torch.Tensor):
        """This quantizer's delayed-scaling step (:func:`delayed_scaling_step`)
        for a quantization to run after it records the last amax of an op
        call (``kernels.reference.StepAfter``), or to run on its own
        (``kernels.get("run_step")``), into new buffers; over
        ``amax_history`` and ``scale`` themselves inside a lowered trace,
        as ``kernels.triton_quant.run_step`` explains (functionalized: both
        keep their values), and in the eager path
        (``tracing.eager_buffers_in_place``)."""
        if tracing.eager_in_place() or tracing.functional(amax_history, scale):
            new_history, new_scale = amax_history, scale
        else:
            new_history, new_scale = torch.empty_like(amax_history), torch.empty_like(scale)
        return ref.StepAfter(amax_history, new_history, new_scale, self.fp8_format, self.margin,
                             self.amax_compute_algo)


def delayed_scaling_step(amax_history: torch.Tensor, amaxes: torch.Tensor, *,
                         fp8_format="e4m3", margin: int = 0,
                         amax_compute_algo: str = "max") -> tuple:
    """One delayed-scaling update, functional: ``(new history, new scale)``.

    ``amax_history`` is ``(L, n)`` (one column per tensor), ``amaxes`` the
    ``(n,)`` amaxes of this step, recorded in row 0.  The scale comes from the
    history (``"max"`` over all rows or ``"most_recent"`` = this step); then
    the history rolls down one row and row 0 is zeroed for the next step.
    (``kernels.reference.delayed_scaling_step`` defines it; CUDA runs it as
    one kernel.)
    """
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', "
                         f"got {amax_compute_algo!r}")
    fn = kernels.get("delayed_scaling_step", amax_history)
    return fn(amax_history, amaxes, fp8_format_name(fp8_format), int(margin), amax_compute_algo)


def update_delayed_scaling(amax_history: torch.Tensor, scale: torch.Tensor, *,
                           fp8_format="e4m3", margin: int = 0,
                           amax_compute_algo: str = "max") -> None:
    """End-of-step delayed-scaling update, in place, no host sync.

    ``amax_history[0]`` holds the amax recorded this step (the slot a
    :class:`Float8Quantizer` writes); see :func:`delayed_scaling_step`.
    """
    hist, new_scale = delayed_scaling_step(amax_history, amax_history[0], fp8_format=fp8_format,
                                           margin=margin, amax_compute_algo=amax_compute_algo)
    scale.copy_(new_scale.reshape(scale.shape))
    amax_history.copy_(hist)
