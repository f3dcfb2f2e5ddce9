"""``te.Linear``: the module.  It validates its arguments, picks the
quantizers of the active recipe (``setup.py``), binds its state buffers,
and chooses each call's path in one place, :meth:`Linear._forward`:
torch's ``F.linear``, the eager native plan, the custom ops of ``ops.py``
(eager: the same impls under an ``autograd.Function``), or the eager
fallback for what the ops do not model.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import distributed as D
from ... import checkpointing
from ...autocast import get_amax_reduction_group, get_autocast_recipe
from ...dynamo.state import ensure_buffers, register_module
from ..weight_format import check_gathered_weight
from ...quantization.base import QuantizedTensorStorage
from .. import args_memo
from . import plain as linear_plain_ops
from ..extra_state import (LoadsWithoutExtraState, check_extra_state, pack_delayed_state,
                           unpack_delayed_state)
from .native import linear_plan
from .ops import LINEAR_OPS
from .args import LinearBwdArgs, LinearFwdArgs
from .setup import (_DELAYED_STATE, _PLAIN_TENSORS, _parallel_config, _torch_autocast_dtype,
                     check_gemm_shapes, first_microbatch_flag, gemm_state, init_weight_,
                     main_grad_of, set_quantizers, state_plan)
from ..param_split import join_rows, pack_rows, register_rows, split_layout

__all__ = ["Linear", "LinearFwdArgs", "LinearBwdArgs", "LINEAR_OPS"]


_MEMO_TENSORS = ("inp", "weight", "bias")  # the fields each memoized call supplies


class Linear(LoadsWithoutExtraState, torch.nn.Module):
    """Linear layer with Transformer Engine's argument names.

    Quantization follows the active ``te.autocast`` recipe.  ``forward`` runs
    the eager ``autograd.Function`` or, under ``torch.compile``, the custom
    ops (no Dynamo-disabling decorator); configurations the ops do not model
    fall back to eager (see ``compile_fallbacks``, docs/fallback.md).

    ``parameters_split``: hold the weight (and bias) as several parameters
    split along the output features, as Transformer Engine does: a tuple of
    names (equal parts) or a dict of name -> rows; ``("query_", "key_",
    "value_")`` gives ``query_weight``, ``key_weight``, ``value_weight``
    (and ``*_bias``) instead of ``weight`` / ``bias``.  The GEMM still runs
    once on the joined weight (docs/linear.md, "Split parameters").
    """

    _OPS = LINEAR_OPS  # the op pair; LayerNormLinear runs its own
    # a subclass whose eager calls keep an argument memo (module/args_memo.py)
    # says how its native plans are made (module/layernorm/linear_native.py)
    _MEMO = True
    _native_plan = staticmethod(linear_plan)
    # the backward quantizes W's columnwise copy from W itself instead of
    # keeping the forward's (set by te.fsdp.fully_shard's high-precision gather)
    save_original_weight = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 return_bias: bool = False, parallel_mode: Optional[str] = None, tp_group=None,
                 tp_size: int = 1, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 parameters_split=None, name: Optional[str] = None):
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
        # error label, built here: traced code may see the sizes as symbols (FSDP2)
        self._label = f"te.Linear({in_features} -> {out_features})"
        # this rank's shard of the weight: (local_out, local_in)
        self.local_out_features = out_features // (self.tp_size if parallel_mode == "column" else 1)
        self.local_in_features = in_features // (self.tp_size if parallel_mode == "row" else 1)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.name = name
        split = split_layout(parameters_split, out_features, parallel_mode, self.tp_size,
                             "te.Linear")
        if split is not None and fuse_wgrad_accumulation:
            raise NotImplementedError(
                "te.Linear: fuse_wgrad_accumulation=True with parameters_split is not supported "
                "(the GEMM computes the joined weight's gradient; main_grad is per parameter)")
        self.parameters_split = None if split is None else dict(split)  # rows on this rank
        self._weight_names, self._bias_names = (
            ("weight",), ("bias",)) if split is None else (
            tuple(f"{n}_weight" for n, _ in split), tuple(f"{n}_bias" for n, _ in split))
        weight = torch.empty(self.local_out_features, self.local_in_features,
                             dtype=params_dtype, device=device)
        bias_full = torch.zeros(self.local_out_features if parallel_mode == "column"
                                else out_features, dtype=params_dtype, device=device)
        rows = None if split is None else list(self.parameters_split.values())
        register_rows(self, self._weight_names, weight, rows)
        register_rows(self, self._bias_names, bias_full if bias else None, rows)
        self.init_method = init_method
        self.reset_parameters()
        self._state_key = register_module(self)  # names it for trace-time buffer allocation

    def __getstate__(self):
        """Pickles and copies leave the eager-arguments memo behind (it keys
        on this layer's parameter objects)."""
        state = super().__getstate__()
        state.pop("_args_memo", None)
        return state

    def __setstate__(self, state):
        """Copies and unpickled layers get their own state key (dynamo/state.py)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_label", f"te.Linear({self.in_features} -> "
                                           f"{self.out_features})")  # pickled before it existed
        # pickled before parameters_split existed
        self.__dict__.setdefault("parameters_split", None)
        self.__dict__.setdefault("_weight_names", ("weight",))
        self.__dict__.setdefault("_bias_names", ("bias",))
        self._state_key = register_module(self)
        self._pack_split_parameters()  # copies hold each part in a storage of its own

    def _apply(self, fn, recurse=True):
        """``module.to()`` / ``.cuda()`` / ``.to_empty()`` move each part of a
        split weight alone: lay them out one after another again."""
        out = super()._apply(fn, recurse)
        self._pack_split_parameters()
        return out

    def _pack_split_parameters(self) -> None:
        """Make a split layer's plain parameters adjacent row slices of one
        buffer again (their objects stay), so eager calls without gradients
        read them without a copy (param_split.join_rows).  Others are left as
        they are."""
        if self.parameters_split is not None:
            for names in (self._weight_names, self._bias_names):
                pack_rows([self._parameters.get(n) for n in names])

    def _weights(self) -> list:
        """The weight's parameters (one, or the ``parameters_split`` parts)."""
        return [self._parameters[n] for n in self._weight_names]

    def _is_parameter(self, weight) -> bool:
        """Whether ``weight`` is the layer's own weight parameter, which a
        backward may read again (``save_original_weight``), not a copy made
        for this call (torch.autocast's cast, ``parameters_split``'s joined
        parts: such a copy is larger than the quantized one it would replace)."""
        return self.parameters_split is None and weight is self._parameters["weight"]

    def _gemm_parameters(self) -> tuple:
        """``(weight, bias)`` as the GEMM takes them: the parameters, or
        under ``parameters_split`` the parts joined (bias None without one)."""
        if self.parameters_split is None:
            return self.weight, self.bias
        biases = [self._parameters[n] for n in self._bias_names]
        return (join_rows(self._weights()),
                None if biases[0] is None else join_rows(biases))

    def get_extra_state(self) -> torch.Tensor:
        """``state_dict()['..._extra_state']``, as Transformer Engine's: the
        DelayedScaling amax histories and scales, packed into one 1-D fp32
        tensor (history fwd (L, 2), scale fwd (2,), history bwd (L, 2), scale
        bwd (2,); length 4 L + 4), so state dicts stay tensor-valued; empty
        before the layer ran under DelayedScaling.  The cached FP8 weight is
        not saved: it is a function of the weight, rebuilt by the next
        ``is_first_microbatch=True``."""
        return pack_delayed_state(self, _DELAYED_STATE, self._weights()[0].device)

    @torch.no_grad()
    def set_extra_state(self, state) -> None:
        """Restore what :meth:`get_extra_state` saved: the layer continues as
        the saved one would.  Buffers of the same layout are copied into (so
        CUDA graphs keep their addresses); state the checkpoint lacks (saved
        before the layer ran, or from a bf16 run) is dropped."""
        check_extra_state("te.Linear", state)
        unpack_delayed_state(self, _DELAYED_STATE, state, self._weights()[0].device)


    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the weight (``init_method``, else as ``torch.nn.Linear``)
        and zero the bias, as ``__init__`` does.  With ``device="meta"``, then
        ``to_empty(device=...)``, this gives an initialised layer (the FSDP2
        recipe).  A TP layer initialises its own shard.  The FP8 state
        (delayed-scaling history, cached weight) is left as it is."""
        if self._weights()[0].is_meta:
            return
        for weight in self._weights():  # each part initialised as a layer of its own
            init_weight_(weight, self.init_method)
        for name in self._bias_names:
            if self._parameters[name] is not None:
                self._parameters[name].zero_()

    def extra_repr(self) -> str:
        tp = (f", parallel_mode={self.parallel_mode!r}, tp_size={self.tp_size}, "
              f"sequence_parallel={self.sequence_parallel}" if self.parallel_mode else "")
        split = ("" if self.parameters_split is None
                 else f", parameters_split={self.parameters_split}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self._has_bias()}, dtype={self._weights()[0].dtype}{tp}{split}")

    def _has_bias(self) -> bool:
        return self._parameters[self._bias_names[0]] is not None

    @torch.no_grad()
    def load_full_weight_(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        """Copy this rank's shard of a full ``(out, in)`` weight (and ``(out,)``
        bias) into the layer: a TP layer then equals the single-device layer
        built from the same full parameters."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"te.Linear.load_full_weight_: expected a weight of shape "
                             f"{(self.out_features, self.in_features)}, got {tuple(weight.shape)}")
        if bias is not None and (not self._has_bias()
                                 or tuple(bias.shape) != (self.out_features,)):
            raise ValueError(f"te.Linear.load_full_weight_: bias must be of shape "
                             f"({self.out_features},) on a layer with a bias")
        rank = 0 if self.tp_group is None else torch.distributed.get_rank(self.tp_group)
        # under parameters_split each part is sharded on its own (its rows of every part)
        rows = [self.out_features] if self.parameters_split is None else [
            r * (self.tp_size if self.parallel_mode == "column" else 1)
            for r in self.parameters_split.values()]
        for i, part in enumerate(weight.split(rows)):
            self._parameters[self._weight_names[i]].copy_(
                D.shard_parameter(part, self.parallel_mode, rank, self.tp_size))
            if bias is not None:
                self._parameters[self._bias_names[i]].copy_(D.shard_parameter(
                    bias.split(rows)[i], self.parallel_mode, rank, self.tp_size, is_bias=True))
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

    def _make_args(self, inp, is_first_microbatch, fp8_output, fp8_grad, weight=None,
                   bias=None, cast=False, key=...) -> LinearFwdArgs:
        """The forward op's arguments; ``weight`` / ``bias``: the parameters
        as the GEMMs take them (``cast``: torch.autocast's casts of them),
        default the layer's; ``key``: this call's memo key, if computed."""
        recipe = get_autocast_recipe()
        if weight is None:
            weight, bias = self._gemm_parameters()
            cast = self.parameters_split is not None  # joined: new tensors every call
        grad = torch.is_grad_enabled()
        if key is ...:
            key = self._memo_key(inp, recipe, grad, is_first_microbatch, fp8_output, fp8_grad,
                                 weight, bias, cast)
        template = args_memo.template(self, key)
        if template is not None:
            return template.with_tensors(inp, weight, None if self.return_bias else bias)
        args = self._checked_args(inp, recipe, grad, is_first_microbatch, fp8_output, fp8_grad,
                                  weight, bias)
        if key is not None:
            args_memo.remember(self, key, args, _MEMO_TENSORS, args_memo.bound_buffers(args),
                               args_memo.bound_main_grads(args))
        return args

    def _memo_key(self, inp, recipe, grad, is_first_microbatch, fp8_output, fp8_grad, weight,
                  bias, cast=False):
        """The argument memo's key for this call, or None where no memo
        applies.  ``weight`` and ``bias`` are the layer's parameters, or with
        ``cast`` torch.autocast's casts of them or the joined
        ``parameters_split`` parts (new tensors every call: the key then holds
        the parameters' dtype too)."""
        if (not (fp8_output or fp8_grad) and self._MEMO and not torch.compiler.is_compiling()
                and (cast or (weight is self.weight and bias is self.bias))
                and type(weight) in _PLAIN_TENSORS):
            return (recipe, grad, inp.shape, inp.dtype, type(inp), inp.requires_grad,
                    weight.dtype, weight.requires_grad,
                    None if bias is None else bias.requires_grad, self.return_bias,
                    self.save_original_input, self.save_original_weight, self.parallel_mode,
                    self.sequence_parallel,
                    self.tp_size, cast and self._weights()[0].dtype, get_amax_reduction_group(),
                    is_first_microbatch, self.fuse_wgrad_accumulation, self._memo_extra())
        return None

    def _memo_parameters(self) -> tuple:
        """The parameters whose objects an argument memo is made for."""
        return tuple(self._parameters[n] for n in self._weight_names + self._bias_names)

    def _memo_extra(self) -> tuple:
        """What else a subclass's memo key holds (its parameters' flags)."""
        return ()

    def _checked_args(self, inp, recipe, grad, is_first_microbatch, fp8_output, fp8_grad,
                      weight, bias) -> LinearFwdArgs:
        """:meth:`_make_args` without the memo: every check, every field."""
        self._check_input(inp)
        weight = check_gathered_weight("te.Linear", weight, recipe, grad)
        args = self._new_args(
            grad,
            inp=inp, weight=weight, bias=None if self.return_bias else bias,
            input_requires_grad=grad and inp.requires_grad,
            weight_requires_grad=grad and weight.requires_grad,
            bias_requires_grad=grad and bias is not None and bias.requires_grad
            and not self.return_bias,
            save_original_input=self.save_original_input,
            save_original_weight=self.save_original_weight and self._is_parameter(weight),
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
            set_quantizers(args, recipe, fp8_output, fp8_grad)
            self._check_shapes(args, inp)
        elif not isinstance(weight, QuantizedTensorStorage) and inp.dtype != weight.dtype:
            raise TypeError(f"te.Linear: input dtype {inp.dtype} differs from the weight's "
                            f"{weight.dtype} and no quantization recipe is active")
        if self.fuse_wgrad_accumulation and args.weight_requires_grad:
            args.main_grad = main_grad_of(self.weight, "te.Linear(fuse_wgrad_accumulation=True)",
                                          "weight")
        plan = state_plan(args, recipe, is_first_microbatch)
        if plan is not None:
            self._bind_state(args, *plan)
        return args

    def _new_args(self, grad_enabled: bool, **fields):
        """The forward op's argument dataclass (a subclass adds its fields)."""
        return LinearFwdArgs(**fields)

    def _check_fp8_grad(self, recipe) -> None:
        """``fp8_grad=True`` needs an FP8 recipe whose dgrad quantization the
        previous layer reads as its own dy: FP8 current scaling, FP8
        blockwise and MXFP8 (bit for bit what that layer would make), and
        DelayedScaling (with this layer's grad-input scale)."""
        from ... import recipe as R

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
        layout, bind = gemm_state(self, "", "te.Linear", args, delayed_recipe, first_microbatch,
                                  self.save_original_input)
        ensure_buffers(self._state_key, layout, self._weights()[0].device)
        bind()

    def _check_shapes(self, args: LinearFwdArgs, inp) -> None:
        """Clear errors for sizes the recipe's formats cannot take, before any
        kernel.  Reads ``divisibility()`` and tests the (maybe symbolic) sizes
        here: an exception raised inside an opaque member is not catchable."""
        m = inp.numel() // self.local_in_features  # rows the GEMMs see (gathered under SP)
        if self._tp_active() and self.sequence_parallel and self.parallel_mode == "column":
            m = m * self.tp_size
        check_gemm_shapes(self._label, args, m,
                          self.local_out_features, self.local_in_features)

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
        is_first_microbatch = first_microbatch_flag("te.Linear", is_first_microbatch)
        call = checkpointing.layer_call(self)  # inside activation checkpointing
        if call is None:
            return self._forward_autocast(inp, is_first_microbatch, fp8_output, fp8_grad, None)
        with call:  # a recomputation runs under the recipe it repeats
            return self._forward_autocast(inp, is_first_microbatch, fp8_output, fp8_grad, call)

    def _forward_autocast(self, inp, is_first_microbatch, fp8_output, fp8_grad, call):
        ac_dtype = _torch_autocast_dtype(inp)
        weight, bias = self._gemm_parameters()
        if ac_dtype is not None:
            # torch.autocast: compute in its dtype as torch.nn.Linear does, casting
            # here (traced, differentiable) and running the ops with autocast off,
            # so eager and compiled run the same GEMMs
            if not isinstance(weight, QuantizedTensorStorage) and weight.dtype != ac_dtype:
                weight = weight.to(ac_dtype)
            if bias is not None and bias.dtype != ac_dtype:
                bias = bias.to(ac_dtype)
            with torch.autocast(inp.device.type, enabled=False):
                return self._forward(inp.to(ac_dtype), weight, bias, is_first_microbatch,
                                     fp8_output, fp8_grad, call, cast=True)
        return self._forward(inp, weight, bias, is_first_microbatch, fp8_output, fp8_grad,
                             call, cast=self.parameters_split is not None)

    def _forward(self, inp, weight, bias, is_first_microbatch, fp8_output, fp8_grad,
                 call=None, cast=False):
        """The one place a call picks its path, first match wins:

        1. no recipe, no quantized output or gradient, a plain weight
           (:meth:`_plain_call`): without a bias added, ``F.linear``
           (inductor sees torch's own layer); with one, eagerly, the plain
           native node or :class:`~.plain.PlainLinear` (:meth:`_plain_eager`);
        2. eager, a configuration seen before (the argument memo): its
           native plan, one C++ call (``args_memo.native_forward``);
        3. compiled: the custom ops (``ops.py``), or the eager fallback
           (a graph break) for a configuration they do not model;
        4. eager otherwise: the ops' impls under an ``autograd.Function``.

        ``cast``: ``weight`` and ``bias`` are torch.autocast's casts of the
        parameters (or the parameters, where no cast was needed), or the
        joined ``parameters_split`` parts."""
        if not (fp8_output or fp8_grad) and self._plain_call(inp, weight):
            added = None if self.return_bias else bias
            if added is None:
                return self._finish({"out": torch.nn.functional.linear(inp, weight)})
            if linear_plain_ops.runs(inp, added):  # eager
                return self._finish(self._plain_eager(inp, weight, added, is_first_microbatch,
                                                      call, cast))
        key = ...
        if not torch.compiler.is_compiling():
            key = self._memo_key(inp, get_autocast_recipe(), torch.is_grad_enabled(),
                                 is_first_microbatch, fp8_output, fp8_grad, weight, bias, cast)
            outputs = args_memo.native_forward(self, key, call, inp, weight,
                                               None if self.return_bias else bias)
            if outputs is not None:
                return self._finish(outputs)
        args = self._make_args(inp, is_first_microbatch, fp8_output, fp8_grad, weight, bias,
                               cast, key)
        if call is not None:
            call.bind(args)
        if torch.compiler.is_compiling():
            reason = args.compile_unsupported_reason()
            if reason is None and args.grad_input_quantizer is not None and inp.is_leaf:
                # a graph input: AOTAutograd cannot return a quantized gradient for it
                reason = "fp8_grad_graph_input"
            if reason is not None:
                return self._eager_fallback(reason, inp, weight, bias, is_first_microbatch,
                                            fp8_output, fp8_grad)
            outputs = self._OPS(args)
        else:
            outputs = self._OPS.eager(args)
        return self._finish(outputs)

    def _plain_eager(self, inp, weight, bias, is_first_microbatch, call, cast) -> dict:
        """An eager plain call with a bias added: from a configuration's
        second call on the native node (linear/native.py's plain plan),
        else :class:`~.plain.PlainLinear`, whose first call
        makes the memo entry the plan hangs on; the same bits either way."""
        key = self._memo_key(inp, None, torch.is_grad_enabled(), is_first_microbatch, False,
                             False, weight, bias, cast)
        outputs = args_memo.native_forward(self, key, call, inp, weight, bias)
        if outputs is not None:
            return outputs
        if key is not None and args_memo.template(self, key) is None:
            self._make_args(inp, is_first_microbatch, False, False, weight, bias, cast, key)
        return {"out": linear_plain_ops.PlainLinear.apply(inp, weight, bias)}

    def _plain_call(self, inp, weight) -> bool:
        """Whether this call is what ``torch.nn.Linear`` computes: no recipe,
        a plain weight (not quantized, not FSDP2's quantized-gather wrapper),
        no tensor parallelism, no fused wgrad accumulation.  Without a bias
        added (the Llama-style layer) the layer then runs ``F.linear``, which
        inductor sees like torch's own layer, instead of the ops, whose host
        time buys nothing without quantization.  The two GEMMs of
        the backward are the same cuBLAS calls eager and compiled, so
        compiled still equals eager bit for bit.  A bias keeps the ops when
        compiled, whose bias gradient reduces the same way in both (inductor
        would reorder ``F.linear``'s); eagerly it runs their kernels behind
        one lean node (:meth:`_plain_eager`).  Subclasses with
        their own ops (the fused norm) never do.  The input checks apply."""
        if (self._OPS is not LINEAR_OPS or get_autocast_recipe() is not None
                or self._tp_active()
                or (self.fuse_wgrad_accumulation and weight.requires_grad)
                or type(weight) not in (torch.nn.Parameter, torch.Tensor)):
            return False
        self._check_input(inp)
        return inp.dtype == weight.dtype  # else _make_args raises its dtype error

    def _finish(self, outputs: dict):
        out = outputs["out"]
        return (out, self._returned_bias()) if self.return_bias else out

    def _returned_bias(self):
        """What ``return_bias`` hands back for the caller to add: the bias
        parameter, or the joined ``parameters_split`` parts."""
        return self.bias if self.parameters_split is None else self._gemm_parameters()[1]

    @torch.compiler.disable
    def _eager_fallback(self, reason, inp, weight, bias, is_first_microbatch, fp8_output,
                        fp8_grad):
        """Eager run of a configuration the ops do not model (a graph break)."""
        from ...dynamo.fallback import record_fallback

        record_fallback(self, reason)
        if reason == "fp8_grad_graph_input":  # the gradient leaves in high precision
            fp8_grad = False
        return self._forward(inp, weight, bias, is_first_microbatch, fp8_output, fp8_grad)

    def compile_fallbacks(self) -> tuple:
        """Reasons this layer fell back to eager under torch.compile (first seen first)."""
        from ...dynamo.fallback import fallback_reasons

        return fallback_reasons(self)
