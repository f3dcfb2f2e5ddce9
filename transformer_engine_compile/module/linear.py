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
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..dynamo import compat
from ..dynamo.buckets import TensorOrQuantized
from ..dynamo.custom_op import OpResult, register_custom_op
from ..dynamo.opaque import is_value_opaque
from ..dynamo.tensor_proto import TensorProto
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
    weight_workspace: TensorOrQuantized = None  # cached quantized weight to reuse
    input_quantizer: Optional[Quantizer] = None
    weight_quantizer: Optional[Quantizer] = None
    output_quantizer: Optional[Quantizer] = None  # fp8_output
    grad_output_quantizer: Optional[Quantizer] = None
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    save_original_input: bool = False      # save x, re-quantize it in backward
    cache_weight: bool = False             # return the quantized weight as a workspace
    main_grad: Optional[torch.Tensor] = None  # fuse_wgrad_accumulation target (fp32)
    tp_group: Optional[ProcessGroup] = None

    def quantizers(self) -> tuple:
        return (self.input_quantizer, self.weight_quantizer, self.output_quantizer,
                self.grad_output_quantizer)

    def compile_unsupported_reason(self) -> Optional[str]:
        """Name of the first configuration the ops do not model, else None
        (keys of ``dynamo.fallback.REASONS``)."""
        if compat.OPAQUE_UNAVAILABLE_REASON is not None:
            return "no_opaque_api"
        if self.main_grad is not None:
            return "fuse_wgrad_accumulation"
        if self.cache_weight or self.weight_workspace is not None:
            return "weight_caching"
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
    grad_output: torch.Tensor              # (..., out_features)
    inputmat: TensorOrQuantized = None     # x (columnwise copy if quantized), for wgrad
    weightmat: TensorOrQuantized = None    # W (columnwise copy if quantized), for dgrad
    input_quantizer: Optional[Quantizer] = None  # re-quantizes x if save_original_input
    grad_output_quantizer: Optional[Quantizer] = None
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    weight_dtype: torch.dtype = torch.float32
    bias_dtype: Optional[torch.dtype] = None
    main_grad: Optional[torch.Tensor] = None


def _out_shape(x_shape, weight_shape) -> tuple:
    return (*x_shape[:-1], weight_shape[0])


# -- forward ------------------------------------------------------------------------
def _weight_for_gemm(args: LinearFwdArgs):
    """(weight operand, new workspace or None)."""
    if args.weight_workspace is not None:
        return args.weight_workspace, None
    w = args.weight
    if isinstance(w, QuantizedTensorStorage) or args.weight_quantizer is None:
        return w, None
    q = args.weight_quantizer.with_usage(
        rowwise=True, columnwise=args.input_requires_grad or args.cache_weight)
    wq = q.quantize(w)
    return wq, (wq if args.cache_weight else None)


def _weight_for_gemm_fake(args: LinearFwdArgs):
    if args.weight_workspace is not None:
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


def linear_forward(args: LinearFwdArgs) -> OpResult:
    x = args.inp
    xq = x
    if args.input_quantizer is not None:
        xq = args.input_quantizer.with_usage(**_input_usage(args)).quantize(x)
    w, workspace = _weight_for_gemm(args)
    y = gemm(xq, "rowwise", w, "rowwise", x.dtype, args.bias,
             fast_accum=True).view(_out_shape(x.shape, w.shape))
    if args.output_quantizer is not None:
        y = args.output_quantizer.quantize(y)
    saved_x = None
    if args.weight_requires_grad:
        saved_x = x
        if xq is not x and not args.save_original_input:
            xq.update_usage(rowwise_usage=False)  # wgrad reads the columnwise copy only
            saved_x = xq
    saved_w = w if args.input_requires_grad else None
    return OpResult({"out": y, "weight_workspace": workspace},
                    {"inputmat": saved_x, "weightmat": saved_w})


def linear_forward_fake(args: LinearFwdArgs) -> OpResult:
    x = args.inp
    xq = x
    if args.input_quantizer is not None:
        xq = TensorProto(x.shape, x.dtype, args.input_quantizer.with_usage(**_input_usage(args)),
                         device=x.device)
    w, workspace = _weight_for_gemm_fake(args)
    y = TensorProto(_out_shape(x.shape, w.shape), x.dtype, device=x.device)
    if args.output_quantizer is not None:
        y = TensorProto(y.shape, y.dtype, args.output_quantizer, device=x.device)
    saved_x = None
    if args.weight_requires_grad:
        saved_x = x
        if xq is not x and not args.save_original_input:
            xq.update_usage(rowwise=False)
            saved_x = xq
    saved_w = w if args.input_requires_grad else None
    return OpResult({"out": y, "weight_workspace": workspace},
                    {"inputmat": saved_x, "weightmat": saved_w})


def linear_setup_context(args: LinearFwdArgs) -> dict:
    """Non-tensor fields of LinearBwdArgs (tensors come from ``saved``)."""
    return {
        "input_quantizer": args.input_quantizer if args.save_original_input else None,
        "grad_output_quantizer": args.grad_output_quantizer,
        "input_requires_grad": args.input_requires_grad,
        "weight_requires_grad": args.weight_requires_grad,
        "bias_requires_grad": args.bias_requires_grad,
        "weight_dtype": args.weight.dtype,
        "bias_dtype": None if args.bias is None else args.bias.dtype,
        "main_grad": args.main_grad,
    }


# -- backward ------------------------------------------------------------------------
def _grad_output_usage(args: LinearBwdArgs) -> dict:
    return {"rowwise": args.input_requires_grad, "columnwise": args.weight_requires_grad}


def _needs_requantized_input(args: LinearBwdArgs, x) -> bool:
    """True when the saved input is high precision but wgrad is quantized
    (save_original_input); ``x`` is a tensor/storage (real) or a proto (fake)."""
    quantized_x = (isinstance(x, QuantizedTensorStorage)
                   or (isinstance(x, TensorProto) and x.is_quantized))
    return args.input_quantizer is not None and not quantized_x


def linear_backward(args: LinearBwdArgs) -> dict:
    dy = args.grad_output
    dyq = dy
    if args.grad_output_quantizer is not None and (args.input_requires_grad
                                                   or args.weight_requires_grad):
        dyq = args.grad_output_quantizer.with_usage(**_grad_output_usage(args)).quantize(dy)
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        w = args.weightmat
        dgrad = gemm(dyq, "rowwise", w, "columnwise", dy.dtype).view(
            *dy.shape[:-1], w.shape[-1])
    if args.weight_requires_grad:
        x = args.inputmat
        if _needs_requantized_input(args, x):
            x = args.input_quantizer.with_usage(rowwise=False, columnwise=True).quantize(x)
        wgrad = gemm(dyq, "columnwise", x, "columnwise", args.weight_dtype)
        if args.main_grad is not None:
            args.main_grad.add_(wgrad)  # fuse_wgrad_accumulation (eager only)
            wgrad = None
    if args.bias_requires_grad:
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0).to(args.bias_dtype)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias}


def linear_backward_fake(args: LinearBwdArgs) -> dict:
    dy = args.grad_output
    dgrad = wgrad = dbias = None
    if args.input_requires_grad:
        dgrad = TensorProto((*dy.shape[:-1], args.weightmat.shape[-1]), dy.dtype, device=dy.device)
    if args.weight_requires_grad:
        if args.main_grad is None:
            wgrad = TensorProto((dy.shape[-1], args.inputmat.shape[-1]), args.weight_dtype,
                                device=dy.device)
    if args.bias_requires_grad:
        dbias = TensorProto((dy.shape[-1],), args.bias_dtype, device=dy.device)
    return {"inp": dgrad, "weight": wgrad, "bias": dbias}


LINEAR_OPS = register_custom_op(
    "linear",
    fwd_args=LinearFwdArgs, bwd_args=LinearBwdArgs,
    forward=linear_forward, forward_fake=linear_forward_fake,
    backward=linear_backward, backward_fake=linear_backward_fake,
    setup_context=linear_setup_context,
    grad_fields={"grad_output": "out"},
)


# -- the module ----------------------------------------------------------------------
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
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"te.Linear: parallel_mode must be None, 'column' or 'row', "
                             f"got {parallel_mode!r}")
        if parallel_mode is not None or tp_size != 1 or sequence_parallel or tp_group is not None:
            raise NotImplementedError("te.Linear: tensor/sequence parallelism is not "
                                      "implemented yet (parallel_mode, tp_group, tp_size, "
                                      "sequence_parallel)")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if not params_dtype.is_floating_point or params_dtype.itemsize < 2:
            raise TypeError(f"te.Linear: params_dtype must be float32, bfloat16 or float16, "
                            f"got {params_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.name = name
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
                     if bias else None)
        if init_method is not None:
            init_method(self.weight)
        else:
            torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as torch.nn.Linear
        self._weight_workspace = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}")

    # -- argument building (runs in eager and in traced code) -----------------------------
    def _check_input(self, inp) -> None:
        if not isinstance(inp, torch.Tensor) or isinstance(inp, QuantizedTensorStorage):
            raise TypeError(f"te.Linear expects a high-precision torch.Tensor input, "
                            f"got {type(inp).__name__}")
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"te.Linear input must be float32, bfloat16 or float16, got {inp.dtype}")
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"te.Linear({self.in_features} -> {self.out_features}): input of "
                             f"shape {tuple(inp.shape)} must end in {self.in_features}")

    def _make_args(self, inp, is_first_microbatch, fp8_output) -> LinearFwdArgs:
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
        )
        if fp8_output and recipe is None:
            raise ValueError("te.Linear: fp8_output=True needs an active quantization recipe "
                             "(te.autocast(enabled=True, recipe=...))")
        if fp8_output and (args.input_requires_grad or args.weight_requires_grad
                           or args.bias_requires_grad):
            raise NotImplementedError(
                "te.Linear: fp8_output=True is supported without gradients only (inference "
                "or torch.no_grad()); the backward has no quantized-gradient input")
        if recipe is not None and recipe.delayed():
            raise NotImplementedError(
                "te.Linear: DelayedScaling needs per-layer amax-history state, which is not "
                "implemented yet; use recipe.Float8CurrentScaling() (same FP8 formats)")
        if recipe is not None:
            args.input_quantizer = quantizer_for(recipe, "input", internal=True)
            args.weight_quantizer = quantizer_for(recipe, "weight", internal=True)
            args.grad_output_quantizer = quantizer_for(recipe, "grad_output", internal=True)
            if fp8_output:
                args.output_quantizer = quantizer_for(recipe, "output")
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
        if is_first_microbatch is not None and args.weight_quantizer is not None \
                and not isinstance(weight, QuantizedTensorStorage):
            if is_first_microbatch or self._weight_workspace is None:
                args.cache_weight = True
            else:
                args.weight_workspace = self._weight_workspace
        return args

    def _check_shapes(self, args: LinearFwdArgs, inp) -> None:
        """Clear errors for sizes the recipe's formats cannot take, before any
        kernel.  Reads ``divisibility()`` and tests the (maybe symbolic) sizes
        here: an exception raised inside an opaque member is not catchable."""
        m = inp.numel() // self.in_features
        checks = (
            ("input", args.input_quantizer, (m, self.in_features), _input_usage(args)),
            ("weight", args.weight_quantizer, (self.out_features, self.in_features),
             {"rowwise": True, "columnwise": args.input_requires_grad}),
            ("grad_output", args.grad_output_quantizer, (m, self.out_features),
             {"rowwise": args.input_requires_grad, "columnwise": args.weight_requires_grad}),
        )
        for role, q, (rows, cols), usage in checks:
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
    def forward(self, inp, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False):
        args = self._make_args(inp, is_first_microbatch, fp8_output)
        if torch.compiler.is_compiling():
            reason = args.compile_unsupported_reason()
            if reason is not None:
                return self._eager_fallback(reason, inp, is_first_microbatch, fp8_output)
            outputs = LINEAR_OPS(args)
        else:
            outputs = LINEAR_OPS.eager(args)
            if args.cache_weight:
                self._weight_workspace = outputs["weight_workspace"]
        return self._finish(outputs["out"])

    def _finish(self, out):
        return (out, self.bias) if self.return_bias else out

    @torch.compiler.disable
    def _eager_fallback(self, reason, inp, is_first_microbatch, fp8_output):
        """Eager run of a configuration the ops do not model (a graph break)."""
        from ..dynamo.fallback import record_fallback

        record_fallback(self, reason)
        return self.forward(inp, is_first_microbatch, fp8_output)

    def compile_fallbacks(self) -> tuple:
        """Reasons this layer fell back to eager under torch.compile (first seen first)."""
        from ..dynamo.fallback import fallback_reasons

        return fallback_reasons(self)
