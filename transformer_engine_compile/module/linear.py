"""``te.Linear``: ``y = x W^T + b`` with quantized GEMMs, eager and compiled.

The forward and backward are written once, against :class:`LinearFwdArgs`
and :class:`LinearBwdArgs`.  Eager mode runs them under a
``torch.autograd.Function``; under ``torch.compile`` they run inside two
generated custom ops (``te_compile::linear_fwd`` / ``linear_bwd``).  Each
real impl has a fake next to it that follows the same control flow on
:class:`TensorProto`s; the layout-parity test holds them together.

GEMM operands and copies (usages), see ``kernels/gemm.py``:
fprop uses x rowwise and W rowwise, dgrad dy rowwise and W columnwise,
wgrad dy columnwise and x columnwise.

Tensor / sequence parallelism (``parallel_mode``, ``sequence_parallel``):
the collectives run inside the same ops, see ``distributed.py``; the fakes
scale the leading dim (an all-gather multiplies it by ``tp_size``, a
reduce-scatter divides it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import distributed as D
from .. import kernels
from ..dynamo import compat
from ..dynamo.buckets import TensorOrQuantized
from ..dynamo.custom_op import OpResult, register_custom_op
from ..dynamo.opaque import is_value_opaque
from ..dynamo.state import ensure_buffers, register_module
from ..dynamo.tensor_proto import TensorProto, to_tensor_proto
from ..kernels.gemm import gemm
from ..quantization.base import QuantizedTensorStorage, Quantizer

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


def _out_shape(x_shape, weight_shape) -> tuple:
    return (*x_shape[:-1], weight_shape[0])


def _tp(args) -> tuple:
    """(parallel mode, sequence parallel) when the layer is split over more
    than one rank, else (None, False): a group of one needs no collective."""
    if args.parallel_mode is None or args.tp_size == 1:
        return None, False
    return args.parallel_mode, args.sequence_parallel


# -- delayed scaling ------------------------------------------------------------------
def _quantize(q, x, scales, slot: int):
    """``q.quantize(x)``, or with the layer's delayed-scaling scale ``scales[slot]``."""
    return q.quantize(x) if scales is None else q.quantize_with_scale(x, scales[slot])


def _amax(x) -> torch.Tensor:
    x2d = x.detach().reshape(-1, x.shape[-1])
    return kernels.get("amax", x2d)(x2d).reshape(()).float()


def _delayed_updates(q, history, amaxes: list, prefix: str) -> dict:
    """Outputs that update the delayed-scaling buffers (LINEAR_OPS's ``*_updates``)."""
    if history is None:
        return {}
    new_history, new_scale = q.step(history, torch.stack(amaxes))
    return {f"amax_history_{prefix}": new_history, f"scale_{prefix}": new_scale}


def _delayed_updates_fake(history, prefix: str) -> dict:
    if history is None:
        return {}
    return {f"amax_history_{prefix}": TensorProto(history.shape, history.dtype,
                                                  device=history.device),
            f"scale_{prefix}": TensorProto(history.shape[1:], history.dtype,
                                           device=history.device)}


# -- forward ------------------------------------------------------------------------
def _reuses_workspace(args) -> bool:
    return args.weight_workspace is not None and not args.cache_weight


def _weight_for_gemm(args: LinearFwdArgs):
    """(weight operand, freshly cached workspace or None)."""
    if _reuses_workspace(args):
        return args.weight_workspace, None
    w = args.weight
    if isinstance(w, QuantizedTensorStorage) or args.weight_quantizer is None:
        return w, None
    q = args.weight_quantizer.with_usage(
        rowwise=True, columnwise=args.input_requires_grad or args.cache_weight)
    wq = _quantize(q, w, args.scale_fwd, 1)
    return wq, (wq if args.cache_weight else None)


def _weight_for_gemm_fake(args: LinearFwdArgs):
    if _reuses_workspace(args):
        return args.weight_workspace, None
    w = args.weight
    if w.is_quantized or args.weight_quantizer is None:
        return w, None
    q = args.weight_quantizer.with_usage(
        rowwise=True, columnwise=args.input_requires_grad or args.cache_weight)
    wq = TensorProto(w.shape, w.dtype, q, device=w.device)
    return wq, (wq if args.cache_weight else None)


def _input_usage(args: LinearFwdArgs) -> dict:
    return {"rowwise": True,
            "columnwise": args.weight_requires_grad and not args.save_original_input}


def _input_quantizer(args: LinearFwdArgs):
    q = args.input_quantizer
    return None if q is None else q.with_usage(**_input_usage(args))


def linear_forward(args: LinearFwdArgs) -> OpResult:
    x = args.inp
    mode, sp = _tp(args)
    q = _input_quantizer(args)
    if mode == "column" and sp:  # x_total is None when only FP8 bytes were gathered
        x_total, xq = D.gather_and_quantize(x, q, args.tp_group, args.tp_size,
                                            quantized_gather=not args.save_original_input)
    else:
        x_total, xq = x, (x if q is None else _quantize(q, x, args.scale_fwd, 0))
    w, workspace = _weight_for_gemm(args)
    y = gemm(xq, "rowwise", w, "rowwise", x.dtype, None if mode == "row" else args.bias,
             fast_accum=True).view(_out_shape(xq.shape, w.shape))
    if mode == "row":  # partial sums over in_features: reduce, then add the bias once
        y = (D.reduce_scatter_first_dim(y, args.tp_group, args.tp_size) if sp
             else D.all_reduce_sum(y, args.tp_group))
        if args.bias is not None:
            y = y + args.bias
    if args.output_quantizer is not None:
        y = args.output_quantizer.quantize(y)
    saved_x = None
    if args.weight_requires_grad:
        saved_x = x_total
        if xq is not x_total and not args.save_original_input:
            xq.update_usage(rowwise_usage=False)  # wgrad reads the columnwise copy only
            saved_x = xq
    saved_w = w if args.input_requires_grad else None
    state = {}
    if args.amax_history_fwd is not None:
        w_amax = (torch.zeros((), device=x.device) if isinstance(args.weight, QuantizedTensorStorage)
                  else _amax(args.weight))
        state = _delayed_updates(args.input_quantizer, args.amax_history_fwd,
                                 [_amax(x), w_amax], "fwd")
    return OpResult({"out": y, "weight_workspace": workspace, **state},
                    {"inputmat": saved_x, "weightmat": saved_w, **_saved_for_updates(args)})


def _saved_for_updates(args: LinearFwdArgs) -> dict:
    """Forward arguments the backward writes into (aliases, not copies)."""
    return {"main_grad": args.main_grad, "amax_history_bwd": args.amax_history_bwd,
            "scale_bwd": args.scale_bwd}


def linear_forward_fake(args: LinearFwdArgs) -> OpResult:
    x = args.inp
    mode, sp = _tp(args)
    q = _input_quantizer(args)
    x_total = x
    if mode == "column" and sp:
        x_total = TensorProto(D.gathered_shape(x.shape, args.tp_size), x.dtype, device=x.device)
    xq = x_total if q is None else TensorProto(x_total.shape, x.dtype, q, device=x.device)
    if mode == "column" and sp and q is not None and D.gathers_quantized(
            q, not args.save_original_input):
        x_total = None
    w, workspace = _weight_for_gemm_fake(args)
    y_shape = _out_shape(xq.shape, w.shape)
    if mode == "row" and sp:
        y_shape = D.scattered_shape(y_shape, args.tp_size)
    y = TensorProto(y_shape, x.dtype, device=x.device)
    if args.output_quantizer is not None:
        y = TensorProto(y.shape, y.dtype, args.output_quantizer, device=x.device)
    saved_x = None
    if args.weight_requires_grad:
        saved_x = x_total
        if xq is not x_total and not args.save_original_input:
            xq.update_usage(rowwise=False)
            saved_x = xq
    saved_w = w if args.input_requires_grad else None
    return OpResult({"out": y, "weight_workspace": workspace,
                     **_delayed_updates_fake(args.amax_history_fwd, "fwd")},
                    {"inputmat": saved_x, "weightmat": saved_w, **_saved_for_updates(args)})


def linear_setup_context(args: LinearFwdArgs) -> dict:
    """Non-tensor fields of LinearBwdArgs (tensors come from ``saved``)."""
    return {
        "input_quantizer": args.input_quantizer if args.save_original_input else None,
        "grad_output_quantizer": args.grad_output_quantizer,
        "grad_input_quantizer": args.grad_input_quantizer,
        "input_requires_grad": args.input_requires_grad,
        "weight_requires_grad": args.weight_requires_grad,
        "bias_requires_grad": args.bias_requires_grad,
        "weight_dtype": args.weight.dtype,
        "bias_dtype": None if args.bias is None else args.bias.dtype,
        "parallel_mode": args.parallel_mode,
        "sequence_parallel": args.sequence_parallel,
        "tp_size": args.tp_size,
        "tp_group": args.tp_group,
    }


# -- backward ------------------------------------------------------------------------
def _grad_output_usage(args: LinearBwdArgs) -> dict:
    return {"rowwise": args.input_requires_grad, "columnwise": args.weight_requires_grad}


def _grad_output_quantizer(args: LinearBwdArgs):
    """The quantizer dy needs for the GEMMs that run, else None."""
    if args.grad_output_quantizer is None or not (args.input_requires_grad
                                                  or args.weight_requires_grad):
        return None
    return args.grad_output_quantizer.with_usage(**_grad_output_usage(args))


def _incoming_quantizer(dy):
    """Quantizer (with the usages present) of a quantized dy, real or proto; else None."""
    if isinstance(dy, TensorProto):
        return dy.quantizer
    if isinstance(dy, QuantizedTensorStorage) and dy._quantizer is not None:
        return to_tensor_proto(dy).quantizer
    return None


def _uses_quantized_grad(args: LinearBwdArgs, q) -> bool:
    """True when dy arrived quantized (``fp8_grad`` of the next layer) in
    exactly the format this layer would make, with the copies it needs: the
    GEMMs then read it as is, bit for bit what quantizing dy here gives.
    Under DelayedScaling dy keeps the scale it was quantized with (the next
    layer's grad-input scale).  Otherwise a quantized dy is dequantized
    first (another recipe, a missing copy, or row + SP, which gathers
    high-precision shards)."""
    incoming = _incoming_quantizer(args.grad_output)
    if incoming is None or q is None:
        return False
    if _tp(args) == ("row", True):
        return False
    same = dict(rowwise=True, columnwise=True, internal=True)
    if incoming.with_usage(**same) != q.with_usage(**same):
        return False
    return ((incoming.rowwise_usage or not q.rowwise_usage)
            and (incoming.columnwise_usage or not q.columnwise_usage))


def _needs_requantized_input(args: LinearBwdArgs, x) -> bool:
    """True when the saved input is high precision but wgrad is quantized
    (save_original_input); ``x`` is a tensor/storage (real) or a proto (fake)."""
    quantized_x = (isinstance(x, QuantizedTensorStorage)
                   or (isinstance(x, TensorProto) and x.is_quantized))
    return args.input_quantizer is not None and not quantized_x


def linear_backward(args: LinearBwdArgs) -> dict:
    dy = args.grad_output
    mode, sp = _tp(args)
    q = _grad_output_quantizer(args)
    delayed = q is not None and args.amax_history_bwd is not None
    if _uses_quantized_grad(args, q):
        dyq = dy  # its amax (delayed scaling) and bias gradient: from its values
        dy = dy_total = dy.dequantize() if args.bias_requires_grad or delayed else None
    else:
        if isinstance(dy, QuantizedTensorStorage):
            dy = dy.dequantize()
        if mode == "row" and sp:  # dy_total is None when only FP8 bytes were gathered
            dy_total, dyq = D.gather_and_quantize(dy, q, args.tp_group, args.tp_size)
        else:
            dy_total, dyq = dy, (dy if q is None else _quantize(q, dy, args.scale_bwd, 0))
    amaxes = [_amax(dy), torch.zeros((), device=dy.device)] if delayed else None
    dtype, n_out = args.grad_output.dtype, args.grad_output.shape[-1]
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        w = args.weightmat
        dgrad = gemm(dyq, "rowwise", w, "columnwise", dtype).view(
            *dyq.shape[:-1], w.shape[-1])
        if mode == "column":  # partial sums over out_features
            dgrad = (D.reduce_scatter_first_dim(dgrad, args.tp_group, args.tp_size) if sp
                     else D.all_reduce_sum(dgrad, args.tp_group))
        if args.grad_input_quantizer is not None:  # fp8_grad: the previous layer's dy
            if delayed:
                amaxes[1] = _amax(dgrad)
            dgrad = _quantize(args.grad_input_quantizer, dgrad, args.scale_bwd, 1)
    state = {} if not delayed else _delayed_updates(q, args.amax_history_bwd, amaxes, "bwd")
    if args.weight_requires_grad:
        x = args.inputmat
        if _needs_requantized_input(args, x):
            x = args.input_quantizer.with_usage(rowwise=False, columnwise=True).quantize(x)
        if args.main_grad is not None:  # accumulated by the "main_grad" update
            state["main_grad"] = gemm(dyq, "columnwise", x, "columnwise", args.main_grad.dtype)
        else:
            wgrad = gemm(dyq, "columnwise", x, "columnwise", args.weight_dtype)
    if args.bias_requires_grad:
        if dy_total is not None:
            dbias = dy_total.reshape(-1, n_out).sum(0).to(args.bias_dtype)
        else:  # row + SP with FP8 gather: sum the shards' partial sums
            partial = dy.reshape(-1, n_out).float().sum(0)
            dbias = D.all_reduce_sum(partial, args.tp_group).to(args.bias_dtype)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias, **state}


def linear_backward_fake(args: LinearBwdArgs) -> dict:
    dy = args.grad_output
    mode, sp = _tp(args)
    q = _grad_output_quantizer(args)
    rows = dy.shape[:-1]
    if mode == "row" and sp:
        rows = D.gathered_shape(rows, args.tp_size)
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        dgrad_shape = (*rows, args.weightmat.shape[-1])
        if mode == "column" and sp:
            dgrad_shape = D.scattered_shape(dgrad_shape, args.tp_size)
        dgrad = TensorProto(dgrad_shape, dy.dtype, args.grad_input_quantizer, device=dy.device)
    state = _delayed_updates_fake(args.amax_history_bwd, "bwd") if q is not None else {}
    if args.weight_requires_grad:
        shape = (dy.shape[-1], args.inputmat.shape[-1])
        if args.main_grad is None:
            wgrad = TensorProto(shape, args.weight_dtype, device=dy.device)
        else:
            state["main_grad"] = TensorProto(shape, args.main_grad.dtype, device=dy.device)
    if args.bias_requires_grad:
        dbias = TensorProto((dy.shape[-1],), args.bias_dtype, device=dy.device)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias, **state}


LINEAR_OPS = register_custom_op(
    "linear",
    fwd_args=LinearFwdArgs, bwd_args=LinearBwdArgs,
    forward=linear_forward, forward_fake=linear_forward_fake,
    backward=linear_backward, backward_fake=linear_backward_fake,
    setup_context=linear_setup_context,
    grad_fields={"grad_output": "out"},
    # state written right after the ops, visible to PyTorch (see custom_op.py)
    forward_updates={"weight_workspace": "weight_workspace", "amax_history_fwd":
                     "amax_history_fwd", "scale_fwd": "scale_fwd"},
    backward_updates={"main_grad": ("main_grad", "add"), "amax_history_bwd": "amax_history_bwd",
                      "scale_bwd": "scale_bwd"},
)


# -- the module ----------------------------------------------------------------------
def _parallel_config(parallel_mode, tp_group, tp_size, sequence_parallel) -> tuple:
    """Validated ``(parallel_mode, tp_group, tp_size)``: the group's size wins
    over ``tp_size``; more than one rank needs a group."""
    if parallel_mode not in D.PARALLEL_MODES:
        raise ValueError(f"te.Linear: parallel_mode must be None, 'column' or 'row', "
                         f"got {parallel_mode!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"te.Linear: tp_size must be a positive int, got {tp_size!r}")
    if sequence_parallel and parallel_mode is None:
        raise ValueError("te.Linear: sequence_parallel=True needs parallel_mode "
                         "'column' or 'row'")
    if tp_group is not None:
        group_size = torch.distributed.get_world_size(tp_group)
        if tp_size not in (1, group_size):
            raise ValueError(f"te.Linear: tp_size={tp_size} but tp_group has "
                             f"{group_size} ranks")
        tp_size = group_size
    elif tp_size > 1:
        raise ValueError(f"te.Linear: tp_size={tp_size} needs tp_group (the process group "
                         "the layer is split over)")
    if parallel_mode is None:
        return None, tp_group, 1  # not split: no collectives
    return parallel_mode, tp_group, tp_size


class Linear(torch.nn.Module):
    """Linear layer with Transformer Engine's argument names.

    Quantization follows the active ``te.autocast`` recipe.  ``forward`` runs
    the eager ``autograd.Function`` or, under ``torch.compile``, the custom
    ops (no Dynamo-disabling decorator); configurations the ops do not model
    fall back to eager (see ``compile_fallbacks``, docs/fallback.md).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 return_bias: bool = False, parallel_mode: Optional[str] = None, tp_group=None,
                 tp_size: int = 1, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 name: Optional[str] = None):
        super().__init__()
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"te.Linear: {arg} must be a positive int, got {value!r}")
        self.parallel_mode, self.tp_group, self.tp_size = _parallel_config(
            parallel_mode, tp_group, tp_size, sequence_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        split = {"column": ("out_features", out_features),
                 "row": ("in_features", in_features)}.get(parallel_mode)
        if split is not None and split[1] % self.tp_size != 0:
            raise ValueError(f"te.Linear: parallel_mode={parallel_mode!r} splits {split[0]} "
                             f"({split[1]}) over tp_size {self.tp_size}, which must divide it")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if not params_dtype.is_floating_point or params_dtype.itemsize < 2:
            raise TypeError(f"te.Linear: params_dtype must be float32, bfloat16 or float16, "
                            f"got {params_dtype}")
        self.in_features, self.out_features = in_features, out_features
        # this rank's shard of the weight: (local_out, local_in)
        self.local_out_features = out_features // (self.tp_size if parallel_mode == "column" else 1)
        self.local_in_features = in_features // (self.tp_size if parallel_mode == "row" else 1)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.name = name
        self.weight = torch.nn.Parameter(torch.empty(
            self.local_out_features, self.local_in_features, dtype=params_dtype, device=device))
        bias_features = self.local_out_features if parallel_mode == "column" else out_features
        self.bias = (torch.nn.Parameter(torch.zeros(bias_features, dtype=params_dtype,
                                                    device=device))
                     if bias else None)
        if init_method is not None:
            init_method(self.weight)
        else:
            torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as torch.nn.Linear
        self._state_key = register_module(self)  # names it for trace-time buffer allocation

    def extra_repr(self) -> str:
        tp = (f", parallel_mode={self.parallel_mode!r}, tp_size={self.tp_size}, "
              f"sequence_parallel={self.sequence_parallel}" if self.parallel_mode else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}{tp}")

    @torch.no_grad()
    def load_full_weight_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        """Copy this rank's shard of a full ``(out, in)`` weight (and ``(out,)``
        bias) into the layer: a TP layer then equals the single-device layer
        built from the same full parameters."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"te.Linear.load_full_weight_: expected a weight of shape "
                             f"{(self.out_features, self.in_features)}, got {tuple(weight.shape)}")
        rank = 0 if self.tp_group is None else torch.distributed.get_rank(self.tp_group)
        self.weight.copy_(D.shard_parameter(weight, self.parallel_mode, rank, self.tp_size))
        if bias is not None:
            if self.bias is None or tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"te.Linear.load_full_weight_: bias must be of shape "
                                 f"({self.out_features},) on a layer with a bias")
            self.bias.copy_(D.shard_parameter(bias, self.parallel_mode, rank, self.tp_size,
                                              is_bias=True))
        return self

    # -- argument building (runs in eager and in traced code) -----------------------------
    def _check_input(self, inp) -> None:
        if not isinstance(inp, torch.Tensor) or isinstance(inp, QuantizedTensorStorage):
            raise TypeError(f"te.Linear expects a high-precision torch.Tensor input, "
                            f"got {type(inp).__name__}")
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"te.Linear input must be float32, bfloat16 or float16, got {inp.dtype}")
        if inp.dim() == 0 or inp.shape[-1] != self.local_in_features:
            shard = " (this rank's shard of in_features)" if self.parallel_mode == "row" else ""
            raise ValueError(f"te.Linear({self.in_features} -> {self.out_features}): input of "
                             f"shape {tuple(inp.shape)} must end in "
                             f"{self.local_in_features}{shard}")
        if self._tp_active() and self.sequence_parallel:
            if inp.dim() < 2:
                raise ValueError("te.Linear(sequence_parallel=True): the input needs a "
                                 "sequence dimension first, got shape "
                                 f"{tuple(inp.shape)}")
            if self.parallel_mode == "row" and inp.shape[0] % self.tp_size != 0:
                raise ValueError(
                    f"te.Linear(parallel_mode='row', sequence_parallel=True): the sequence "
                    f"length {inp.shape[0]} (dim 0 of the input) must be divisible by "
                    f"tp_size {self.tp_size} to reduce-scatter the output")

    def _tp_active(self) -> bool:
        return self.parallel_mode is not None and self.tp_size > 1

    def _make_args(self, inp, is_first_microbatch, fp8_output, fp8_grad) -> LinearFwdArgs:
        from ..autocast import get_autocast_recipe
        from ..quantization.factory import quantizer_for

        self._check_input(inp)
        recipe = get_autocast_recipe()
        weight, bias = self.weight, self.bias
        grad = torch.is_grad_enabled()
        args = LinearFwdArgs(
            inp=inp, weight=weight, bias=None if self.return_bias else bias,
            input_requires_grad=grad and inp.requires_grad,
            weight_requires_grad=grad and weight.requires_grad,
            bias_requires_grad=grad and bias is not None and bias.requires_grad
            and not self.return_bias,
            save_original_input=self.save_original_input,
            parallel_mode=self.parallel_mode, sequence_parallel=self.sequence_parallel,
            tp_size=self.tp_size, tp_group=self.tp_group,
        )
        if fp8_output and recipe is None:
            raise ValueError("te.Linear: fp8_output=True needs an active quantization recipe "
                             "(te.autocast(enabled=True, recipe=...))")
        if fp8_output and (args.input_requires_grad or args.weight_requires_grad
                           or args.bias_requires_grad):
            raise NotImplementedError(
                "te.Linear: fp8_output=True is supported without gradients only (inference "
                "or torch.no_grad()): autograd through a quantized output is not modelled")
        if fp8_output and recipe.delayed():
            raise NotImplementedError("te.Linear: fp8_output=True under DelayedScaling needs an "
                                      "output scale the layer does not keep; use "
                                      "recipe.Float8CurrentScaling()")
        if fp8_grad:
            self._check_fp8_grad(recipe)
        if recipe is not None:
            args.input_quantizer = quantizer_for(recipe, "input", internal=True)
            args.weight_quantizer = quantizer_for(recipe, "weight", internal=True)
            args.grad_output_quantizer = quantizer_for(recipe, "grad_output", internal=True)
            if fp8_output:
                args.output_quantizer = quantizer_for(recipe, "output")
            if fp8_grad and args.input_requires_grad:  # both copies: the consumer's dgrad, wgrad
                args.grad_input_quantizer = quantizer_for(recipe, "grad_input").with_usage(
                    rowwise=True, columnwise=True)  # (under DelayedScaling: scale_bwd[1])
            self._check_shapes(args, inp)
        elif not isinstance(weight, QuantizedTensorStorage) and inp.dtype != weight.dtype:
            raise TypeError(f"te.Linear: input dtype {inp.dtype} differs from the weight's "
                            f"{weight.dtype} and no quantization recipe is active")
        if self.fuse_wgrad_accumulation and args.weight_requires_grad:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is None:
                raise RuntimeError("te.Linear(fuse_wgrad_accumulation=True) needs "
                                   "weight.main_grad (an fp32 tensor shaped like the weight)")
            args.main_grad = main_grad
        delayed = recipe is not None and recipe.delayed()
        cache = (is_first_microbatch is not None and args.weight_quantizer is not None
                 and not isinstance(weight, QuantizedTensorStorage))
        if delayed or cache:
            self._bind_state(args, recipe if delayed else None,
                             None if not cache else bool(is_first_microbatch))
        return args

    def _check_fp8_grad(self, recipe) -> None:
        """``fp8_grad=True`` needs an FP8 recipe whose dgrad quantization the
        previous layer reads as its own dy: FP8 current scaling, FP8
        blockwise and MXFP8 (bit for bit what that layer would make), and
        DelayedScaling (with this layer's grad-input scale)."""
        from .. import recipe as R

        if recipe is None:
            raise ValueError("te.Linear: fp8_grad=True needs an active quantization recipe "
                             "(te.autocast(enabled=True, recipe=...))")
        if isinstance(recipe, R.NVFP4BlockScaling):
            raise ValueError(
                "te.Linear: fp8_grad=True has no FP8 gradient format under NVFP4BlockScaling "
                "(the layer that consumes the gradient quantizes it to NVFP4 itself, with "
                "stochastic rounding and its own Hadamard transform)")
        if self._tp_active():
            raise NotImplementedError("te.Linear: fp8_grad=True with tensor parallelism is not "
                                      "supported")

    # -- state kept in module buffers (allocated at trace time, see dynamo/state.py) ------
    def _bind_state(self, args: LinearFwdArgs, delayed_recipe, first_microbatch) -> None:
        """Allocate (once) and bind the layer's buffers: the DelayedScaling
        amax histories and scales, and the FP8 weight cache, which is written
        on the first microbatch (``cache_weight``) and read on the others."""
        layout = ()
        if delayed_recipe is not None:
            if self._tp_active():
                raise NotImplementedError(
                    "te.Linear: DelayedScaling with tensor parallelism is not supported (the "
                    "amax would need a reduction over the group); use "
                    "recipe.Float8CurrentScaling()")
            if self.save_original_input:
                raise ValueError("te.Linear(save_original_input=True) cannot re-quantize the "
                                 "input in the backward under DelayedScaling (its scale has "
                                 "moved on); use recipe.Float8CurrentScaling()")
            n, f32 = delayed_recipe.constant("amax_history_len"), torch.float32
            layout = (("fp8_amax_history_fwd", (n, 2), f32, 0.0, None),
                      ("fp8_scale_fwd", (2,), f32, 1.0, None),
                      ("fp8_amax_history_bwd", (n, 2), f32, 0.0, None),
                      ("fp8_scale_bwd", (2,), f32, 1.0, None))
        if first_microbatch is not None:
            q = args.weight_quantizer.with_usage(rowwise=True, columnwise=True)
            shape = tuple(self.weight.shape)
            weight_layout = q.flatten_layout(shape)
            missing = None if first_microbatch else (
                "te.Linear: is_first_microbatch=False reuses the FP8 weight cached by an "
                "earlier is_first_microbatch=True call under the same recipe, and there is none")
            layout = layout + tuple((f"fp8_weight_{name}", size, dtype, None, missing)
                                    for name, size, dtype in weight_layout)
        ensure_buffers(self._state_key, layout, self.weight.device)
        if delayed_recipe is not None:
            args.amax_history_fwd, args.scale_fwd = self.fp8_amax_history_fwd, self.fp8_scale_fwd
            args.amax_history_bwd, args.scale_bwd = self.fp8_amax_history_bwd, self.fp8_scale_bwd
        if first_microbatch is not None:
            buffers = {name: getattr(self, f"fp8_weight_{name}") for name, _, _ in weight_layout}
            args.weight_workspace = q.create_metadata(shape, self.weight.dtype).build(shape,
                                                                                       buffers)
            args.cache_weight = first_microbatch

    def _check_shapes(self, args: LinearFwdArgs, inp) -> None:
        """Clear errors for sizes the recipe's formats cannot take, before any
        kernel.  Reads ``divisibility()`` and tests the (maybe symbolic) sizes
        here: an exception raised inside an opaque member is not catchable."""
        m = inp.numel() // self.local_in_features  # rows the GEMMs see (gathered under SP)
        if self._tp_active() and self.sequence_parallel and self.parallel_mode == "column":
            m = m * self.tp_size
        n = self.local_out_features
        checks = (
            ("input", args.input_quantizer, (m, self.local_in_features), _input_usage(args)),
            ("weight", args.weight_quantizer, (n, self.local_in_features),
             {"rowwise": True, "columnwise": args.input_requires_grad}),
            ("grad_output", args.grad_output_quantizer, (m, n),
             {"rowwise": args.input_requires_grad, "columnwise": args.weight_requires_grad}),
            ("gradient of the input (fp8_grad)", args.grad_input_quantizer,
             (m, self.local_in_features), {"rowwise": True, "columnwise": True}),
        )
        for role, q, (rows, cols), usage in checks:
            if q is None:
                continue
            if role == "weight" and isinstance(args.weight, QuantizedTensorStorage):
                continue
            if not (usage["rowwise"] or usage["columnwise"]):
                continue
            k_mult, m_mult, label = q.with_usage(**usage).divisibility()
            if cols % k_mult != 0 or rows % m_mult != 0:
                raise ValueError(
                    f"te.Linear({self.in_features} -> {self.out_features}): the {role} as a "
                    f"{rows} x {cols} matrix does not fit the recipe: {label} needs the rows "
                    f"divisible by {m_mult} and the columns by {k_mult}")

    # -- forward -----------------------------------------------------------------------
    def forward(self, inp, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        """``y = x W^T + b``.

        ``is_first_microbatch``: True quantizes the weight into the layer's
        cache, False reuses it, None does neither.  ``fp8_output``: return a
        quantized wrapper tensor (no gradients).  ``fp8_grad``: the gradient
        of ``inp`` leaves the backward as a quantized wrapper tensor, which
        a ``te.Linear`` that produced ``inp`` consumes without quantizing
        again (docs/linear.md, "Quantized gradients")."""
        args = self._make_args(inp, is_first_microbatch, fp8_output, fp8_grad)
        if torch.compiler.is_compiling():
            reason = args.compile_unsupported_reason()
            if reason is None and args.grad_input_quantizer is not None and inp.is_leaf:
                # a graph input: AOTAutograd cannot return a quantized gradient for it
                reason = "fp8_grad_graph_input"
            if reason is not None:
                return self._eager_fallback(reason, inp, is_first_microbatch, fp8_output,
                                            fp8_grad)
            outputs = LINEAR_OPS(args)
        else:
            outputs = LINEAR_OPS.eager(args)
        return self._finish(outputs["out"])

    def _finish(self, out):
        return (out, self.bias) if self.return_bias else out

    @torch.compiler.disable
    def _eager_fallback(self, reason, inp, is_first_microbatch, fp8_output, fp8_grad):
        """Eager run of a configuration the ops do not model (a graph break)."""
        from ..dynamo.fallback import record_fallback

        record_fallback(self, reason)
        if reason == "fp8_grad_graph_input":  # the gradient leaves in high precision
            fp8_grad = False
        return self.forward(inp, is_first_microbatch, fp8_output, fp8_grad)

    def compile_fallbacks(self) -> tuple:
        """Reasons this layer fell back to eager under torch.compile (first seen first)."""
        from ..dynamo.fallback import fallback_reasons

        return fallback_reasons(self)
