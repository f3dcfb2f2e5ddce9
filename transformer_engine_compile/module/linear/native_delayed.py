"""The native eager plan of a te.Linear call under DelayedScaling
(``linear_native.plan_for`` asks for it): the casts with the layer's
scales, their amaxes and the history step, as the Python path launches
them."""

from __future__ import annotations

import torch

from ...kernels import reference as ref
from ...kernels.reference import FP8_DTYPE
from .native_node import (_DTYPE_NAMES, READ_CACHE, _cache_buffers, _cache_mode, _listed_launches,
                          _PythonBackward, _wgrad_dtype, _with_bias_grad)
from .args import LinearFwdArgs, _grad_output_quantizer, _input_quantizer, _weight_quantizer


def delayed_plan(ext, args: LinearFwdArgs, m: int, k: int, n: int, slot, given_x=False):
    """A :class:`NativeLinear` under DelayedScaling: x's and W's casts with
    the layer's scales in one launch that records their amaxes and then
    steps the forward history (dy's cast and the backward one likewise), as
    the Python path launches them (kernels/triton_delayed.py; two launches
    and a zeroed amax vector where the step does not fit in that launch);
    reading the FP8 weight cache, x's cast, W's amax and the step, in one
    launch too (else three).  ``given_x``: without x's cast (a fused module's norm
    kernel writes x's copies and amax: layernorm/linear_native.py).  The
    launches are compiled on scratch buffers of the state's shapes (zeros:
    the values do not matter), so planning leaves the layer's state
    untouched and copies nothing."""
    from ...kernels import triton_quant as tq  # Triton: imported on CUDA only
    x, w = args.inp, args.weight
    q, wq = _input_quantizer(args), _weight_quantizer(args)
    dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
    dev = x.device
    cache = _cache_mode(args)
    with torch.no_grad():
        hist, scale = torch.zeros_like(args.amax_history_fwd), torch.zeros_like(args.scale_fwd)
        x2d = torch.zeros((m, k), dtype=x.dtype, device=dev)
        w2d = torch.zeros((n, k), dtype=w.dtype, device=dev)
        amaxes = torch.zeros(ref.STEP_COUNTER + 1, dtype=torch.float32, device=dev)
        s0, s1 = scale[0], scale[1]
        # the step's outputs have slots of their own: the eager path passes the
        # layer's history and scales there (in place), an op new buffers
        new_hist, new_scale = torch.zeros_like(hist), torch.zeros_like(scale)
        step = ref.StepAfter(hist, new_hist, new_scale, q.fp8_format, q.margin,
                             q.amax_compute_algo)
        # reading the FP8 weight cache, W's amax alone (its usage flags off)
        one = None if given_x else _one_delayed_launch(
            x2d, w2d, scale, q, None if cache == READ_CACHE else wq, step, slot)
        if one is None:
            lx, out_x = tq.fp8_tensorwise_calls(x2d, q.fp8_format, True, q.columnwise_usage,
                                                scale=s0, amax_out=ref.AmaxSlot(amaxes, 0))
        cached = None if cache != READ_CACHE else {  # the cache's copies (scratch)
            "data": torch.zeros((n, k), dtype=FP8_DTYPE[q.fp8_format], device=dev),
            "transpose": torch.zeros((k, n), dtype=FP8_DTYPE[q.fp8_format], device=dev),
            "scale_inv": torch.zeros(1, dtype=torch.float32, device=dev)}
        if one is not None:  # x's and W's casts (or amax) and the step: one launch
            lx, lw, out_x, out_w = [], [one[0]], one[1], one[2] or cached
        elif cache == READ_CACHE:
            lw, out_w = _amax_then_step(w2d, amaxes, step), cached
        else:
            lw, out_w = tq.fp8_tensorwise_calls(w2d, wq.fp8_format, True, wq.columnwise_usage,
                                                scale=s1,
                                                amax_out=ref.AmaxSlot(amaxes, 1, step))
        fwd = _listed_launches(ext, dev, lw if given_x else lx + lw, [
            x2d, w2d, amaxes, s0, s1, *tq._fp8_copy_args(out_x, x2d),
            *tq._fp8_copy_args(out_w, w2d), hist, scale, new_hist, new_scale])
        bwd, fmt_bwd, one_b = [], "e5m2", None
        if dgrad or wgrad:
            dq = _grad_output_quantizer(args)
            fmt_bwd = dq.fp8_format
            hist_b = torch.zeros_like(args.amax_history_bwd)
            scale_b = torch.zeros_like(args.scale_bwd)
            dy2d = torch.zeros((m, n), dtype=x.dtype, device=dev)
            amaxes_b = torch.zeros(ref.STEP_COUNTER + 1, dtype=torch.float32, device=dev)
            sb0 = scale_b[0]
            new_hist_b, new_scale_b = torch.zeros_like(hist_b), torch.zeros_like(scale_b)
            step_b = ref.StepAfter(hist_b, new_hist_b, new_scale_b, dq.fp8_format, dq.margin,
                                   dq.amax_compute_algo)
            one_b = _one_delayed_launch(dy2d, None, scale_b, dq, None, step_b, slot)
            if one_b is not None:  # dy's cast and the step: one launch, no amax vector
                ld, out_d = [one_b[0]], one_b[1]
            else:
                ld, out_d = tq.fp8_tensorwise_calls(dy2d, dq.fp8_format, dq.rowwise_usage,
                                                    dq.columnwise_usage, scale=sb0,
                                                    amax_out=ref.AmaxSlot(amaxes_b, 0, step_b))
            bwd = _listed_launches(ext, dev, ld, [dy2d, amaxes_b, sb0,
                                                  *tq._fp8_copy_args(out_d, dy2d), hist_b,
                                                  scale_b, new_hist_b, new_scale_b])
    if fwd is None or bwd is None:
        return None
    state = (args.amax_history_fwd, args.scale_fwd, args.amax_history_bwd, args.scale_bwd)
    plan = ext.Plan(fwd[0], fwd[0], _PythonBackward(args, q, wq, ("transpose", "scale_inv"),
                                                    state[2:]),
                    _DTYPE_NAMES[x.dtype], dev.index, m, k, n,
                    _DTYPE_NAMES[FP8_DTYPE[q.fp8_format]], _DTYPE_NAMES[FP8_DTYPE[fmt_bwd]],
                    _DTYPE_NAMES[_wgrad_dtype(args)], q.columnwise_usage, wq.columnwise_usage,
                    dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_delayed(fwd, bwd, 0 if one is not None else ref.STEP_COUNTER + 1,
                     0 if one_b is not None else ref.STEP_COUNTER + 1)
    plan.set_cache(cache)
    if given_x:
        plan.set_given_x()
    return _with_bias_grad(ext, plan, args, slot, state + tuple(_cache_buffers(args) or ()))


def _one_delayed_launch(a2d, b2d, scales, q, wq, step, slot):
    """``(launch, a's buffers, b's buffers or None)`` of the one-launch
    delayed-scaling kernel the Python path runs for these operands
    (``quantize_stepped``; ``wq`` None with ``b2d``: b's amax alone), or
    None where it runs two (the step too large)."""
    from ...kernels import triton_delayed as td  # Triton: imported on CUDA only
    call = td.delayed_call(a2d, b2d, scales, q.fp8_format,
                           (q.rowwise_usage, q.columnwise_usage),
                           (False, False) if wq is None else (wq.rowwise_usage,
                                                               wq.columnwise_usage),
                           step, slot)
    if call is None:
        return None
    grid, key, largs, out_a, out_b = call
    return (td._fp8_delayed_launch, grid, key, largs), out_a, out_b


def _amax_then_step(w2d, amaxes, step) -> list:
    """The launches a forward reading the FP8 weight cache runs after x's
    cast under DelayedScaling: W's amax into ``amaxes[1]``, then the step
    over the forward history (``linear_ops._weight_for_gemm`` and
    ``delayed_step.delayed_updates``: the Python path's own launches)."""
    from ...kernels import triton_quant as tq  # Triton: imported on CUDA only
    return [tq.amax_call(w2d, amaxes, 1),
            tq._step_call(step.history, amaxes, step.new_history, step.new_scale, step.fmt,
                          step.margin, step.algo)]
