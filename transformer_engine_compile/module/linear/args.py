"""The arguments of ``te.Linear``'s ops, and the quantizer each operand takes.

:class:`LinearFwdArgs` and :class:`LinearBwdArgs` are the contract with the
op generator (``dynamo/custom_op.py``): every field becomes part of the
forward / backward op's schema.  The helpers below read only the arguments,
so the Python impls, the native plans and the fused layers' ops agree on
which copies (usages) of x, W and dy a call makes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import compat
from ...dynamo.buckets import TensorOrQuantized
from ...dynamo.tensor_proto import TensorProto
from ...quantization.opaque import is_value_opaque
from ...quantization.base import QuantizedTensorStorage, Quantizer


try:
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed
    ProcessGroup = None


@dataclasses.dataclass
class LinearFwdArgs:
    """Everything the forward needs; the contract with the op generator."""

    inp: torch.Tensor                      # (..., in_features), high precision
    weight: TensorOrQuantized              # (out, in): parameter or FP8 primary weight
    bias: Optional[torch.Tensor] = None
    weight_workspace: TensorOrQuantized = None  # cached quantized weight (module buffers)
    input_quantizer: Optional[Quantizer] = None
    weight_quantizer: Optional[Quantizer] = None
    output_quantizer: Optional[Quantizer] = None  # fp8_output
    grad_output_quantizer: Optional[Quantizer] = None
    grad_input_quantizer: Optional[Quantizer] = None  # fp8_grad: quantizes dgrad
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    save_original_input: bool = False      # save x, re-quantize it in backward
    save_original_weight: bool = False     # save W itself, re-quantize it in backward
    cache_weight: bool = False             # quantize the weight into weight_workspace
    main_grad: Optional[torch.Tensor] = None  # fuse_wgrad_accumulation target (fp32)
    # DelayedScaling state (module buffers): columns input, weight /
    # grad_output, grad_input (the fp8_grad output)
    amax_history_fwd: Optional[torch.Tensor] = None  # (L, 2), updated by the forward
    scale_fwd: Optional[torch.Tensor] = None         # (2,)
    amax_history_bwd: Optional[torch.Tensor] = None  # (L, 2), updated by the backward
    scale_bwd: Optional[torch.Tensor] = None         # (2,)
    parallel_mode: Optional[str] = None    # None, "column" or "row"
    sequence_parallel: bool = False
    tp_size: int = 1
    tp_group: Optional[ProcessGroup] = None
    # DelayedScaling: this step's amaxes are all-reduced (max) over this group
    # before they enter the history (te.autocast(amax_reduction_group=...)),
    # so data-parallel ranks keep identical scales
    amax_group: Optional[ProcessGroup] = None
    # FP8 GEMMs' fast accumulation (the recipe's fp8_gemm_*; Transformer
    # Engine's defaults: fprop only)
    fprop_fast_accum: bool = True
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False

    def quantizers(self) -> tuple:
        return (self.input_quantizer, self.weight_quantizer, self.output_quantizer,
                self.grad_output_quantizer, self.grad_input_quantizer)

    def compile_unsupported_reason(self) -> Optional[str]:
        """Name of the first configuration the ops do not model, else None
        (keys of ``dynamo.fallback.REASONS``)."""
        if compat.OPAQUE_UNAVAILABLE_REASON is not None:
            return "no_opaque_api"
        quantizers = self.quantizers()
        if isinstance(self.weight, QuantizedTensorStorage):
            quantizers = quantizers + (self.weight._quantizer,)
            if self.weight._quantizer is None:
                return "quantizer_not_value_opaque"
        for q in quantizers:
            if q is not None and not is_value_opaque(q):
                return "quantizer_not_value_opaque"
        return None


@dataclasses.dataclass
class LinearBwdArgs:
    grad_output: TensorOrQuantized         # (..., out_features); quantized from fp8_grad
    inputmat: TensorOrQuantized = None     # x (columnwise copy if quantized), for wgrad
    weightmat: TensorOrQuantized = None    # W (columnwise copy if quantized), for dgrad
    input_quantizer: Optional[Quantizer] = None  # re-quantizes x if save_original_input
    weight_quantizer: Optional[Quantizer] = None  # re-quantizes W if save_original_weight
    grad_output_quantizer: Optional[Quantizer] = None
    grad_input_quantizer: Optional[Quantizer] = None  # dgrad leaves quantized (fp8_grad)
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    weight_dtype: torch.dtype = torch.float32
    bias_dtype: Optional[torch.dtype] = None
    main_grad: Optional[torch.Tensor] = None     # receives wgrad by add_ (backward update)
    amax_history_bwd: Optional[torch.Tensor] = None
    scale_bwd: Optional[torch.Tensor] = None
    parallel_mode: Optional[str] = None
    sequence_parallel: bool = False
    tp_size: int = 1
    tp_group: Optional[ProcessGroup] = None
    amax_group: Optional[ProcessGroup] = None
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False


def default_accumulation(args) -> bool:
    """Whether the GEMMs accumulate as Transformer Engine's defaults (fprop
    fast, dgrad and wgrad split): the only setting the native plans run."""
    return (getattr(args, "fprop_fast_accum", True) and not args.dgrad_fast_accum
            and not args.wgrad_fast_accum)


def _out_shape(x_shape, weight_shape) -> tuple:
    return (*x_shape[:-1], weight_shape[0])


def _tp(args) -> tuple:
    """(parallel mode, sequence parallel) when the layer is split over more
    than one rank, else (None, False): a group of one needs no collective."""
    if args.parallel_mode is None or args.tp_size == 1:
        return None, False
    return args.parallel_mode, args.sequence_parallel


# -- forward ------------------------------------------------------------------------
def _reuses_workspace(args) -> bool:
    return args.weight_workspace is not None and not args.cache_weight


def _quantizes_weight(args: LinearFwdArgs) -> bool:
    """Whether this call quantizes the weight (neither a cached nor an
    already quantized weight, and a recipe)."""
    return not (_reuses_workspace(args) or args.weight_quantizer is None
                or isinstance(args.weight, QuantizedTensorStorage))


def _saves_original_weight(args: LinearFwdArgs) -> bool:
    """Whether the backward gets W itself and quantizes its columnwise copy
    there (``save_original_weight``), instead of a copy the forward keeps:
    only where this call quantizes W, caches nothing, and the copy depends
    on W's values alone (not under DelayedScaling, whose scale the forward
    moves).  Under FSDP2 the saved W is the gathered parameter, whose
    storage is freed after the forward and gathered again for the backward,
    so nothing weight-sized is held in between.  Real or fake arguments."""
    w = args.weight
    quantized = (isinstance(w, QuantizedTensorStorage)
                 or (isinstance(w, TensorProto) and w.is_quantized))
    return (args.save_original_weight and args.input_requires_grad and not quantized
            and args.weight_quantizer is not None and not args.cache_weight
            and args.weight_workspace is None and args.amax_history_fwd is None)


def _weight_quantizer(args):
    """The weight's quantizer: the columnwise copy for dgrad (unless the
    backward makes it) or the cache too."""
    dgrad = args.input_requires_grad and not _saves_original_weight(args)
    return args.weight_quantizer.usage_variant(True, dgrad or args.cache_weight)


def _paired_weight_quantizer(args, q):
    """The weight's quantizer when x (with ``q``) and W are quantized in one
    kernel (current or delayed scaling, both quantized by this call), else None."""
    if (q is None or not _quantizes_weight(args) or args.weight.device != args.inp.device):
        return None
    wq = _weight_quantizer(args)
    return wq if q.pairs_with(wq) else None


def _input_usage(args: LinearFwdArgs) -> dict:
    return {"rowwise": True,
            "columnwise": args.weight_requires_grad and not args.save_original_input}


def _input_quantizer(args: LinearFwdArgs):
    q = args.input_quantizer
    if q is None:
        return None
    return q.usage_variant(**_input_usage(args))


# -- backward ------------------------------------------------------------------------
def _grad_output_quantizer(args: LinearBwdArgs):
    """The quantizer dy needs for the GEMMs that run, else None."""
    if args.grad_output_quantizer is None or not (args.input_requires_grad
                                                  or args.weight_requires_grad):
        return None
    return args.grad_output_quantizer.usage_variant(args.input_requires_grad,
                                                    args.weight_requires_grad)
