"""``te.LayerNormMLP``: LayerNorm or RMSNorm, fc1, activation and fc2 in one
module (Transformer Engine's MLP block) on one pair of custom ops
(``layernorm/mlp_ops.py``).  Each GEMM's arguments are built by the
one-GEMM logic of ``linear/layer.py`` (quantizers, shape checks, state buffers,
``main_grad``) and merged into the op's arguments.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from ..weight_format import check_gathered_weight
from ... import checkpointing
from ... import distributed as D
from ...autocast import get_amax_reduction_group, get_autocast_recipe
from ...dynamo.arg_views import merge_views
from ...dynamo.state import ensure_buffers, register_module
from ...quantization.base import QuantizedTensorStorage
from .. import args_memo
from .linear import check_norm_config
from .mlp_native import plan_for_layernorm_mlp
from .mlp_ops import GATED, GEMMS, LAYERNORM_MLP_OPS, LayerNormMLPFwdArgs
from ...kernels.reference import ACTIVATIONS
from ..norm.layer import reset_norm_parameters
from ..extra_state import (LoadsWithoutExtraState, check_extra_state, delayed_state_names,
                           pack_delayed_state, unpack_delayed_state)
from ..linear.setup import (_PLAIN_TENSORS, _parallel_config, init_weight_, _torch_autocast_dtype,
                            check_gemm_shapes, first_microbatch_flag, gemm_state, main_grad_of,
                            set_quantizers, state_plan)
from ..linear.args import LinearFwdArgs

__all__ = ["LayerNormMLP"]

_OWNER = "te.LayerNormMLP"
# the fields each call supplies to a memoized call's arguments (module/args_memo.py)
_MEMO_TENSORS = ("inp", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


class _Gemm(NamedTuple):
    """One GEMM of the module: its parameters' names and this rank's sizes."""

    prefix: str            # "fc1_" / "fc2_": op fields, parameters, buffers
    parallel_mode: Optional[str]
    local_in: int
    local_out: int
    label: str             # in messages


class LayerNormMLP(LoadsWithoutExtraState, torch.nn.Module):
    """``fc2(act(fc1(norm(x))))`` with Transformer Engine's argument names.

    ``normalization``: ``"LayerNorm"`` (``layer_norm_weight``,
    ``layer_norm_bias``) or ``"RMSNorm"`` (``layer_norm_weight`` only);
    ``zero_centered_gamma``: the norm scales by ``1 + layer_norm_weight``.
    ``activation``: one of ``ACTIVATIONS`` (Transformer Engine's: ``gelu`` is
    the tanh approximation; a gated one (``geglu``, ``reglu``, ``swiglu``,
    ``qgeglu``, ``sreglu``) doubles fc1's outputs and applies the activation
    to the first half, multiplied by the second).  ``bias``: fc1 and fc2
    biases; ``return_bias``: fc2's bias is returned instead of added.
    ``return_layernorm_output``: also return the normalised input.  Returns
    ``out[, fc2_bias][, ln_out]``.

    ``set_parallel_mode=True`` splits fc1 column-parallel and fc2
    row-parallel over ``tp_group`` (ffn_hidden_size divided by the group
    size); with ``sequence_parallel`` each rank normalises its own tokens,
    fc1 all-gathers them (quantized where the recipe allows) and fc2
    reduce-scatters its output; the norm parameter gradients are summed
    over the group in the backward.  ``init_method`` initialises fc1's
    weight, ``output_layer_init_method`` fc2's (default: as ``te.Linear``).
    ``forward(inp, is_first_microbatch=None)``: weight caching for both
    GEMMs, as ``te.Linear``'s.  ``fuse_wgrad_accumulation``: the weight
    gradients are added to ``fc1_weight.main_grad`` / ``fc2_weight.main_grad``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method=None, output_layer_init_method=None, tp_group=None,
                 tp_size: int = 1, set_parallel_mode: bool = False,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 name: Optional[str] = None):
        super().__init__()
        for arg, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{_OWNER}: {arg} must be a positive int, got {value!r}")
        check_norm_config(_OWNER, normalization, eps)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{_OWNER}: activation must be one of {tuple(ACTIVATIONS)}, "
                             f"got {activation!r}")
        if sequence_parallel and not set_parallel_mode:
            raise ValueError(f"{_OWNER}: sequence_parallel=True needs set_parallel_mode=True "
                             "(fc1 column-parallel, fc2 row-parallel)")
        modes = ("column", "row") if set_parallel_mode else (None, None)
        _, self.tp_group, self.tp_size = _parallel_config(modes[0], tp_group, tp_size,
                                                          sequence_parallel, _OWNER)
        if ffn_hidden_size % self.tp_size != 0:
            raise ValueError(f"{_OWNER}: set_parallel_mode splits ffn_hidden_size "
                             f"({ffn_hidden_size}) over tp_size {self.tp_size}, which must "
                             "divide it")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if not params_dtype.is_floating_point or params_dtype.itemsize < 2:
            raise TypeError(f"{_OWNER}: params_dtype must be float32, bfloat16 or float16, "
                            f"got {params_dtype}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = float(eps), normalization, activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.set_parallel_mode = bool(set_parallel_mode)
        self.sequence_parallel = bool(sequence_parallel)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.name = name
        self.init_method, self.output_layer_init_method = init_method, output_layer_init_method
        ffn_local = ffn_hidden_size // self.tp_size
        fc1_out = (2 if activation in GATED else 1) * ffn_local
        self._gemms = (
            _Gemm("fc1_", modes[0], hidden_size, fc1_out,
                  f"{_OWNER} fc1 ({hidden_size} -> {fc1_out * self.tp_size})"),
            _Gemm("fc2_", modes[1], ffn_local, hidden_size,
                  f"{_OWNER} fc2 ({ffn_hidden_size} -> {hidden_size})"))
        new = lambda *shape: torch.nn.Parameter(  # noqa: E731
            torch.empty(*shape, dtype=params_dtype, device=device))
        self.layer_norm_weight = new(hidden_size)
        self.layer_norm_bias = new(hidden_size) if normalization == "LayerNorm" else None
        self.fc1_weight = new(fc1_out, hidden_size)
        self.fc1_bias = new(fc1_out) if bias else None
        self.fc2_weight = new(hidden_size, ffn_local)
        self.fc2_bias = new(hidden_size) if bias else None
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel  # as Transformer Engine marks them
        self.reset_parameters()
        self._state_key = register_module(self)  # names it for trace-time buffer allocation

    _native_plan = staticmethod(plan_for_layernorm_mlp)  # module/args_memo.py
    # as te.Linear's: the backward quantizes each weight's columnwise copy
    save_original_weight = False

    def __getstate__(self):
        """Pickles and copies leave the eager-arguments memo behind (it keys
        on this module's parameter objects)."""
        state = super().__getstate__()
        state.pop("_args_memo", None)
        return state

    def __setstate__(self, state):
        """Copies and unpickled modules get their own state key (dynamo/state.py)."""
        super().__setstate__(state)
        self._state_key = register_module(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """gamma = 1 (0 with ``zero_centered_gamma``), beta and the biases 0,
        fc1's weight by ``init_method`` and fc2's by
        ``output_layer_init_method`` (default: ``te.Linear``'s, as
        ``torch.nn.Linear``).  A TP module initialises its own shards."""
        if self.fc1_weight.is_meta:
            return
        reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                              self.zero_centered_gamma)
        init_weight_(self.fc1_weight, self.init_method)
        init_weight_(self.fc2_weight, self.output_layer_init_method)
        for p in (self.fc1_bias, self.fc2_bias):
            if p is not None:
                p.zero_()

    def extra_repr(self) -> str:
        tp = (f", set_parallel_mode=True, tp_size={self.tp_size}, "
              f"sequence_parallel={self.sequence_parallel}" if self.set_parallel_mode else "")
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization!r}, activation={self.activation!r}, "
                f"bias={self.fc1_bias is not None}, dtype={self.fc1_weight.dtype}{tp}")

    # -- state: each GEMM's DelayedScaling buffers (fc1_fp8_..., fc2_fp8_...) ---------------
    def get_extra_state(self) -> torch.Tensor:
        """fc1's then fc2's DelayedScaling state, each packed as
        ``te.Linear.get_extra_state`` packs its own (2 x (4 L + 4) values);
        empty before the module ran under DelayedScaling."""
        parts = [pack_delayed_state(self, delayed_state_names(g.prefix), self.fc1_weight.device)
                 for g in self._gemms]
        if any(p.numel() == 0 for p in parts):
            return parts[0].new_empty(0)
        return torch.cat(parts)

    @torch.no_grad()
    def set_extra_state(self, state) -> None:
        check_extra_state(_OWNER, state, gemms=2)
        for g, part in zip(self._gemms, state.chunk(2) if state.numel() else (state, state)):
            unpack_delayed_state(self, delayed_state_names(g.prefix), part,
                                 self.fc1_weight.device)


    @torch.no_grad()
    def load_full_weights_(self, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None):
        """Copy this rank's shards of the full (single-device) fc1/fc2
        parameters: a TP module then equals the single-device one.  A gated
        fc1's shard holds this rank's rows of both halves."""
        rank = 0 if self.tp_group is None else torch.distributed.get_rank(self.tp_group)
        fc1_mode, fc2_mode = (g.parallel_mode for g in self._gemms)

        def fc1_shard(full, is_bias=False):
            if self.activation in GATED:
                return torch.cat([D.shard_parameter(h, fc1_mode, rank, self.tp_size,
                                                    is_bias=is_bias) for h in full.chunk(2)])
            return D.shard_parameter(full, fc1_mode, rank, self.tp_size, is_bias=is_bias)

        self.fc1_weight.copy_(fc1_shard(fc1_weight))
        self.fc2_weight.copy_(D.shard_parameter(fc2_weight, fc2_mode, rank, self.tp_size))
        if fc1_bias is not None:
            self.fc1_bias.copy_(fc1_shard(fc1_bias, True))
        if fc2_bias is not None:
            self.fc2_bias.copy_(D.shard_parameter(fc2_bias, fc2_mode, rank, self.tp_size,
                                                  is_bias=True))
        return self

    # -- argument building ----------------------------------------------------------------
    def _tp_active(self) -> bool:
        return self.set_parallel_mode and self.tp_size > 1

    def _check_input(self, inp) -> None:
        if not isinstance(inp, torch.Tensor) or isinstance(inp, QuantizedTensorStorage):
            raise TypeError(f"{_OWNER} expects a high-precision torch.Tensor input, "
                            f"got {type(inp).__name__}")
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{_OWNER} input must be float32, bfloat16 or float16, "
                            f"got {inp.dtype}")
        if inp.dim() == 0 or inp.shape[-1] != self.hidden_size:
            raise ValueError(f"{_OWNER}({self.hidden_size}, {self.ffn_hidden_size}): input of "
                             f"shape {tuple(inp.shape)} must end in {self.hidden_size}")
        if self._tp_active() and self.sequence_parallel and inp.dim() < 2:
            raise ValueError(f"{_OWNER}(sequence_parallel=True): the input needs a sequence "
                             f"dimension first, got shape {tuple(inp.shape)}")

    def _gemm_args(self, g: _Gemm, weight, bias, input_rg: bool, grad: bool) -> LinearFwdArgs:
        tp = self._tp_active()
        return LinearFwdArgs(
            inp=None, weight=weight, bias=bias, input_requires_grad=input_rg,
            save_original_weight=self.save_original_weight and any(
                weight is p for p in (self.fc1_weight, self.fc2_weight)),  # not a cast copy
            weight_requires_grad=grad and weight.requires_grad,
            bias_requires_grad=grad and bias is not None and bias.requires_grad,
            parallel_mode=g.parallel_mode if tp else None,
            sequence_parallel=self.sequence_parallel and tp,
            tp_size=self.tp_size if tp else 1, tp_group=self.tp_group if tp else None)

    def _memo_parameters(self) -> tuple:
        return (self.layer_norm_weight, self.layer_norm_bias) + self._params()

    def _memo_key(self, inp, params, recipe, grad, is_first_microbatch, cast):
        """The argument memo's key for this call (as ``te.Linear._memo_key``),
        or None where no memo applies.  ``params``: the layer's fc1/fc2
        weights and biases, or with ``cast`` torch.autocast's casts of them."""
        if (not torch.compiler.is_compiling()
                and (cast or all(map(operator.is_, params, self._params())))
                and type(params[0]) in _PLAIN_TENSORS and type(params[2]) in _PLAIN_TENSORS):
            ln_w, ln_b = self.layer_norm_weight, self.layer_norm_bias
            return (recipe, grad, inp.shape, inp.dtype, type(inp), inp.requires_grad,
                    tuple(None if p is None else (p.dtype, p.requires_grad)
                          for p in (ln_w, ln_b) + params),
                    cast and self.fc1_weight.dtype, self.return_bias,
                    self.return_layernorm_output, self.set_parallel_mode, self.sequence_parallel,
                    self.tp_size, get_amax_reduction_group(), is_first_microbatch,
                    self.normalization, self.eps, self.zero_centered_gamma, self.activation,
                    self.fuse_wgrad_accumulation, self.save_original_weight)
        return None

    def _make_args(self, inp, params, is_first_microbatch, key=None) -> LayerNormMLPFwdArgs:
        """The forward op's arguments; ``params``: fc1/fc2 weights and biases
        as the GEMMs take them (cast under torch.autocast); ``key``: this
        call's memo key (module/args_memo.py), None for none."""
        template = args_memo.template(self, key)
        if template is not None:
            return template.with_tensors(inp, *self._gemm_params(params))
        args = self._checked_args(inp, params, is_first_microbatch)
        if key is not None:
            state = args_memo.bound_buffers(args, "fc1_") + args_memo.bound_buffers(args, "fc2_")
            grads = (args_memo.bound_main_grads(args, "fc1_")
                     + args_memo.bound_main_grads(args, "fc2_"))
            args_memo.remember(self, key, args, _MEMO_TENSORS, state, grads)
        return args

    def _gemm_params(self, params) -> tuple:
        """fc1/fc2 weights and biases as the op takes them: fc2's bias is
        returned, not added, with ``return_bias``."""
        return params[:3] + (None if self.return_bias else params[3],)

    def _checked_args(self, inp, params, is_first_microbatch) -> LayerNormMLPFwdArgs:
        """:meth:`_make_args` without the memo: every check, every field."""
        self._check_input(inp)
        recipe = get_autocast_recipe()
        grad = torch.is_grad_enabled()
        ln_w, ln_b = self.layer_norm_weight, self.layer_norm_bias
        x_rg = grad and inp.requires_grad
        lw_rg = grad and ln_w.requires_grad
        lb_rg = grad and ln_b is not None and ln_b.requires_grad
        fc1_w, fc1_b, fc2_w, fc2_b = params
        fc1_w = check_gathered_weight(_OWNER, fc1_w, recipe, grad)
        fc2_w = check_gathered_weight(_OWNER, fc2_w, recipe, grad)
        fc1 = self._gemm_args(self._gemms[0], fc1_w, fc1_b, x_rg or lw_rg or lb_rg, grad)
        fc2 = self._gemm_args(self._gemms[1], fc2_w, None if self.return_bias else fc2_b,
                              fc1.input_requires_grad or fc1.weight_requires_grad
                              or fc1.bias_requires_grad, grad)
        rows = inp.numel() // self.hidden_size  # rows the GEMMs see (gathered under SP)
        if self._tp_active() and self.sequence_parallel:
            rows = rows * self.tp_size
        layout, binds = (), []
        for g, args in zip(self._gemms, (fc1, fc2)):
            weight = args.weight
            if recipe is not None:
                set_quantizers(args, recipe)
                check_gemm_shapes(g.label, args, rows, g.local_out, g.local_in)
            elif not isinstance(weight, QuantizedTensorStorage) and inp.dtype != weight.dtype:
                raise TypeError(f"{_OWNER}: input dtype {inp.dtype} differs from "
                                f"{g.prefix}weight's {weight.dtype} and no quantization recipe "
                                "is active")
            if self.fuse_wgrad_accumulation and args.weight_requires_grad:
                args.main_grad = main_grad_of(getattr(self, g.prefix + "weight"),
                                              f"{_OWNER}(fuse_wgrad_accumulation=True)",
                                              g.prefix + "weight")
            plan = state_plan(args, recipe, is_first_microbatch)
            if plan is not None:
                more, bind = gemm_state(self, g.prefix, g.label, args, *plan)
                layout, binds = layout + more, binds + [bind]
        if binds:  # both GEMMs' buffers in one call, before any is read
            ensure_buffers(self._state_key, layout, self.fc1_weight.device)
            for bind in binds:
                bind()
        return merge_views(
            LayerNormMLPFwdArgs, {"fc1_": fc1, "fc2_": fc2},
            inp=inp, ln_weight=ln_w, ln_bias=ln_b, eps=self.eps,
            normalization=self.normalization, zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.return_layernorm_output,
            norm_input_requires_grad=x_rg, ln_weight_requires_grad=lw_rg,
            ln_bias_requires_grad=lb_rg, activation=self.activation)

    # -- forward -----------------------------------------------------------------------
    def forward(self, inp, is_first_microbatch: Optional[bool] = None):
        """``fc2(act(fc1(norm(inp))))``: ``out[, fc2_bias][, ln_out]``.

        ``is_first_microbatch``: True quantizes both weights into the
        module's caches, False reuses them, None does neither."""
        is_first_microbatch = first_microbatch_flag(_OWNER, is_first_microbatch)
        call = checkpointing.layer_call(self)  # inside activation checkpointing
        if call is None:
            return self._forward_autocast(inp, is_first_microbatch, None)
        with call:  # a recomputation runs under the recipe it repeats
            return self._forward_autocast(inp, is_first_microbatch, call)

    def _params(self) -> tuple:
        return self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias

    def _forward_autocast(self, inp, is_first_microbatch, call):
        ac_dtype = _torch_autocast_dtype(inp)
        if ac_dtype is not None:
            # torch.autocast: the GEMMs in its dtype, as te.Linear (the norm runs
            # in fp32 whatever its parameters' dtype)
            params = tuple(p if p is None or isinstance(p, QuantizedTensorStorage)
                           or p.dtype == ac_dtype else p.to(ac_dtype) for p in self._params())
            with torch.autocast(inp.device.type, enabled=False):
                return self._forward(inp.to(ac_dtype), params, is_first_microbatch, call,
                                     cast=True)
        return self._forward(inp, self._params(), is_first_microbatch, call)

    def _forward(self, inp, params, is_first_microbatch, call=None, cast=False):
        """The one place a call picks its path: eagerly a configuration seen
        before runs its native plan (``args_memo.native_forward``); compiled,
        the custom ops (``mlp_ops.py``) or the eager fallback for what they
        do not model; eager otherwise, the ops' impls.

        ``cast``: ``params`` are torch.autocast's casts of the layer's
        (or the parameters, where no cast was needed)."""
        key = None
        if not torch.compiler.is_compiling():
            key = self._memo_key(inp, params, get_autocast_recipe(), torch.is_grad_enabled(),
                                 is_first_microbatch, cast)
            outputs = args_memo.native_forward(self, key, call, inp, *self._gemm_params(params))
            if outputs is not None:
                return self._finish(outputs, params[3])
        args = self._make_args(inp, params, is_first_microbatch, key)
        if call is not None:
            call.bind(args, GEMMS)
        if torch.compiler.is_compiling():
            reason = args.compile_unsupported_reason()
            if reason is not None:
                return self._eager_fallback(reason, inp, params, is_first_microbatch)
            outputs = LAYERNORM_MLP_OPS(args)
        else:
            outputs = LAYERNORM_MLP_OPS.eager(args)
        return self._finish(outputs, params[3])

    def _finish(self, outputs: dict, fc2_bias):
        """Transformer Engine's order: ``out[, fc2_bias][, ln_out]``."""
        out = (outputs["out"],)
        if self.return_bias:
            out = out + (fc2_bias,)
        if self.return_layernorm_output:
            out = out + (outputs["ln_out"],)
        return out[0] if len(out) == 1 else out

    @torch.compiler.disable
    def _eager_fallback(self, reason, inp, params, is_first_microbatch):
        """Eager run of a configuration the ops do not model (a graph break)."""
        from ...dynamo.fallback import record_fallback

        record_fallback(self, reason)
        return self._forward(inp, params, is_first_microbatch)

    def compile_fallbacks(self) -> tuple:
        """Reasons this module fell back to eager under torch.compile (first seen first)."""
        from ...dynamo.fallback import fallback_reasons

        return fallback_reasons(self)
