"""``te.GroupedLinear``'s forward and backward, written once against
:class:`~.args.GroupedLinearFwdArgs` / :class:`~.args.GroupedLinearBwdArgs`,
each impl with its fake next to it.

Every GEMM is one ``torch._grouped_mm`` over all experts, the groups given
by ``m_offsets`` (an expert with no tokens contributes nothing and gets a
zero weight gradient):

* fprop ``y_g = x_g W_g^T``: ``_grouped_mm(x, W^T, offs)`` (2-D x 3-D);
* dgrad ``dx_g = dy_g W_g``: ``_grouped_mm(dy, W, offs)``;
* wgrad ``dW_g = dy_g^T x_g``: ``_grouped_mm(dy^T, x, offs)`` (2-D x 2-D,
  the groups along the reduced dim);
* the bias gradient ``db_g = sum of dy_g's rows`` the same way against a
  block of ones: a GEMM's fixed reduction order, where a scatter-add's
  atomics would differ from run to run.

Under the block-scaled recipes the GEMMs take dequantized operands of
groups padded to whole blocks (``blocked.py``).  Under FP8 current scaling
and DelayedScaling each expert's x, W and dy are quantized with scales of
their own (``quantize.py``; DelayedScaling's from each expert's amax
history, updated by the ops as te.Linear's are: ``delayed_step.py``).  On CUDA the
GEMMs take the FP8 operands (``fp8_gemm.py``: ``torch._scaled_grouped_mm``).
Elsewhere they take the dequantized operands in fp32, the bias added in fp32
before the output's rounding: the numerics of a ``te.Linear`` per expert on
its reference path.  The FP8 copies and their per-expert scales are what the
backward keeps, on every device.
"""

from __future__ import annotations

import torch

from ...dynamo.custom_op import OpResult
from ...dynamo.tensor_proto import TensorProto
from ...dynamo.updates import Update
from ...kernels.reference import FP8_DTYPE
from ...quantization.float8 import (Float8CurrentScalingQuantizer,
                                    Float8DelayedScalingQuantizer)
from ..delayed_step import delayed_updates, delayed_updates_fake
from . import blocked, blockwise_gemm, fp8_gemm
from .args import GroupedLinearBwdArgs, GroupedLinearFwdArgs
from .padding import padded_rows, padded_sources
from .quantize import (Quantized, amax_experts, dequantize_experts, dequantize_rows,
                       quantize_experts, quantize_tokens)

# the ones block of the bias gradient: a few columns keep its rows 16-byte
# aligned, as the CUDA grouped GEMM requires of its operands
_ONES_COLS = 8

# DelayedScaling's new histories and scales, written into the module buffers
# right after the ops (dynamo/custom_op.py)
FORWARD_UPDATES = {"amax_history_fwd": Update("amax_history_fwd"),
                   "scale_fwd": Update("scale_fwd"),
                   # the first microbatch's FP8 W, into the layer's weight cache
                   **{name: Update(name) for name in ("weight_cache_data",
                                                      "weight_cache_transposed",
                                                      "weight_cache_scale_inv",
                                                      "weight_cache_blockwise")}}
BACKWARD_UPDATES = {"amax_history_bwd": Update("amax_history_bwd"),
                    "scale_bwd": Update("scale_bwd"),
                    # fuse_wgrad_accumulation: W's gradient, added into main_grad
                    "main_grad": Update("main_grad", "add")}


def group_ids(m_offsets: torch.Tensor, tokens: int) -> torch.Tensor:
    """The expert of every row (int64, ``(tokens,)``), from the end rows."""
    rows = torch.arange(tokens, device=m_offsets.device, dtype=m_offsets.dtype)
    return torch.searchsorted(m_offsets, rows, right=True)


def _rows(args, tokens: int) -> torch.Tensor:
    """Each row's expert: the caller's, else computed here."""
    return args.group_of_row if args.group_of_row is not None else \
        group_ids(args.m_offsets, tokens)


def _padded(args, rows: torch.Tensor) -> tuple:
    """``(sources, padded offsets)`` of the FP8 wgrad's 16-aligned token
    groups: the caller's, else computed here."""
    if args.pad_sources is not None:
        return args.pad_sources, args.pad_offsets
    sources, _, pad_offs = padded_sources(args.m_offsets, rows, fp8_gemm.ALIGN)
    return sources, pad_offs


def _saved(args, x, w, x_scale_inv=None, w_scale_inv=None) -> dict:
    wgrad, dgrad = args.weight_requires_grad, args.input_requires_grad
    return {"inputmat": x if wgrad else None, "weightmat": w if dgrad else None,
            "input_scale_inv": x_scale_inv if wgrad else None,
            "weight_scale_inv": w_scale_inv if dgrad else None, "m_offsets": args.m_offsets,
            # the caller's routing indices (aliases of forward arguments)
            "group_of_row": args.group_of_row, "pad_sources": args.pad_sources,
            "pad_offsets": args.pad_offsets,
            # forward arguments the backward writes into (aliases, not copies)
            "amax_history_bwd": args.amax_history_bwd, "scale_bwd": args.scale_bwd,
            "main_grad": args.main_grad if wgrad else None}


def grouped_linear_forward(args: GroupedLinearFwdArgs) -> OpResult:
    x, w, offs = args.inp, args.weight, args.m_offsets
    if args.input_quantizer is None:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if args.bias is not None:
            y = y + args.bias[_rows(args, x.shape[0])]
        return OpResult({"out": y}, _saved(args, x, w))
    rows = _rows(args, x.shape[0])
    if _blockwise_kernel(args):
        keep_x, keep_w = _kept_copies(args)
        cache = args.weight_cache_blockwise
        y, (xk, xs), (wk, ws), wq = blockwise_gemm.forward(
            x, w, args.input_quantizer, args.weight_quantizer, rows, offs, keep_x, keep_w,
            wq=cache if reuses_cached_weight(args) else None, both_copies=args.cache_weight)
        if cache is not None and keep_w:  # dgrad reads the cached W (this call's, if caching)
            wk, ws = (wq if args.cache_weight else cache), None
        if args.bias is not None:
            y = y + args.bias[rows]
        cached = {"weight_cache_blockwise": wq} if args.cache_weight else {}
        return OpResult({"out": y, **cached}, _saved(args, xk, wk if keep_w else w, xs, ws))
    if not tensorwise_fp8(args.input_quantizer):
        y = blocked.fprop(x, w, args.input_quantizer, args.weight_quantizer, rows, offs)
        if args.bias is not None:
            y = y + args.bias.to(y.dtype)[rows]
        return OpResult({"out": y.to(x.dtype)}, _saved(args, x, w))
    xq, wq, state = _quantize_operands(args, rows)
    # the backward keeps the transposed copies its GEMMs read (or W itself)
    saved = (_saved(args, xq.transposed, w, xq.scale_inv) if saves_original_weight(args) else
             _saved(args, xq.transposed, wq.transposed, xq.scale_inv, wq.scale_inv))
    if x.is_cuda:
        y = fp8_gemm.fprop(xq.data, xq.scale_inv, wq.data, wq.scale_inv, rows, offs,
                           args.fprop_fast_accum)
        if args.bias is not None:
            y = y + args.bias[rows]
        return OpResult({"out": y, **state}, saved)
    y = torch._grouped_mm(dequantize_rows(xq.data, xq.scale_inv, rows),
                          dequantize_experts(wq.data, wq.scale_inv).transpose(-2, -1), offs=offs)
    if args.bias is not None:
        y = y + args.bias.float()[rows]
    return OpResult({"out": y.to(x.dtype), **state}, saved)


def _quantize_operands(args: GroupedLinearFwdArgs, rows: torch.Tensor) -> tuple:
    """``(x, W, state updates)``: each expert's x rows and W in FP8
    (``quantize.Quantized``) with a scale of their own, from their amaxes
    (current scaling) or from the amax history (DelayedScaling, which
    records this call's amaxes and steps the history); with the transposed
    copies the backward's GEMMs read (x's for wgrad, W's for dgrad).  With
    a weight cache, the first microbatch's W copies go to it (update
    outputs) and the later microbatches read them."""
    x, w, groups = args.inp, args.weight, args.weight.shape[0]
    sources = _padded(args, rows)[0] if args.weight_requires_grad else None
    x_scale = w_scale = None
    if args.amax_history_fwd is not None:
        x_scale, w_scale = args.scale_fwd[:groups], args.scale_fwd[groups:]
    xq = quantize_tokens(x, rows, groups, args.input_quantizer, x_scale, sources)
    if reuses_cached_weight(args):  # a later microbatch: W's FP8 copies from the cache
        # DelayedScaling records W's amax all the same, as te.Linear does
        amax = amax_experts(w) if args.amax_history_fwd is not None else None
        wq = Quantized(args.weight_cache_data, args.weight_cache_transposed,
                       args.weight_cache_scale_inv, amax)
    else:  # the first microbatch caches both copies, whatever this call's backward needs
        wq = quantize_experts(w, args.weight_quantizer, w_scale,
                              transposed=args.cache_weight or (
                                  args.input_requires_grad and not saves_original_weight(args)))
    cached = ({"weight_cache_data": wq.data, "weight_cache_transposed": wq.transposed,
               "weight_cache_scale_inv": wq.scale_inv} if args.cache_weight else {})
    if args.amax_history_fwd is None:
        return xq, wq, cached
    # the step moves the scales on after the casts (and the scale_inv) read them
    return xq, wq, {**cached, **delayed_updates(
        args.input_quantizer, args.amax_history_fwd, args.scale_fwd,
        torch.cat([xq.amax, wq.amax]), "fwd", args.amax_group)}


def reuses_cached_weight(args: GroupedLinearFwdArgs) -> bool:
    """Whether the forward reads W's FP8 copies from the weight cache (a
    microbatch after the first) instead of quantizing W.  Real or fake."""
    return _has_weight_cache(args) and not args.cache_weight


def _has_weight_cache(args: GroupedLinearFwdArgs) -> bool:
    return args.weight_cache_data is not None or args.weight_cache_blockwise is not None


def _blockwise_kernel(args: GroupedLinearFwdArgs) -> bool:
    """Whether the CuTeDSL blockwise grouped GEMM runs this layer (real or
    fake arguments: the same answer in both, so their saved tensors match)."""
    q = args.input_quantizer
    return (q is not None and not tensorwise_fp8(q)
            and blockwise_gemm.applies(args.inp, args.weight.shape[2], args.weight.shape[1], q,
                                       args.weight_quantizer, args.grad_output_quantizer))


def _kept_copies(args: GroupedLinearFwdArgs) -> tuple:
    """(x's, W's): which FP8 copies the blockwise kernel's forward keeps for
    the backward: x's for wgrad, W's for dgrad (W itself with
    ``save_original_weight``: the backward quantizes it again; a weight
    cache holds W's copy anyway)."""
    return (args.weight_requires_grad,
            args.input_requires_grad and (not args.save_original_weight
                                          or _has_weight_cache(args)))


def _blockwise_saved_fake(args: GroupedLinearFwdArgs, cached=None) -> dict:
    """``cached``: the proto of W written to the weight cache by this call."""
    x, w = args.inp, args.weight
    keep_x, keep_w = _kept_copies(args)
    shape = blockwise_gemm.kept_shapes(x.shape[0], w.shape[0], w.shape[2], w.shape[1])
    fp8 = lambda q, what: TensorProto(shape[what], FP8_DTYPE[q.fp8_format],  # noqa: E731
                                      device=x.device)
    f32 = lambda what: TensorProto(shape[what], torch.float32, device=x.device)  # noqa: E731
    w_kept = (fp8(args.weight_quantizer, "w"), f32("w_scale")) if keep_w else (w, None)
    cache = args.weight_cache_blockwise
    if cache is not None and keep_w:  # the cached W, as in the impl
        w_kept = (cached if args.cache_weight else cache), None
    return _saved(args, fp8(args.input_quantizer, "x") if keep_x else None, w_kept[0],
                  f32("x_scale") if keep_x else None, w_kept[1])


def grouped_linear_forward_fake(args: GroupedLinearFwdArgs) -> OpResult:
    x, w = args.inp, args.weight
    y = TensorProto((x.shape[0], w.shape[1]), x.dtype, device=x.device)
    if _blockwise_kernel(args):
        cached = {}
        if args.cache_weight:  # W as the cache holds it (blockwise_gemm.forward)
            e, n, k = w.shape
            q = blockwise_gemm.weight_cache_quantizer(args.weight_quantizer)
            cached = {"weight_cache_blockwise": TensorProto((e * n, k), w.dtype, q,
                                                            device=w.device)}
        return OpResult({"out": y, **cached},
                        _blockwise_saved_fake(args, cached.get("weight_cache_blockwise")))
    if args.input_quantizer is None or not tensorwise_fp8(args.input_quantizer):
        return OpResult({"out": y}, _saved(args, x, w))
    groups = (w.shape[0],)
    # the transposed copies: x's (in, padded tokens), W's (experts, in, out)
    xq = TensorProto((x.shape[1], padded_rows(x.shape[0], w.shape[0], fp8_gemm.ALIGN)),
                     FP8_DTYPE[args.input_quantizer.fp8_format], device=x.device)
    x_scale_inv = TensorProto(groups, torch.float32, device=x.device)
    fp8_w = FP8_DTYPE[args.weight_quantizer.fp8_format]
    # W's transposed copy and scales: the cache's when reused; when cached,
    # the same tensors are saved and written to the cache, as in the impl
    w_t = TensorProto((w.shape[0], w.shape[2], w.shape[1]), fp8_w, device=w.device)
    w_scale_inv = TensorProto(groups, torch.float32, device=w.device)
    cached = {}
    if args.cache_weight:
        cached = {"weight_cache_data": TensorProto(tuple(w.shape), fp8_w, device=w.device),
                  "weight_cache_transposed": w_t, "weight_cache_scale_inv": w_scale_inv}
    if reuses_cached_weight(args):
        saved = _saved(args, xq, args.weight_cache_transposed, x_scale_inv,
                       args.weight_cache_scale_inv)
    elif saves_original_weight(args):
        saved = _saved(args, xq, w, x_scale_inv)
    else:
        saved = _saved(args, xq, w_t, x_scale_inv, w_scale_inv)
    return OpResult({"out": y, **cached, **delayed_updates_fake(args.amax_history_fwd, "fwd")},
                    saved)


def saves_original_weight(args: GroupedLinearFwdArgs) -> bool:
    """Whether the backward quantizes W's transposed FP8 copy from W itself
    (``save_original_weight``): asked for, with dgrad, under current scaling
    (DelayedScaling's forward moves the scale; the block-scaled recipes keep
    W itself anyway).  Real or fake arguments."""
    return (args.save_original_weight and args.input_requires_grad
            and args.weight_quantizer is not None and args.amax_history_fwd is None
            and not _has_weight_cache(args) and tensorwise_fp8(args.weight_quantizer))


def tensorwise_fp8(q) -> bool:
    """Per-expert FP8 tensor scaling, current or delayed (FP8 grouped GEMMs
    on CUDA); the other recipes take the block-scaled path (``blocked.py``)."""
    # one class per isinstance: Dynamo on torch 2.11 answers an isinstance
    # of a value-opaque object against a tuple of classes by the first alone
    return (isinstance(q, Float8CurrentScalingQuantizer)
            or isinstance(q, Float8DelayedScalingQuantizer))


def grouped_linear_setup_context(args: GroupedLinearFwdArgs) -> dict:
    """Non-tensor fields of GroupedLinearBwdArgs (tensors come from ``saved``)."""
    blocked_recipe = args.input_quantizer is not None and \
        not tensorwise_fp8(args.input_quantizer)
    return {"grad_output_quantizer": args.grad_output_quantizer,
            "input_quantizer": args.input_quantizer if blocked_recipe else None,
            "weight_quantizer": (args.weight_quantizer
                                 if blocked_recipe or saves_original_weight(args) else None),
            "input_requires_grad": args.input_requires_grad,
            "weight_requires_grad": args.weight_requires_grad,
            "bias_requires_grad": args.bias_requires_grad,
            # W's gradient in main_grad's dtype where it is added there
            "weight_dtype": (args.weight.dtype if args.main_grad is None
                             else args.main_grad.dtype),
            "bias_dtype": None if args.bias is None else args.bias.dtype,
            "amax_group": args.amax_group, "dgrad_fast_accum": args.dgrad_fast_accum,
            "wgrad_fast_accum": args.wgrad_fast_accum}


def grouped_linear_backward(args: GroupedLinearBwdArgs) -> dict:
    # an expanded gradient (of ``y.sum()``) has zero strides, which the
    # grouped GEMM refuses
    dy, offs = args.grad_output.contiguous(), args.m_offsets
    dgrad = wgrad = dbias = None
    state = {}
    q = args.grad_output_quantizer
    if q is None:
        if args.input_requires_grad:
            dgrad = torch._grouped_mm(dy, args.weightmat, offs=offs)
        if args.weight_requires_grad:
            wgrad = torch._grouped_mm(dy.t(), args.inputmat, offs=offs).to(args.weight_dtype)
    elif args.input_requires_grad or args.weight_requires_grad:
        if tensorwise_fp8(q):
            dgrad, wgrad, state = _fp8_grads(args, dy, q)
        else:
            dgrad, wgrad = blocked.grads(dy, args.inputmat, args.weightmat, q,
                                         args.input_quantizer, args.weight_quantizer,
                                         _rows(args, dy.shape[0]), offs,
                                         args.input_requires_grad, args.weight_requires_grad,
                                         args.weight_dtype, args.input_scale_inv,
                                         args.weight_scale_inv)
            dgrad = None if dgrad is None else dgrad.to(dy.dtype)
            wgrad = None if wgrad is None else wgrad.to(args.weight_dtype)
    if args.bias_requires_grad:
        ones = torch.ones(dy.shape[0], _ONES_COLS, dtype=dy.dtype, device=dy.device)
        dbias = torch._grouped_mm(dy.t(), ones, offs=offs)[..., 0].to(args.bias_dtype).contiguous()
    if args.main_grad is not None and wgrad is not None:  # added into main_grad, not returned
        state["main_grad"], wgrad = wgrad, None
    return {"inp": dgrad, "weight": wgrad, "bias": dbias, **state}


def _fp8_grads(args: GroupedLinearBwdArgs, dy: torch.Tensor, q) -> tuple:
    """dgrad, wgrad and the state updates from dy, quantized per expert as
    the forward's operands (``_quantize_operands``), and the saved
    transposed FP8 copies of W and x: FP8 GEMMs on CUDA, fp32 GEMMs of the
    dequantized operands elsewhere (there x's copy is read back in token
    order: the GEMM a te.Linear per expert runs, bit for bit)."""
    offs, dgrad, wgrad = args.m_offsets, None, None
    rows = _rows(args, dy.shape[0])
    # CUDA's wgrad reads dy's transposed copy in the padded layout
    sources, pad_offs = (_padded(args, rows) if dy.is_cuda and args.weight_requires_grad
                         else (None, None))
    dyq = quantize_tokens(dy, rows, offs.shape[0], q, args.scale_bwd, sources)
    state = {} if args.amax_history_bwd is None else delayed_updates(
        q, args.amax_history_bwd, args.scale_bwd, dyq.amax, "bwd", args.amax_group)
    w_t, w_scale_inv = args.weightmat, args.weight_scale_inv
    if args.input_requires_grad and args.weight_quantizer is not None:  # W itself was saved
        wq = quantize_experts(w_t, args.weight_quantizer, transposed=True)
        w_t, w_scale_inv = wq.transposed, wq.scale_inv
    if dy.is_cuda:
        if args.input_requires_grad:
            dgrad = fp8_gemm.dgrad(dyq.data, dyq.scale_inv, w_t, w_scale_inv, rows, offs,
                                   args.dgrad_fast_accum)
        if args.weight_requires_grad:
            wgrad = fp8_gemm.wgrad(dyq.transposed, dyq.scale_inv, args.inputmat,
                                   args.input_scale_inv, pad_offs, args.wgrad_fast_accum)
    else:
        dyd = dequantize_rows(dyq.data, dyq.scale_inv, rows)
        if args.input_requires_grad:
            w = dequantize_experts(w_t.transpose(-2, -1).contiguous(), w_scale_inv)
            dgrad = torch._grouped_mm(dyd, w, offs=offs).to(dy.dtype)
        if args.weight_requires_grad:
            dest = padded_sources(offs, rows, fp8_gemm.ALIGN)[1]
            xq = args.inputmat.view(torch.uint8)[:, dest].t().contiguous()
            x = dequantize_rows(xq.view(args.inputmat.dtype), args.input_scale_inv, rows)
            wgrad = torch._grouped_mm(dyd.t(), x, offs=offs)
    return dgrad, None if wgrad is None else wgrad.to(args.weight_dtype), state


def grouped_linear_backward_fake(args: GroupedLinearBwdArgs) -> dict:
    dy = args.grad_output
    groups = args.m_offsets.shape[0]
    dgrad = wgrad = dbias = None
    # per-expert FP8 keeps the transposed copies (in, tokens) and (experts, in, out)
    t = args.grad_output_quantizer is not None and tensorwise_fp8(args.grad_output_quantizer)
    if args.input_requires_grad:  # dy's dtype, quantized or not; W itself when it is requantized
        w_t = t and args.weight_quantizer is None
        # the blockwise kernel's kept copy of W: (in, experts * out); a weight
        # cache's quantized W: (experts * out, in)
        kept = not t and blockwise_gemm.is_kept_copy(args.weightmat)
        cached = not t and blockwise_gemm.is_cached_weight(args.weightmat)
        dim = 1 if cached else 0 if kept else 1 if w_t else 2
        dgrad = TensorProto((dy.shape[0], args.weightmat.shape[dim]), dy.dtype, device=dy.device)
    if args.weight_requires_grad:
        kept = t or blockwise_gemm.is_kept_copy(args.inputmat)  # x's copy: (in, tokens)
        wgrad = TensorProto((groups, dy.shape[1], args.inputmat.shape[0 if kept else 1]),
                            args.weight_dtype, device=dy.device)
    if args.bias_requires_grad:
        dbias = TensorProto((groups, dy.shape[1]), args.bias_dtype, device=dy.device)
    state = {}
    if args.grad_output_quantizer is not None and (args.input_requires_grad
                                                   or args.weight_requires_grad):
        state = delayed_updates_fake(args.amax_history_bwd, "bwd")
    if args.main_grad is not None and wgrad is not None:
        state["main_grad"], wgrad = wgrad, None
    return {"inp": dgrad, "weight": wgrad, "bias": dbias, **state}
