"""The linear ops' real impls run natively.

A compiled graph whose ``te_compile::linear_fwd`` / ``linear_bwd`` calls
stay ops (not lowered into inductor), and the op host-time benchmark, run
the ops' Python impls: ~100 us of Python per call around the same few
kernels.  Where the eager path's native plan covers a call's
configuration (module/linear/native.py), the op's kernel runs it instead,
one C++ call (kernels/native_linear_op.cpp) returning the flat outputs
the Python impl would, bit for bit: the same kernels with the same
arguments.  Without a recipe the short path (module/linear/plain.py)
runs, but a backward whose bias takes a gradient runs the plain plan
(``F.linear``'s GEMMs from C++, the bias gradient's two launches), bit
for bit the short path's: its launches cost ~25 us less there, while
the GEMM-only calls cost the same either way (``benchmarks --configs host`` on
an H200).  Not covered, so the Python impls run: the FP8
weight cache
(``is_first_microbatch``), and what the eager plan does not cover (tensor
parallelism, ``fp8_output`` / ``fp8_grad``, FP8 weights,
``save_original_input``, an amax reduction group); a backward whose
forward saved no copy of x or of W (a frozen weight, an input without
gradient); a CUDA graph being captured.

Plans are kept per call site: in the op's decoder of the call's simple
values (``ArgPlan.decoder``), keyed by the tensors' shapes, dtypes and
devices and the quantizers' configurations (by value: a compiled graph
makes its value-opaque quantizers anew on every call).  A configuration gets its plan at its second
call, so a shape seen once (a ragged batch) costs no planning; each call
site keeps its last :data:`PLANS` configurations.  The backward's plan is
made from the backward's arguments alone (a forward may have been
lowered, or planned in another process): the forward arguments they
imply, with the saved copies' quantizers as x's and W's.
"""

from __future__ import annotations

import torch

from ...checkpointing import check_forward_op_in_backward
from ...quantization.opaque import _config_key
from ...kernels import grid_state, native, tracing
from ...quantization.blockwise import Float8BlockwiseQTensorStorage
from ...quantization.float8 import Float8TensorStorage
from ...quantization.mxfp8 import MXFP8TensorStorage
from ...quantization.nvfp4 import NVFP4TensorStorage
from .native import linear_plan
from .plain import _PLAIN  # the short path's plain tensor types
from .args import LinearFwdArgs

# configurations kept per call site (the oldest goes first): a dynamic graph's
# token counts, training and evaluation
PLANS = 8


class _Entry:
    """One configuration's plan: None until its second call, False where it
    has none; ``expected``: the fake's outputs, until a native call's are
    checked against them."""

    __slots__ = ("plan", "expected")

    def __init__(self):
        self.plan = self.expected = None


def _entry(plans: dict, key):
    """The entry of ``key``, or None where this is its first call (then
    made: the oldest entry goes when full)."""
    entry = plans.get(key)
    if entry is None:
        if len(plans) >= PLANS:
            del plans[next(iter(plans))]
        plans[key] = _Entry()
    return entry


def _config(q):
    """A quantizer's configuration as a key: its class and config fields
    (a snapshot: ``set_usage`` may change the object later), None for None."""
    return None if q is None else (type(q), _config_key(q))


def _forward_key(args) -> tuple:
    """A forward call's configuration (besides its simple values)."""
    x, w, b, g, h = args.inp, args.weight, args.bias, args.main_grad, args.amax_history_fwd
    return (x.shape, x.dtype, x.device, type(w), w.shape, w.dtype,
            None if b is None else b.dtype, _config(args.input_quantizer),
            _config(args.weight_quantizer), _config(args.grad_output_quantizer),
            None if g is None else g.dtype, None if h is None else h.shape)


def _backward_key(args) -> tuple:
    """A backward call's configuration (besides its simple values; saved
    copies of x and W present, or x and W themselves without a recipe)."""
    dy, xs, ws, g, h = (args.grad_output, args.inputmat, args.weightmat, args.main_grad,
                        args.amax_history_bwd)
    return (dy.shape, dy.dtype, dy.device, ws.shape, _config(args.grad_output_quantizer),
            _config(getattr(xs, "_quantizer", None)), _config(getattr(ws, "_quantizer", None)),
            getattr(xs, "dtype", None), getattr(ws, "dtype", None),
            None if g is None else g.dtype, None if h is None else h.shape)


def planned(pair, flat, backward: bool = False):
    """The plan the forward (or backward) op keeps for the call of these flat
    arguments: a ``NativeLinear``, None (none asked for yet) or False (none
    for it); tests and benchmarks ask."""
    plan = pair.bwd_plan if backward else pair.fwd_plan
    decoder = plan.decoder(flat[-1])
    args = decoder(flat)
    if backward and _saved(args) is None:
        return False
    if not backward and args.input_quantizer is None:  # no recipe: the short path
        return False
    entry = decoder.native.get((_backward_key if backward else _forward_key)(args))
    return None if entry is None else entry.plan


def _shapes(flat) -> list:
    return [list(t.shape) for t in flat]


def _checked(entry: _Entry, out, what: str):
    """``out``; a plan's first outputs checked against its op's fake (shapes
    and dtypes): a mismatch is a bug of the native impl, never returned."""
    if entry.expected is not None:
        got = [(tuple(t.shape), t.dtype) for t in out]
        want = [(tuple(t.shape), t.dtype) for t in entry.expected]
        if got != want:
            raise RuntimeError(f"te_compile: the native {what} op returned {got}, its fake lays "
                               f"out {want} (a bug: TE_COMPILE_NATIVE=0 runs the Python impls)")
        entry.expected = None
    return out


def _capturing(t) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s device: no planning
    then (what it allocated would stay in the graph's memory pool)."""
    return grid_state.slot(t.device) is None


def _op_plan(args, fake, flat, entry: _Entry, backward: bool) -> None:
    """Plan ``args``' configuration for an op into ``entry`` (False where it
    has none; left None while the extension is being built).  The plan
    keeps no tensor of the call (the eager path's state list, its Python
    backward): they would outlive it, a ``main_grad`` among them, or sit
    in a CUDA graph's pool (cudagraph trees run a graph's first calls in
    its pool)."""
    plan = linear_plan(args)
    if plan is ...:  # the extension is still being built: ask again next call
        return
    if plan is None:
        entry.plan = False
        return
    plan.state = []
    plan.plan.drop_python_backward()
    entry.expected = fake(*flat)
    shapes = _shapes(entry.expected)
    if backward:
        plan.plan.set_op_shapes([], shapes)
    else:
        plan.plan.set_op_shapes(shapes, [])
    entry.plan = plan


def _usable(x) -> bool:
    return type(x) is torch.Tensor and x.is_cuda and native.ENABLED and not tracing.active


def forward(pair, decoder, flat, args):
    """``te_compile::linear_fwd``'s outputs from the native plan, or None
    (``decoder``, ``args``: the call's decoder and decoded arguments)."""
    x = args.inp
    if args.input_quantizer is None or not _usable(x):  # no recipe: the short path
        return None
    w, b, h = args.weight, args.bias, args.amax_history_fwd
    entry = _entry(decoder.native, _forward_key(args))
    if entry is None or entry.plan is False:
        return None
    if entry.plan is None and args.weight_workspace is not None:
        entry.plan = False  # the FP8 weight cache: the Python impl
        return None
    ready = _ready(entry, lambda: args, pair._fwd_fake, flat, False, x)
    if ready is None:
        return None
    linear, slot = ready
    check_forward_op_in_backward(args)
    state = [] if h is None else [h, args.scale_fwd]
    out = linear.ext.linear_op_forward(linear.plan, x, w, b, slot[0], slot[1], state)
    return _checked(entry, out, "forward") if out else None


def _ready(entry: _Entry, planning_args, fake, flat, backward: bool, t):
    """(plan, counter slot) for a native call on ``t``, or None: no plan
    for the configuration, or none now (a CUDA graph being captured, a slot
    the plan cannot use).  Plans the entry first where it has none yet
    (``planning_args()``: the forward arguments to plan from)."""
    if entry.plan is None:
        if _capturing(t):
            return None
        _op_plan(planning_args(), fake, flat, entry, backward)
        if not entry.plan:
            return None
    slot = entry.plan.slot_for(t)
    return None if slot is None else (entry.plan, slot)


def _copies(storage) -> list:
    """A saved columnwise copy's buffers (those of its columnwise usage, and
    those both usages share, in declaration order: data, scales, NVFP4's
    amax), in the native call's three places (None where absent)."""
    out = [getattr(storage, "_" + s.name) for s in storage._BUFFERS
           if s.usage in ("columnwise", "both")]
    return out + [None] * (3 - len(out))


# the saved copies the native backward takes: plain storages of a plan's formats
_STORAGES = (Float8TensorStorage, Float8BlockwiseQTensorStorage, MXFP8TensorStorage,
             NVFP4TensorStorage)


def _saved(args):
    """The saved x and W as the native backward takes them (six places:
    ``_copies``), or None where it does not: a quantized copy of each of a
    plan's formats, or without a recipe x and W themselves where the bias
    takes a gradient; not where either is absent (a frozen weight, an
    input without gradient)."""
    xs, ws = args.inputmat, args.weightmat
    if type(xs) in _STORAGES and type(ws) is type(xs):
        return _copies(xs) + _copies(ws)
    if (args.grad_output_quantizer is None and args.bias_requires_grad
            and type(xs) in _PLAIN and type(ws) in _PLAIN):
        return [xs, None, None, ws, None, None]
    return None


def backward(pair, decoder, flat, args):
    """``te_compile::linear_bwd``'s outputs from the native plan, or None."""
    dy, xs, ws = args.grad_output, args.inputmat, args.weightmat
    saved = _saved(args) if _usable(dy) else None
    if saved is None:
        return None
    h = args.amax_history_bwd
    entry = _entry(decoder.native, _backward_key(args))
    if entry is None or entry.plan is False:
        return None
    xq, wq = getattr(xs, "_quantizer", None), getattr(ws, "_quantizer", None)
    if entry.plan is None and type(xs) in _STORAGES and (xq is None or wq is None):
        entry.plan = False
        return None
    ready = _ready(entry, lambda: _forward_args(args, dy, xq, wq), pair._bwd_fake, flat,
                   True, dy)
    if ready is None:
        return None
    linear, slot = ready
    state = [] if h is None else [h, args.scale_bwd]
    out = linear.ext.linear_op_backward(linear.plan, dy, saved, slot[0], slot[1], state)
    return _checked(entry, out, "backward") if out else None


def _forward_args(args, dy, xq, wq) -> LinearFwdArgs:
    """The forward arguments a backward's arguments imply, for planning: x,
    W and the bias as empty tensors of their shapes, the saved copies'
    quantizers as x's and W's, the backward's state buffers standing in for
    the forward's (the same shapes; planning reads only their shapes)."""
    n, k = args.weightmat.shape
    dev = dy.device
    return LinearFwdArgs(
        inp=torch.empty((*dy.shape[:-1], k), dtype=dy.dtype, device=dev),
        weight=torch.empty((n, k), dtype=args.weight_dtype, device=dev),
        bias=(None if args.bias_dtype is None
              else torch.empty((n,), dtype=args.bias_dtype, device=dev)),
        input_quantizer=xq, weight_quantizer=wq,
        grad_output_quantizer=args.grad_output_quantizer,
        grad_input_quantizer=args.grad_input_quantizer,
        input_requires_grad=args.input_requires_grad,
        weight_requires_grad=args.weight_requires_grad,
        bias_requires_grad=args.bias_requires_grad,
        save_original_input=args.input_quantizer is not None,
        main_grad=args.main_grad,
        amax_history_fwd=args.amax_history_bwd, scale_fwd=args.scale_bwd,
        amax_history_bwd=args.amax_history_bwd, scale_bwd=args.scale_bwd,
        parallel_mode=args.parallel_mode, sequence_parallel=args.sequence_parallel,
        tp_size=args.tp_size, tp_group=args.tp_group, amax_group=args.amax_group,
        dgrad_fast_accum=args.dgrad_fast_accum, wgrad_fast_accum=args.wgrad_fast_accum)
