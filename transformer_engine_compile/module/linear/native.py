"""When and how an eager ``te.Linear`` call runs natively (kernels/native.py).

The native path covers the common training configurations:
Float8CurrentScaling and DelayedScaling (the layer's state updated in
place, as the Python path's kernels update it; no amax reduction group),
every dim of the three GEMMs a multiple of 16; and
Float8BlockScaling in its default layout (E4M3, 1x128 x and dy, 128x128 W)
on an SM 9.0 GPU, every dim a multiple of 128; and MXFP8 (E4M3, emulated:
the copies dequantized to bf16 for bf16 GEMMs, as the Python path does),
every dim a multiple of 32.  Each with or without a bias of the input's
dtype (bf16 or fp16), added as the Python path adds it (in
``_scaled_mm``'s epilogue; by the bias kernel after the other GEMMs).
Under current, delayed and blockwise scaling also the FP8 weight cache of
``is_first_microbatch``: True quantizes x and W as always and copies W's
copies into the layer's cache after the GEMM (as the Python path's update
does), False quantizes x alone and reads W from the cache (delayed: then
W's amax and the step).  Under current, delayed and blockwise scaling
``fuse_wgrad_accumulation``: W's gradient is added into its ``main_grad``
by the node.  Nothing else: no tensor parallelism, no ``fp8_output`` /
``fp8_grad``, no FP8 weight, no ``save_original_input`` (nor a weight saved for the
backward to quantize), a CUDA input.
te.Linear's calls without a recipe (``plain=True``: a bf16 or fp16 layer
with a bias, eagerly; the backward op's calls with a bias gradient) get
a plain plan: ``F.linear``'s GEMMs called from C++ on the operands the
Python short path (linear/plain.py) passes, the bias gradient's two
launches, a node saving x and W themselves; any sizes.  Any other call, and any call
while a CUDA graph is captured, under a functorch transform or forward-mode
AD, keeps the Python path.  A plan is made once per argument memo entry of
the layer (module/linear/layer.py), from the same helpers the Python path decides
with, so both paths run the same kernels with the same arguments.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...dynamo import shared_inputs
from ...kernels import grid_state, native
from ...kernels.reference import FP8_DTYPE
from ...quantization.blockwise import Float8BlockQuantizer
from ...quantization.float8 import Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer
from ...quantization.mxfp8 import MXFP8Quantizer
from ...quantization.nvfp4 import NVFP4Quantizer
from . import plain as linear_plain_ops
from .args import (LinearFwdArgs, default_accumulation, _grad_output_quantizer, _input_quantizer,
                   _paired_weight_quantizer, _saves_original_weight, _tp, _weight_quantizer)
from .native_node import (_DTYPE_NAMES, _GEMM_OUT, NO_CACHE, READ_CACHE, _PythonBackward,
                          _cache_buffers, _cache_mode, _listed_launches, _wgrad_dtype,
                          _with_bias_grad)


def _eligible(args: LinearFwdArgs, plain: bool = False) -> bool:
    x, w = args.inp, args.weight
    if (type(x) is not torch.Tensor or type(w) not in (torch.Tensor, torch.nn.Parameter)
            or not x.is_cuda or w.device != x.device or x.dim() < 2
            or x.device.index != torch.cuda.current_device()
            or x.dtype not in _GEMM_OUT or w.dtype not in _GEMM_OUT):
        return False
    if not default_accumulation(args):  # the native GEMMs: Transformer Engine's defaults
        return False
    if (not _bias_eligible(args) or _tp(args)[0] is not None or args.output_quantizer is not None
            or args.grad_input_quantizer is not None or args.save_original_input
            or _saves_original_weight(args)
            or args.amax_group is not None):
        return False
    m, k, n = x.numel() // x.shape[-1], x.shape[-1], w.shape[0]
    if m == 0 or tuple(w.shape) != (n, k):
        return False
    recipe = _recipe(args)
    if recipe is None and plain and _plain(args):
        return x.dtype == w.dtype and args.main_grad is None and args.weight_workspace is None
    if args.main_grad is not None and not _main_grad_eligible(args, recipe, n, k):
        return False
    if (recipe == "delayed") != (args.amax_history_fwd is not None):
        return False  # state bound exactly under delayed scaling
    if _cache_mode(args) != NO_CACHE and (recipe == "mx" or _cache_buffers(args) is None):
        return False  # the weight cache: current, delayed or blockwise scaling, plain buffers
    if recipe in ("current", "delayed"):  # _scaled_mm (SM 8.9+)
        kernel = "quantize_fp8_current_pair" if recipe == "current" else "quantize_fp8_tensorwise"
        return (m % 16 == 0 and k % 16 == 0 and n % 16 == 0
                and torch.cuda.get_device_capability(x.device) >= (8, 9)
                and kernels.has_fast(kernel, "cuda"))
    if recipe == "mx":  # the Python path's GEMMs are the bf16 emulation then
        return (m % 32 == 0 and k % 32 == 0 and n % 32 == 0 and x.dtype != torch.float32
                and w.dtype != torch.float32 and kernels.has_fast("quantize_mxfp8", "cuda")
                and kernels.has_fast("dequantize_mxfp8", "cuda"))
    if recipe == "nvfp4":  # the Python path's GEMMs are the bf16 emulation then
        from ...quantization import cuda_gemm
        return (m % 16 == 0 and k % 16 == 0 and n % 16 == 0 and cuda_gemm._has_mm_out_dtype()
                and all(kernels.has_fast(name, "cuda") for name in (
                    "quantize_nvfp4", "dequantize_nvfp4_blocks", "nvfp4_gemm_epilogue")))
    if recipe == "block":  # the Python path's GEMM is cuBLAS's block-scaled one then
        from ...quantization import cuda_gemm
        return (m % 128 == 0 and k % 128 == 0 and n % 128 == 0
                and torch.cuda.get_device_capability(x.device) == (9, 0)
                and cuda_gemm._has_block_scaled_mm()
                and kernels.has_fast("quantize_fp8_blockwise", "cuda"))
    return False


def _plain(args: LinearFwdArgs) -> bool:
    """Whether the call has no recipe: no quantizer anywhere, no
    DelayedScaling state."""
    return (args.input_quantizer is None and args.weight_quantizer is None
            and args.grad_output_quantizer is None and args.amax_history_fwd is None)


def _main_grad_eligible(args: LinearFwdArgs, recipe, n: int, k: int) -> bool:
    """Whether ``fuse_wgrad_accumulation``'s ``main_grad`` can take the
    native wgrad: a plain tensor of W's shape on x's device, of a dtype
    the wgrad GEMM writes; under current, delayed or blockwise scaling, or
    NVFP4 (its epilogue writes main_grad's dtype; the MXFP8 emulation
    writes a non-bf16 wgrad by another GEMM)."""
    g = args.main_grad
    return (recipe in ("current", "delayed", "block", "nvfp4") and args.weight_requires_grad
            and type(g) is torch.Tensor and g.device == args.inp.device
            and tuple(g.shape) == (n, k) and g.dtype in _GEMM_OUT)


def _recipe(args: LinearFwdArgs):
    """"current", "delayed", "block", "mx" or "nvfp4" where the quantizers
    are ones a plan runs, else None."""
    q, wq, dq = args.input_quantizer, args.weight_quantizer, args.grad_output_quantizer
    grads = args.input_requires_grad or args.weight_requires_grad
    if (type(q) is Float8DelayedScalingQuantizer and type(wq) is type(q)
            and q.fp8_format == "e4m3" and wq.fp8_format == "e4m3"):
        if not grads or type(dq) is Float8DelayedScalingQuantizer:
            return "delayed"
    if type(q) is Float8CurrentScalingQuantizer and q.fp8_format == "e4m3":
        if not grads or type(dq) is Float8CurrentScalingQuantizer:
            return "current"
    if all(type(t) is MXFP8Quantizer and t.fp8_format == "e4m3" for t in (q, wq)):
        if not grads or type(dq) is MXFP8Quantizer:
            return "mx"
    if all(type(t) is NVFP4Quantizer for t in (q, wq)) and (not grads
                                                            or type(dq) is NVFP4Quantizer):
        return "nvfp4"
    if all(type(t) is Float8BlockQuantizer and t.fp8_format == "e4m3" for t in (q, wq)) and (
            q.block_scaling_dim == 1 and wq.block_scaling_dim == 2):
        if not grads or (type(dq) is Float8BlockQuantizer and dq.fp8_format == "e4m3"
                         and dq.block_scaling_dim == 1):
            return "block"
    return None


def _bias_eligible(args: LinearFwdArgs) -> bool:
    """No bias, or one the Python path adds in a kernel (``_scaled_mm``'s
    epilogue, or ``bias_add`` after the blockwise and MXFP8 GEMMs) of the input's
    dtype, not fp32, 16-byte aligned (the launches are fixed for that), and
    whose gradient the column-sum kernels make."""
    b, x = args.bias, args.inp
    if b is None:
        return True
    return (type(b) in (torch.Tensor, torch.nn.Parameter) and b.device == x.device
            and b.dtype == x.dtype and x.dtype != torch.float32 and b.dim() == 1
            and b.is_contiguous() and b.data_ptr() % 16 == 0
            and (not args.bias_requires_grad or kernels.has_fast("column_sum", "cuda")))


def plan_for(args: LinearFwdArgs, given_x: bool = False, plain: bool = False):
    """A :class:`NativeLinear` for this call's configuration; None where it
    has none (``False`` from the caller's view: never for this memo entry)
    or the extension is not built yet (``...``: ask again later).
    ``given_x``: a fused module's first GEMM under DelayedScaling, whose
    norm kernel quantizes x (``ext.norm_linear``); None under other recipes.
    ``plain``: a call without a recipe gets a plan too (te.Linear's own
    calls: :func:`_plain_plan`)."""
    if not native.ENABLED or not _eligible(args, plain):
        return None
    recipe = _recipe(args)
    if given_x and recipe != "delayed":
        return None
    ext = native.extension()
    if ext is None:
        return None if native._state["failed"] is not None else ...
    slot = grid_state.slot(args.inp.device)
    if slot is None:
        return ...
    x, w = args.inp, args.weight
    m, k, n = x.numel() // x.shape[-1], x.shape[-1], w.shape[0]
    if recipe is None:  # _eligible admitted it as plain
        return _plain_plan(ext, args, m, k, n, slot)
    if recipe == "block":
        return _block_plan(ext, args, m, k, n, slot)
    if recipe == "delayed":
        from .native_delayed import delayed_plan  # imports this module's helpers
        return delayed_plan(ext, args, m, k, n, slot, given_x)
    if recipe == "mx":
        return _mx_plan(ext, args, m, k, n, slot)
    if recipe == "nvfp4":
        return _nvfp4_plan(ext, args, m, k, n, slot)
    q = _input_quantizer(args)
    cache = _cache_mode(args)
    # reading the weight cache, x is quantized alone (its own launch, as the
    # Python path does): W's quantizer then only describes the cached copies
    wq = _weight_quantizer(args) if cache == READ_CACHE else _paired_weight_quantizer(args, q)
    if wq is None:
        return None
    with torch.no_grad():
        x2d = torch.zeros((m, k), dtype=x.dtype, device=x.device)
        w2d = None if cache == READ_CACHE else torch.zeros((n, k), dtype=w.dtype, device=x.device)
        fwd = _launch(ext, x2d, w2d, q, (q.rowwise_usage, q.columnwise_usage),
                      None if w2d is None else (wq.rowwise_usage, wq.columnwise_usage), slot)
        dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
        bwd = fmt_bwd = None
        if dgrad or wgrad:
            dq = _grad_output_quantizer(args)
            dy2d = torch.zeros((m, n), dtype=x.dtype, device=x.device)
            bwd = _launch(ext, dy2d, None, dq, (dq.rowwise_usage, dq.columnwise_usage), None,
                          slot)
            fmt_bwd = dq.fp8_format
            if bwd is None:
                return None
    if fwd is None:
        return None
    if bwd is None:  # no backward: the node is never made
        bwd = fwd
    python_backward = _PythonBackward(args, q, wq, ("transpose", "scale_inv"))
    plan = ext.Plan(fwd, bwd, python_backward, _DTYPE_NAMES[x.dtype], x.device.index, m, k, n,
                    _DTYPE_NAMES[FP8_DTYPE[q.fp8_format]],
                    _DTYPE_NAMES[FP8_DTYPE[fmt_bwd or "e5m2"]],
                    _DTYPE_NAMES[_wgrad_dtype(args)],
                    q.columnwise_usage, wq.columnwise_usage, dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_cache(cache)
    if cache == NO_CACHE:
        _set_share(plan, args, q, wq, lambda w2d: _launch(
            ext, w2d, None, wq, (wq.rowwise_usage, wq.columnwise_usage), None, slot))
    return _with_bias_grad(ext, plan, args, slot, _cache_buffers(args) if cache else ())


_SHARE_KEYS: dict = {}  # quantizer (by value) -> the nonzero int the plans compare


def _share_key(q) -> int:
    """The int a plan names x's quantization by (native_linear.cpp's
    ``shared_x``): equal for equal quantizers, which make equal bytes."""
    return _SHARE_KEYS.setdefault(q, len(_SHARE_KEYS) + 1)


def _set_share(plan, args: LinearFwdArgs, q, wq, weight_launch) -> None:
    """Make ``plan`` offer x's copies to, and take them from, the eager
    calls that read the same x (dynamo/shared_inputs.py's rules), where
    they apply: W is then quantized by ``weight_launch(w2d)``'s launch."""
    if not (shared_inputs.EAGER and shared_inputs._shareable(q) and wq is not None
            and args.scale_fwd is None):
        return
    w = args.weight
    with torch.no_grad():
        fwd_w = weight_launch(torch.zeros(w.shape, dtype=w.dtype, device=args.inp.device))
    if fwd_w is not None:
        plan.set_share(_share_key(q), fwd_w)


def linear_plan(args: LinearFwdArgs):
    """:func:`plan_for` of a te.Linear call, which may have no recipe
    (the layer's ``_native_plan``; the ops' plans, linear/native_ops.py)."""
    return plan_for(args, plain=True)


def _plain_plan(ext, args: LinearFwdArgs, m: int, k: int, n: int, slot):
    """A :class:`NativeLinear` without a recipe (module/linear/plain.py's
    calls): ``F.linear``'s GEMMs on the operands the Python path passes,
    called from C++, and the bias gradient's two launches; the node saves
    x and W themselves."""
    x, w = args.inp, args.weight
    dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
    name = _DTYPE_NAMES[x.dtype]
    python_backward = _PlainBackward(dgrad, wgrad, args.bias_requires_grad, w.dtype,
                                     None if args.bias is None else args.bias.dtype)
    plan = ext.Plan(ext.Launch(), ext.Launch(), python_backward, name, x.device.index, m, k, n,
                    "float8_e4m3fn", "float8_e5m2", name, False, False, dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_plain()
    return _with_bias_grad(ext, plan, args, slot)


class _PlainBackward:
    """A plain node's Python backward (native_linear.cpp's python_path: a
    gradient of another dtype or a tensor subclass), as
    ``linear_plain_ops.PlainLinear`` computes it; x and W come as the
    copies' places."""

    def __init__(self, dgrad, wgrad, dbias, weight_dtype, bias_dtype):
        self.flags = (dgrad, wgrad, dbias, weight_dtype, bias_dtype)

    def __call__(self, dy, x, x_sinv, w, w_sinv, x_amax=None, w_amax=None):
        with torch.no_grad():
            return linear_plain_ops.linear_grads(dy, x, w, *self.flags)


def _mx_plan(ext, args: LinearFwdArgs, m: int, k: int, n: int, slot):
    """A :class:`NativeLinear` under MXFP8BlockScaling: x, W and dy quantized
    by the MXFP8 kernel, each GEMM operand dequantized to bf16 by its kernel
    and multiplied by torch's bf16 GEMM (cuda_gemm._emulated_bf16)."""
    from ...kernels import triton_block as tb  # Triton: imported on CUDA only
    x, w = args.inp, args.weight
    q, wq = _input_quantizer(args), _weight_quantizer(args)
    dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
    dev, bf16 = x.device, torch.bfloat16

    def quant(a2d, quantizer):
        grid, key, largs, out = tb.mxfp8_call(a2d, quantizer.fp8_format,
                                              quantizer.rowwise_usage, quantizer.columnwise_usage)
        return (tb._mxfp8_launch, grid, key, largs), [a2d, *tb._copy_args(out, a2d)]

    def dequant(data, scale, rowwise):
        grid, key, largs, out = tb.mxfp8_dequantize_call(data, scale, rowwise, bf16)
        return (tb._mxfp8_dequantize_launch, grid, key, largs), out

    with torch.no_grad():
        x2d = torch.zeros((m, k), dtype=x.dtype, device=dev)
        w2d = torch.zeros((n, k), dtype=w.dtype, device=dev)
        lqx, xs = quant(x2d, q)
        lqw, ws = quant(w2d, wq)
        ldx, x16 = dequant(xs[1], xs[2], True)
        ldw, w16 = dequant(ws[1], ws[2], True)
        fwd = _listed_launches(ext, dev, [lqx, lqw, ldx, ldw],
                               [xs[0], ws[0], *xs[1:], *ws[1:], x16, w16])
        bwd, dgrad_list, wgrad_list, fmt_bwd = [], [], [], "e4m3"
        if dgrad or wgrad:
            dq = _grad_output_quantizer(args)
            fmt_bwd = dq.fp8_format
            dy2d = torch.zeros((m, n), dtype=x.dtype, device=dev)
            lqd, ds = quant(dy2d, dq)
            # the saved columnwise copies: scratch of their shapes (dy2d where absent)
            u8 = torch.uint8
            x_c = ((torch.zeros((m, k), dtype=xs[3].dtype, device=dev),
                    torch.zeros((m // 32, k), dtype=u8, device=dev)) if wgrad else (dy2d, dy2d))
            w_c = ((torch.zeros((n, k), dtype=ws[3].dtype, device=dev),
                    torch.zeros((n // 32, k), dtype=u8, device=dev)) if dgrad else (dy2d, dy2d))
            dgrad_calls, wgrad_calls = [], []
            dy16 = w16c = dy16c = x16c = dy2d
            if dgrad:
                (l1, dy16), (l2, w16c) = dequant(ds[1], ds[2], True), dequant(*w_c, False)
                dgrad_calls = [l1, l2]
            if wgrad:
                (l1, dy16c), (l2, x16c) = dequant(ds[3], ds[4], False), dequant(*x_c, False)
                wgrad_calls = [l1, l2]
            table = [*ds, dy16, w16c, dy16c, x16c, *x_c, *w_c]
            bwd = _listed_launches(ext, dev, [lqd], table)
            dgrad_list = _listed_launches(ext, dev, dgrad_calls, table)
            wgrad_list = _listed_launches(ext, dev, wgrad_calls, table)
        bias_add = None
        if args.bias is not None:
            bias_add = _bias_add_launch(ext, torch.zeros((m, n), dtype=x.dtype, device=dev),
                                        args.bias)
    if (None in (fwd, bwd, dgrad_list, wgrad_list)
            or (args.bias is not None and bias_add is None)):
        return None
    plan = ext.Plan(fwd[0], fwd[0], _PythonBackward(args, q, wq, ("columnwise_data",
                                                                "columnwise_scale_inv")),
                    _DTYPE_NAMES[x.dtype], dev.index, m, k, n,
                    _DTYPE_NAMES[FP8_DTYPE[q.fp8_format]], _DTYPE_NAMES[FP8_DTYPE[fmt_bwd]],
                    _DTYPE_NAMES[w.dtype], q.columnwise_usage, wq.columnwise_usage, dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_mx(fwd, bwd, dgrad_list, wgrad_list, bias_add)
    return _with_bias_grad(ext, plan, args, slot)


def _nvfp4_plan(ext, args: LinearFwdArgs, m: int, k: int, n: int, slot):
    """A :class:`NativeLinear` under NVFP4BlockScaling (emulated, as the
    Python path runs it: cuda_gemm._emulated_nvfp4): x, W and dy quantized
    by the NVFP4 kernels (amax pass, quantize pass; dy with the stochastic
    draws), each GEMM's operands dequantized to bf16 by the blocks kernel,
    torch's bf16 GEMM with an fp32 product, and the epilogue kernel; or, for
    small products (``cuda_gemm.nvfp4_fused``), one kernel per GEMM."""
    from ...kernels import triton_nvfp4 as tn, triton_nvfp4_gemm as tg  # Triton: CUDA only
    from ...quantization.cuda_gemm import nvfp4_fused
    x, w = args.inp, args.weight
    q, wq = _input_quantizer(args), _weight_quantizer(args)
    if not ext.has_mm_dtype() or q.stochastic_rounding or wq.stochastic_rounding:
        return None  # the forward's copies are rounded to nearest (the recipe's)
    dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
    dev, bf16, f32 = x.device, torch.bfloat16, torch.float32
    fused = nvfp4_fused(m, n, k)  # fprop, dgrad and wgrad alike

    def quant(a2d, quantizer):  # (launches, (parts, six buffers), the two draws)
        launches, out = tn.quantize_calls(a2d, quantizer.with_2d_quantization,
                                          quantizer.with_rht, quantizer.stochastic_rounding,
                                          quantizer.rowwise_usage, quantizer.columnwise_usage)
        qargs = launches[1][3]
        parts = qargs[3]
        return launches, (parts, *(out.get(name, parts) for name in tn._BUFFERS)), qargs[5:7]

    def empty(r, c, dtype=bf16):
        return torch.zeros((r, c), dtype=dtype, device=dev)

    def gemm(a, b, a16, b16, acc, out, bias, table):
        """A GEMM's launches over ``table`` (``a``, ``b``: an operand's data,
        scales and amax): the operands' dequantizations, then the epilogue;
        fused: none, then the one kernel."""
        if fused:
            return [], _listed_launches(ext, dev, [tg.gemm_call(a, b, bias, out)], table)
        return (_listed_launches(ext, dev, [tn.dequantize_call(a[0], a[1], a16),
                                            tn.dequantize_call(b[0], b[1], b16)], table),
                _listed_launches(ext, dev, [tn.epilogue_call(acc, a[2], b[2], bias, out)], table))

    # planning draws dy's stochastic rounding on scratch: the generator is left
    # as it was, so the run's draws stay the Python path's
    with torch.no_grad(), torch.random.fork_rng(devices=[dev.index]):
        x2d, w2d = empty(m, k, x.dtype), empty(n, k, w.dtype)
        lqx, xs, _ = quant(x2d, q)
        lqw, ws, _ = quant(w2d, wq)
        x16, w16 = empty(m, k), empty(n, k)
        acc, y2d = empty(m, n, f32), empty(m, n, x.dtype)
        bias = None if args.bias is None else torch.zeros(n, dtype=x.dtype, device=dev)
        table = [x2d, w2d, *xs, *ws, x16, w16, acc, y2d, acc if bias is None else bias]
        fwd = _listed_launches(ext, dev, lqx + lqw, table)
        deq, epilogue = gemm(xs[1:4], ws[1:4], x16, w16, acc, y2d, bias, table)
        fwd = None if None in (fwd, deq) else fwd + deq
        bwd, dgrad_list, wgrad_list, epis = [], [], [], [None, None]
        parts_dy, stochastic = 0, False
        if dgrad or wgrad:
            dq = _grad_output_quantizer(args)
            stochastic = dq.stochastic_rounding
            dy2d = empty(m, n, x.dtype)
            lqd, ds, (r_row, r_col) = quant(dy2d, dq)
            parts_dy = ds[0].shape[0]
            # the saved columnwise copies: scratch of their shapes (dy2d where absent)
            u8, e4m3 = torch.uint8, torch.float8_e4m3fn
            x_c = ((empty(k, m // 2, u8), empty(k, m // 16, e4m3), empty(1, 1, f32).view(1))
                   if wgrad else (dy2d,) * 3)
            w_c = ((empty(k, n // 2, u8), empty(k, n // 16, e4m3), empty(1, 1, f32).view(1))
                   if dgrad else (dy2d,) * 3)
            dy16, w16c = (empty(m, n), empty(k, n)) if dgrad else (dy2d, dy2d)
            dy16c, x16c = (empty(n, m), empty(k, m)) if wgrad else (dy2d, dy2d)
            acc_d, dx = (empty(m, k, f32), empty(m, k, x.dtype)) if dgrad else (dy2d, dy2d)
            acc_w, dw = ((empty(n, k, f32), empty(n, k, _wgrad_dtype(args)))
                         if wgrad else (dy2d, dy2d))
            table = [dy2d, ds[0], r_row, r_col, *ds[1:], *x_c, *w_c, dy16, w16c, dy16c, x16c,
                     acc_d, dx, acc_w, dw]
            bwd = _listed_launches(ext, dev, lqd, table)
            if dgrad:  # dy rowwise times W columnwise
                dgrad_list, epis[0] = gemm(ds[1:4], w_c, dy16, w16c, acc_d, dx, None, table)
            if wgrad:  # dy columnwise times x columnwise
                wgrad_list, epis[1] = gemm(ds[4:7], x_c, dy16c, x16c, acc_w, dw, None, table)
    if None in (fwd, epilogue, bwd, dgrad_list, wgrad_list) or (
            (dgrad and epis[0] is None) or (wgrad and epis[1] is None)):
        return None
    names = ("columnwise_data", "columnwise_scale_inv", "columnwise_amax")
    plan = ext.Plan(fwd[0], fwd[0], _PythonBackward(args, q, wq, names),
                    _DTYPE_NAMES[x.dtype], dev.index, m, k, n, "float8_e4m3fn", "float8_e4m3fn",
                    _DTYPE_NAMES[_wgrad_dtype(args)], q.columnwise_usage, wq.columnwise_usage,
                    dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_nvfp4(fwd, epilogue[0], bwd, dgrad_list, epis[0] and epis[0][0], wgrad_list,
                   epis[1] and epis[1][0], xs[0].shape[0], ws[0].shape[0], parts_dy, stochastic,
                   fused)
    return _with_bias_grad(ext, plan, args, slot)


def _block_plan(ext, args: LinearFwdArgs, m: int, k: int, n: int, slot):
    """A :class:`NativeLinear` under Float8BlockScaling: one quantization
    launch for x and W (x alone where the weight cache is read, as the
    Python path), one for dy, and the block-scaled GEMMs."""
    import torch.nn.functional as F
    if not ext.has_block_gemm():
        return None
    x, w = args.inp, args.weight
    q, wq = _input_quantizer(args), _weight_quantizer(args)
    dgrad, wgrad = args.input_requires_grad, args.weight_requires_grad
    cache = _cache_mode(args)
    if cache != READ_CACHE and not q.pairs_with(wq):
        return None
    with torch.no_grad():
        x2d = torch.zeros((m, k), dtype=x.dtype, device=x.device)
        fwd_x = (_block_launch(ext, x2d, q) if cache == READ_CACHE else
                 _block_pair_launch(ext, x2d, torch.zeros((n, k), dtype=w.dtype, device=x.device),
                                    q, wq))
        bwd = fwd_x  # no backward: the node is never made
        if dgrad or wgrad:
            bwd = _block_launch(ext, torch.zeros((m, n), dtype=x.dtype, device=x.device),
                                _grad_output_quantizer(args))
        bias_add = None
        if args.bias is not None:
            bias_add = _bias_add_launch(ext, torch.zeros((m, n), dtype=x.dtype, device=x.device),
                                        args.bias)
    if None in (fwd_x, bwd) or (args.bias is not None and bias_add is None):
        return None
    e4m3 = _DTYPE_NAMES[FP8_DTYPE["e4m3"]]
    plan = ext.Plan(fwd_x, bwd, _PythonBackward(args, q, wq, ("columnwise_data",
                                                              "columnwise_scale_inv")),
                    _DTYPE_NAMES[x.dtype], x.device.index, m, k, n, e4m3, e4m3,
                    _DTYPE_NAMES[_wgrad_dtype(args)], q.columnwise_usage, wq.columnwise_usage,
                    dgrad, wgrad,
                    args.bias is not None, list(x.shape[:-1]) + [n], list(x.shape))
    plan.set_block(F.ScalingType.BlockWise1x128.value, F.ScalingType.BlockWise128x128.value,
                   bias_add)
    plan.set_cache(cache)
    if cache == NO_CACHE:
        _set_share(plan, args, q, wq, lambda w2d: _block_launch(ext, w2d, wq))
    return _with_bias_grad(ext, plan, args, slot, _cache_buffers(args) if cache else ())


def _bias_add_launch(ext, y2d, bias):
    """The native launch of the bias add the Python path runs after a
    block-scaled GEMM (compiled by launching it once on ``y2d``)."""
    from ...kernels import triton_bias  # Triton: imported on CUDA only
    grid, key, largs = triton_bias.bias_add_call(y2d, bias)
    triton_bias._bias_add_launch(grid, key, *largs)
    return native.launch_spec(ext, triton_bias._bias_add_launch, y2d.device.index, grid, key,
                              largs, [y2d, bias])


def _block_launch(ext, a2d, q):
    """The native launch of the blockwise kernel the Python path runs for
    ``a2d`` with quantizer ``q`` (compiled by launching it once)."""
    from ...kernels import triton_block as tb  # Triton: imported on CUDA only
    grid, key, largs, out = tb.fp8_block_call(a2d, q.fp8_format, q.block_scaling_dim == 2,
                                              q.force_pow_2_scales, q.amax_epsilon,
                                              q.rowwise_usage, q.columnwise_usage)
    tb._fp8_block_launch(grid, key, *largs)
    return native.launch_spec(ext, tb._fp8_block_launch, a2d.device.index, grid, key, largs,
                              [a2d, *tb._copy_args(out, a2d)])


def _block_pair_launch(ext, x2d, w2d, q, wq):
    """The native launch of the blockwise x/W pair kernel the Python path
    runs (``Float8BlockQuantizer.quantize_pair_unchecked``)."""
    from ...kernels import triton_block as tb  # Triton: imported on CUDA only
    grid, key, largs, out_x, out_w = tb.fp8_block_pair_call(
        x2d, w2d, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon,
        (q.block_scaling_dim == 2, q.rowwise_usage, q.columnwise_usage),
        (wq.block_scaling_dim == 2, wq.rowwise_usage, wq.columnwise_usage))
    tb._fp8_block_pair_launch(grid, key, *largs)
    return native.launch_spec(ext, tb._fp8_block_pair_launch, x2d.device.index, grid, key, largs,
                              [x2d, *tb._copy_args(out_x, x2d), w2d, *tb._copy_args(out_w, w2d)])


def _launch(ext, a2d, b2d, q, a_usage, b_usage, slot):
    """The native launch of the current-scaling kernel the Python path runs
    for these operands (compiled by launching it once on them)."""
    from ...kernels import triton_current as tc  # Triton: imported on CUDA only
    from ...kernels.triton_quant import _fp8_copy_args
    grid, key, args, out_a, out_b = tc.one_launch_call(
        a2d, b2d, q.fp8_format, q.force_pow_2_scales, q.amax_epsilon, a_usage,
        b_usage or (False, False), slot)
    tc._fp8_current_launch(grid, key, *args)
    # native_linear.cpp's slot order: forward x, W, x's copies, W's copies;
    # backward dy, dy's copies (data, transpose, scale_inv each), and so x
    # alone where the forward reads the weight cache
    slots = [a2d, *_fp8_copy_args(out_a, a2d)]
    if b2d is not None:
        slots = [a2d, b2d, *_fp8_copy_args(out_a, a2d), *_fp8_copy_args(out_b, b2d)]
    return native.launch_spec(ext, tc._fp8_current_launch, a2d.device.index, grid, key,
                              args, slots)
