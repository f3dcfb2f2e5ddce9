"""``te.Linear``'s forward and backward, written once against
:class:`~.args.LinearFwdArgs` / :class:`~.args.LinearBwdArgs`.

Eager mode runs them under a ``torch.autograd.Function``; under
``torch.compile`` they run inside the two generated custom ops
(``linear/ops.py``).  Each real impl has a fake next to it that follows the
same control flow on :class:`TensorProto`s; the layout-parity test holds
them together.

GEMM operands and copies (usages), see ``quantization/gemm.py``:
fprop uses x rowwise and W rowwise, dgrad dy rowwise and W columnwise,
wgrad dy columnwise and x columnwise.

Tensor / sequence parallelism (``parallel_mode``, ``sequence_parallel``):
the collectives run inside the same ops, see ``distributed.py``; the fakes
scale the leading dim (an all-gather multiplies it by ``tp_size``, a
reduce-scatter divides it).
"""

from __future__ import annotations

from ... import distributed as D
from ... import kernels
from ...checkpointing import check_forward_op_in_backward
from ...dynamo import shared_inputs
from ...dynamo.custom_op import OpResult
from ...dynamo.updates import Update
from ...dynamo.tensor_proto import TensorProto, to_tensor_proto
from ...kernels import tracing
from ...quantization.gemm import gemm
from ...kernels.reference import AmaxSlot
from ...quantization.base import QuantizedTensorStorage
from ..delayed_step import delayed_updates, delayed_updates_fake, step_after_last_cast, zero_amaxes
from .args import (LinearBwdArgs, LinearFwdArgs, _grad_output_quantizer, _input_quantizer,
                   _out_shape, _paired_weight_quantizer, _quantizes_weight, _reuses_workspace,
                   _saves_original_weight, _tp, _weight_quantizer)


# state written right after the ops, visible to PyTorch (dynamo/custom_op.py):
# output name -> the argument field it is copied or added into
FORWARD_UPDATES = {"weight_workspace": Update("weight_workspace"),
                   "amax_history_fwd": Update("amax_history_fwd"), "scale_fwd": Update("scale_fwd")}
BACKWARD_UPDATES = {"main_grad": Update("main_grad", "add"),
                    "amax_history_bwd": Update("amax_history_bwd"), "scale_bwd": Update("scale_bwd")}


# -- delayed scaling ------------------------------------------------------------------
def _quantize(q, x, scales, slot: int, amaxes=None, step=None):
    """``q.quantize(x)``, or with the layer's delayed-scaling scale
    ``scales[slot]``, recording ``x``'s amax into ``amaxes[slot]`` on the way
    (then running ``step``, a ``StepAfter``, when this is the op call's last
    amax).  Unchecked (the lean path): ``Linear`` validated the shapes
    before the ops."""
    if scales is None:
        return q.quantize_unchecked(x)
    return q.quantize_with_scale(
        x, scales[slot], checked=False,
        amax_out=None if amaxes is None else AmaxSlot(amaxes, slot, step))


def _record_amax(x, amaxes, index: int) -> None:
    """Delayed scaling: ``x``'s amax into the zeroed ``amaxes[index]``, by
    the kernel itself (no copy), for a tensor this op call does not quantize."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    kernels.get("amax", x2d)(x2d, AmaxSlot(amaxes, index))


def _input_for_gemm(args: LinearFwdArgs, q, xq, amaxes):
    """(x_total, GEMM operand): x gathered first under column SP (x_total is
    None when only FP8 bytes were gathered), quantized with ``q`` unless the
    caller quantized it already (``xq``)."""
    x = args.inp
    mode, sp = _tp(args)
    if mode == "column" and sp:
        if xq is not None:  # gathered and quantized by an earlier call (shared_inputs.py)
            return None, xq
        return D.gather_and_quantize(x, q, args.tp_group, args.tp_size,
                                     quantized_gather=not args.save_original_input,
                                     quantize=lambda t: _quantize(q, t, args.scale_fwd, 0, amaxes))
    if xq is None and q is not None:
        xq = _quantize(q, x, args.scale_fwd, 0, amaxes)
    return x, (x if xq is None else xq)


def _weight_for_gemm(args: LinearFwdArgs, amaxes=None, step=None):
    """(weight operand, freshly cached workspace or None); under delayed
    scaling the weight's amax goes to ``amaxes[1]`` (zero for an FP8 weight),
    and its quantization runs ``step`` when given (only if it quantizes)."""
    w = args.weight
    if _reuses_workspace(args):
        if amaxes is not None and not isinstance(w, QuantizedTensorStorage):
            _record_amax(w, amaxes, 1)
        return args.weight_workspace, None
    if not _quantizes_weight(args):
        return w, None
    wq = _quantize(_weight_quantizer(args), w, args.scale_fwd, 1, amaxes, step)
    return wq, (wq if args.cache_weight else None)


def _weight_for_gemm_fake(args: LinearFwdArgs):
    if _reuses_workspace(args):
        return args.weight_workspace, None
    w = args.weight
    if w.is_quantized or args.weight_quantizer is None:
        return w, None
    q = args.weight_quantizer.usage_variant(True, args.input_requires_grad or args.cache_weight)
    wq = TensorProto(w.shape, w.dtype, q, device=w.device)
    return wq, (wq if args.cache_weight else None)


def linear_forward(args: LinearFwdArgs, xq=None, wq=None, amaxes=None) -> OpResult:
    """``xq``: ``args.inp`` already quantized by the caller with
    ``_input_quantizer(args)`` (LayerNormLinear's norm kernel gives it the
    amax of its output, or under delayed scaling writes FP8 itself); only
    without a gather of the input.  Under delayed scaling ``xq`` comes with
    ``amaxes``, this call's zeroed amax vector (``zero_amaxes``) with x's
    amax recorded in ``amaxes[0]``, and ``args.inp`` may be None (then
    ``save_original_input`` is off: nothing reads it).  ``wq`` (with ``xq``):
    ``args.weight`` quantized by the caller with the quantizer
    :func:`_paired_weight_quantizer` returns (cast in the same launch as x)."""
    check_forward_op_in_backward(args)
    x = args.inp
    mode, sp = _tp(args)
    gathers = mode == "column" and sp  # x is gathered (and quantized) first
    q = _input_quantizer(args)
    delayed = args.amax_history_fwd is not None
    if (xq is not None and (gathers or delayed != (amaxes is not None))) or (
            xq is None and amaxes is not None):
        raise ValueError("linear_forward: a pre-quantized input needs no gather, and comes "
                         "with its amaxes exactly under delayed scaling")
    if wq is not None and xq is None:
        raise ValueError("linear_forward: a pre-quantized weight comes with the input's")
    # an input read by several layers is quantized (and under column SP
    # gathered) once, in a lowered trace and eagerly (shared_inputs.py); a
    # gathered one is shared where only its quantized copy is used (not with
    # save_original_input)
    offer = ((tracing.active or tracing.eager_in_place()) and xq is None and q is not None
             and args.scale_fwd is None and not (gathers and args.save_original_input))
    tag = ("gathered", args.tp_group) if gathers else None
    if offer:
        shared = shared_inputs.lookup(x, q, tag)
        if shared is not None:
            shape = D.gathered_shape(x.shape, args.tp_size) if gathers else x.shape
            xq, offer = q.from_buffers(shape, x.dtype, shared), False
    pair = None if xq is not None or gathers else _paired_weight_quantizer(args, q)
    # delayed scaling, W's FP8 copy cached: x's cast and W's amax in one launch too
    amax_only = (delayed and pair is None and xq is None and not gathers
                 and _reuses_workspace(args) and args.weight.device == x.device
                 and not isinstance(args.weight, QuantizedTensorStorage))
    step = None  # a StepAfter the weight's quantization (or the pair's) runs
    if delayed and (pair is not None or amax_only):
        step = step_after_last_cast(args.input_quantizer, args.amax_history_fwd, args.scale_fwd,
                           args.amax_group)
        pair = None if step is None else pair
        amax_only = amax_only and step is not None
    if wq is not None:
        x_total, w, workspace = x, wq, (wq if args.cache_weight else None)
    elif pair is not None:  # delayed scaling: the pair's launch runs the step
        xq, w = (q.quantize_stepped(x, args.scale_fwd, step, pair, args.weight) if delayed
                 else q.quantize_pair_unchecked(x, pair, args.weight))
        x_total, workspace = x, (w if args.cache_weight else None)
    elif amax_only:
        xq = q.quantize_stepped(x, args.scale_fwd, step, None, args.weight)[0]
        x_total, w, workspace = x, args.weight_workspace, None
    else:  # under delayed scaling the weight's cast (the last amax) runs the step
        if amaxes is None:
            amaxes = zero_amaxes(args.amax_history_fwd)  # delayed scaling: x, W
        x_total, xq = _input_for_gemm(args, q, xq, amaxes)
        if _quantizes_weight(args):
            step = step_after_last_cast(args.input_quantizer, args.amax_history_fwd, args.scale_fwd,
                               args.amax_group)
        w, workspace = _weight_for_gemm(args, amaxes, step)
    if offer:
        shared_inputs.record(x, q, xq, tag)
    y = gemm(xq, "rowwise", w, "rowwise", (xq if x is None else x).dtype,
             None if mode == "row" else args.bias,
             fast_accum=args.fprop_fast_accum).view(_out_shape(xq.shape, w.shape))
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
    saved_w = _saved_weight(args, w)
    if saved_w is not None and saved_w is not args.weight and _fresh_weight_copy(args, w):
        w.update_usage(rowwise_usage=False)  # dgrad reads the columnwise copy only
    state = delayed_updates(args.input_quantizer, args.amax_history_fwd, args.scale_fwd,
                             amaxes, "fwd", args.amax_group, step)
    return OpResult({"out": y, "weight_workspace": workspace, **state},
                    {"inputmat": saved_x, "weightmat": saved_w, **_saved_for_updates(args)})


def _fresh_weight_copy(args: LinearFwdArgs, w) -> bool:
    """Whether ``w``, the forward GEMM's weight operand, is a copy this call
    quantized and nothing else keeps, so the backward may hold its
    columnwise copy alone.  Any other operand is the weight itself (an FP8
    or unquantized weight) or the cached workspace, written
    (``cache_weight``) or reused.  Real or fake alike."""
    return not args.cache_weight and w is not args.weight and w is not args.weight_workspace


def _saved_weight(args: LinearFwdArgs, w):
    """What dgrad reads in the backward: W itself where the backward
    quantizes it (``save_original_weight``), else ``w``, the forward GEMM's
    operand; None without dgrad.  Real or fake alike."""
    if not args.input_requires_grad:
        return None
    return args.weight if _saves_original_weight(args) else w


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
    saved_w = _saved_weight(args, w)
    if saved_w is not None and saved_w is not args.weight and _fresh_weight_copy(args, w):
        w.update_usage(rowwise=False)
    return OpResult({"out": y, "weight_workspace": workspace,
                     **delayed_updates_fake(args.amax_history_fwd, "fwd")},
                    {"inputmat": saved_x, "weightmat": saved_w, **_saved_for_updates(args)})


def linear_setup_context(args: LinearFwdArgs) -> dict:
    """Non-tensor fields of LinearBwdArgs (tensors come from ``saved``)."""
    return {
        "input_quantizer": args.input_quantizer if args.save_original_input else None,
        "weight_quantizer": args.weight_quantizer if _saves_original_weight(args) else None,
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
        "amax_group": args.amax_group,
        "dgrad_fast_accum": args.dgrad_fast_accum,
        "wgrad_fast_accum": args.wgrad_fast_accum,
    }


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
    quantized_grad = _uses_quantized_grad(args, q)
    step = None  # a StepAfter dy's quantization runs
    if delayed and args.grad_input_quantizer is None and not quantized_grad and (
            not (mode == "row" and sp)):  # dy's cast records the last amax
        step = step_after_last_cast(q, args.amax_history_bwd, args.scale_bwd, args.amax_group)
    # otherwise this call's amaxes: dy, dgrad (fp8_grad)
    amaxes = zero_amaxes(args.amax_history_bwd) if delayed and step is None else None
    if quantized_grad:
        dyq = dy  # its amax (delayed scaling) and bias gradient: from its values
        dy = dy_total = dy.dequantize() if args.bias_requires_grad or delayed else None
        if delayed:
            _record_amax(dy, amaxes, 0)
    else:
        if isinstance(dy, QuantizedTensorStorage):
            dy = dy.dequantize()
        if mode == "row" and sp:  # dy_total is None when only FP8 bytes were gathered
            dy_total, dyq = D.gather_and_quantize(
                dy, q, args.tp_group, args.tp_size,
                quantize=lambda t: _quantize(q, t, args.scale_bwd, 0, amaxes))
        elif step is not None:  # one launch: dy's cast, its amax, the step
            dy_total, dyq = dy, q.quantize_stepped(dy, args.scale_bwd, step)[0]
        else:
            dy_total, dyq = dy, (dy if q is None else _quantize(q, dy, args.scale_bwd, 0, amaxes))
    dtype, n_out = args.grad_output.dtype, args.grad_output.shape[-1]
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        w = args.weightmat
        if args.weight_quantizer is not None and not isinstance(w, QuantizedTensorStorage):
            w = args.weight_quantizer.usage_variant(False, True).quantize_unchecked(w)
        dgrad = gemm(dyq, "rowwise", w, "columnwise", dtype,
                     fast_accum=args.dgrad_fast_accum).view(
            *dyq.shape[:-1], w.shape[-1])
        if mode == "column":  # partial sums over out_features
            dgrad = (D.reduce_scatter_first_dim(dgrad, args.tp_group, args.tp_size) if sp
                     else D.all_reduce_sum(dgrad, args.tp_group))
        if args.grad_input_quantizer is not None:  # fp8_grad: the previous layer's dy
            dgrad = _quantize(args.grad_input_quantizer, dgrad, args.scale_bwd, 1, amaxes)
    state = ({} if not delayed else
             delayed_updates(q, args.amax_history_bwd, args.scale_bwd, amaxes, "bwd",
                              args.amax_group, step))
    if args.weight_requires_grad:
        x = args.inputmat
        if _needs_requantized_input(args, x):
            x = args.input_quantizer.usage_variant(False, True).quantize_unchecked(x)
        if args.main_grad is not None:  # accumulated by the "main_grad" update
            state["main_grad"] = gemm(dyq, "columnwise", x, "columnwise", args.main_grad.dtype,
                                      fast_accum=args.wgrad_fast_accum)
        else:
            wgrad = gemm(dyq, "columnwise", x, "columnwise", args.weight_dtype,
                         fast_accum=args.wgrad_fast_accum)
    if args.bias_requires_grad:
        if dy_total is not None:
            dy2d = dy_total.reshape(-1, n_out)
            dbias = kernels.get("column_sum", dy2d)(dy2d, args.bias_dtype)
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
    state = delayed_updates_fake(args.amax_history_bwd, "bwd") if q is not None else {}
    if args.weight_requires_grad:
        shape = (dy.shape[-1], args.inputmat.shape[-1])
        if args.main_grad is None:
            wgrad = TensorProto(shape, args.weight_dtype, device=dy.device)
        else:
            state["main_grad"] = TensorProto(shape, args.main_grad.dtype, device=dy.device)
    if args.bias_requires_grad:
        dbias = TensorProto((dy.shape[-1],), args.bias_dtype, device=dy.device)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias, **state}
