"""``te.GroupedLinear``: one linear layer per expert of a mixture of experts,
all run as grouped GEMMs.

Transformer Engine's constructor and names, with one difference: the
weights are one stacked parameter ``weight`` of shape ``(num_gemms,
out_features, in_features)`` (and ``bias`` ``(num_gemms, out_features)``)
rather than ``weight0 ... weight{n-1}``.  The grouped GEMMs
(``torch._grouped_mm``, and ``torch._scaled_grouped_mm`` for FP8) take the
experts' weights as one 3-D tensor: per-expert parameters would be stacked
into a new tensor at every forward, a copy of every expert weight per step,
and FSDP2 then shards the stacked parameter by experts.  ``weight_i(i)``
reads expert ``i``'s weight (a view).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

import torch

from ...autocast import get_autocast_recipe
from ...dynamo.state import register_module
from ...quantization import factory
from ..extra_state import LoadsWithoutExtraState
from ..linear.setup import (_torch_autocast_dtype, first_microbatch_flag, init_weight_,
                            main_grad_of)
from . import fp8_gemm
from .args import GroupedLinearFwdArgs
from .compute import tensorwise_fp8, group_ids
from .ops import GROUPED_LINEAR_OPS
from .padding import padded_sources
from .state import bind_delayed_state, get_grouped_extra_state, set_grouped_extra_state
from .weight_cache import weight_cache

__all__ = ["GroupedLinear"]

class GroupedLinear(LoadsWithoutExtraState, torch.nn.Module):
    """``y_g = x_g W_g^T + b_g`` for each group ``g`` of rows of ``x``.

    ``forward(inp, m_splits)``: ``inp`` is ``(tokens, in_features)`` (or
    ``(..., in_features)``, flattened) with the rows of expert 0 first, then
    expert 1's, and so on; ``m_splits`` the number of rows of each expert,
    either a list of ints (Transformer Engine's form: checked on the host,
    copied to the device every call) or a 1-D integer tensor on the input's
    device (no host synchronisation: the form for CUDA graphs and for
    routing that changes every step under ``torch.compile``, checked on the
    device).  ``m_offsets=`` instead takes each group's end row (int32), the
    layout the grouped GEMM reads.  Experts with no tokens are allowed.

    Recipes: bf16 (no recipe) runs ``torch._grouped_mm``.
    ``Float8CurrentScaling`` quantizes each expert's x, W and dy with its
    own scale and runs FP8 grouped GEMMs on CUDA (``fp8_gemm.py``), the fp32
    GEMMs of the dequantized operands elsewhere (the numerics of a
    ``te.Linear`` per expert on its reference path).  The block-scaled
    recipes quantize each expert as its own ``te.Linear`` would and run the
    GEMMs on the dequantized values (``blocked.py``).  ``DelayedScaling``
    keeps an amax history per expert and tensor (``state.py``, saved in
    ``_extra_state``) and runs the FP8 GEMMs of current scaling.

    ``save_original_weight`` (attribute, default False; set by
    ``te.fsdp.fully_shard``): under current scaling the backward gets the
    weight itself and quantizes its transposed FP8 copy again, bit for bit
    the forward's, instead of keeping the forward's copy (te.Linear's
    attribute of the same name).

    ``fuse_wgrad_accumulation=True`` (Transformer Engine's, as Megatron-LM
    uses it): the weights' gradient is added into ``weight.main_grad``
    (set by the caller: a tensor of the weight's shape, usually fp32) and
    ``weight.grad`` stays None, so gradient-accumulation microbatches sum
    in ``main_grad``'s dtype.  The wgrad GEMMs give their output in
    ``main_grad``'s dtype where they can (the FP8 blockwise kernel), else
    in bf16, converted before the add.
    """

    save_original_weight = False

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 *, fuse_wgrad_accumulation: bool = False, init_method=None,
                 params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None):
        super().__init__()
        for name, value in (("num_gemms", num_gemms), ("in_features", in_features),
                            ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"te.GroupedLinear: {name} must be a positive int, got {value!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.init_method = init_method
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(num_gemms, out_features, in_features,
                                                     dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(num_gemms, out_features, dtype=dtype,
                                                   device=device)) if bias else None
        self._state_key = register_module(self)  # names it for trace-time buffer allocation
        self.reset_parameters()

    def __setstate__(self, state):
        """Copies and unpickled layers get their own state key (dynamo/state.py)."""
        super().__setstate__(state)
        self._state_key = register_module(self)

    def _gemms(self) -> tuple:
        return (("", self.num_gemms),)

    def get_extra_state(self) -> torch.Tensor:
        """``state_dict()['..._extra_state']``: the DelayedScaling amax
        histories and scales packed into one 1-D fp32 tensor (history fwd
        (L, 2 n), scale fwd (2 n,), history bwd (L, n), scale bwd (n,) for
        ``n = num_gemms``); empty before the layer ran under DelayedScaling."""
        return get_grouped_extra_state(self, self._gemms(), self.weight.device)

    def set_extra_state(self, state) -> None:
        """Restore what :meth:`get_extra_state` saved (buffers of the same
        layout copied into, so CUDA graphs keep their addresses)."""
        set_grouped_extra_state(self, "te.GroupedLinear", self._gemms(), state,
                                self.weight.device)


    def reset_parameters(self) -> None:
        """Each expert's weight as ``te.Linear`` initialises its own; zero bias."""
        if self.weight.is_meta:
            return
        init_experts_(self.weight, init_method=self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def weight_i(self, i: int) -> torch.Tensor:
        """Expert ``i``'s weight, ``(out_features, in_features)`` (a view)."""
        return self.weight[i]

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor, None] = None,
                is_first_microbatch: Optional[bool] = None, *,
                m_offsets: Union[Sequence[int], torch.Tensor, None] = None) -> torch.Tensor:
        """``is_first_microbatch``: Transformer Engine's weight caching across
        gradient-accumulation microbatches.  True quantizes the experts'
        weights and keeps their FP8 copies in the layer (non-persistent
        buffers ``fp8_weight_*``); False reuses them without reading the
        weights' values again (an error if no True call made them); None,
        the default, quantizes at every call.  Under per-expert FP8 (current
        and delayed scaling) and FP8 blockwise on the CuTeDSL kernel
        (``weight_cache.py``); ignored without a recipe, as Transformer
        Engine ignores it without FP8; refused under the other block-scaled
        paths.  Each value is its own graph under ``torch.compile``."""
        first = first_microbatch_flag("te.GroupedLinear", is_first_microbatch)
        cache_layout, bind_cache = (), None
        if first is not None:
            cache_layout, bind_cache = weight_cache(self, "", self.weight, first,
                                                    "te.GroupedLinear")
        # every buffer allocated before any is read (dynamo/state.py)
        state, = bind_delayed_state(self, self._gemms(), self.weight.device, cache_layout)
        cache = None if bind_cache is None else {**bind_cache(), "cache_weight": first}
        main_grad = fused_main_grad(self.fuse_wgrad_accumulation, self.weight,
                                    "te.GroupedLinear", "weight")
        return grouped_linear(inp, self.weight, self.bias, m_splits, m_offsets=m_offsets,
                              delayed_state=state,
                              save_original_weight=self.save_original_weight,
                              weight_cache=cache, main_grad=main_grad)


def fused_main_grad(fused: bool, weight: torch.Tensor, owner: str, what: str):
    """``weight.main_grad`` where its gradient is added there
    (``fuse_wgrad_accumulation``: the weight takes a gradient and autograd
    records), else None; a missing one is a ``RuntimeError``, one shaped
    unlike the weight a ``ValueError``."""
    if not (fused and weight.requires_grad and torch.is_grad_enabled()):
        return None
    main_grad = main_grad_of(weight, f"{owner}(fuse_wgrad_accumulation=True)", what)
    if tuple(main_grad.shape) != tuple(weight.shape):
        raise ValueError(f"{owner}: {what}.main_grad has shape {tuple(main_grad.shape)}, "
                         f"the weight {tuple(weight.shape)}")
    return main_grad


def init_experts_(*stacked: torch.Tensor, init_method=None) -> None:
    """Initialise each expert's slice of stacked ``(experts, out, in)``
    weights as ``te.Linear`` initialises its weight (in place), expert by
    expert: expert 0's slice of each, then expert 1's, ..."""
    with torch.no_grad():
        for slices in zip(*stacked):
            for expert in slices:
                init_weight_(expert, init_method)


def grouped_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   m_splits: Union[Sequence[int], torch.Tensor, None] = None, *,
                   m_offsets: Union[Sequence[int], torch.Tensor, None] = None,
                   delayed_state: Optional[dict] = None,
                   save_original_weight: bool = False,
                   weight_cache: Optional[dict] = None,
                   main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``te.GroupedLinear``'s forward as a function of its parameters
    (``weight`` ``(num_gemms, out, in)``, ``bias`` ``(num_gemms, out)``): for
    modules that hold expert weights under their own names
    (:class:`~.experts.GroupedExperts`).  Under DelayedScaling
    ``delayed_state`` holds the GEMM's amax histories and scales
    (``state.bind_delayed_state``).  ``save_original_weight``: as the
    modules' attribute (:class:`GroupedLinear`); ``weight_cache``: the
    weight cache's op fields, as ``GroupedLinear.forward`` binds them;
    ``main_grad``: where W's gradient is added instead of returned
    (``fuse_wgrad_accumulation``)."""
    groups, out_features, in_features = weight.shape
    if inp.shape[-1] != in_features:
        raise ValueError(f"te.GroupedLinear: the input's last dim is {inp.shape[-1]}, the "
                         f"layer takes in_features={in_features}")
    quantizers = quantizer_fields(get_autocast_recipe(), delayed_state, inp)
    ac_dtype = _torch_autocast_dtype(inp)
    if save_original_weight:
        quantizers["save_original_weight"] = True
    if weight_cache is not None:
        quantizers.update(weight_cache)
    if main_grad is not None:
        quantizers["main_grad"] = main_grad
    if ac_dtype is not None:  # torch.autocast: compute in its dtype, as te.Linear does
        cast = weight.to(ac_dtype)
        if cast is not weight:  # a copy made for this call: keep the smaller FP8 one
            quantizers.pop("save_original_weight", None)
        with torch.autocast(inp.device.type, enabled=False):
            return _grouped_linear(inp.to(ac_dtype), cast,
                                   None if bias is None else bias.to(ac_dtype), m_splits,
                                   m_offsets, quantizers)
    return _grouped_linear(inp, weight, bias, m_splits, m_offsets, quantizers)


def quantizer_fields(recipe, delayed_state, inp) -> dict:
    """The ops' quantizer fields under ``recipe`` (none without one), and
    under DelayedScaling its state fields."""
    if recipe is None:
        return {}
    fields = {f"{role}_quantizer": factory.quantizer_for(recipe, role, internal=True)
              for role in ("input", "weight", "grad_output")}
    fields["fprop_fast_accum"], fields["dgrad_fast_accum"], fields["wgrad_fast_accum"] = \
        recipe.fast_accumulation()
    if recipe.delayed():
        if delayed_state is None:
            raise ValueError("te.GroupedLinear: DelayedScaling keeps amax histories in a "
                             "module: call te.GroupedLinear (or te.GroupedExperts), or pass "
                             "delayed_state=bind_delayed_state(...)")
        fields.update(delayed_state)
    return fields


def _grouped_linear(inp, weight, bias, m_splits, m_offsets, quantizers):
    args = forward_args(inp, weight, bias, m_splits, m_offsets, quantizers)
    if torch.compiler.is_compiling():
        out = GROUPED_LINEAR_OPS(args)["out"]
    else:
        out = GROUPED_LINEAR_OPS.eager(args)["out"]
    return out.reshape(*inp.shape[:-1], weight.shape[1])


def forward_args(inp, weight, bias, m_splits, m_offsets, quantizers) -> GroupedLinearFwdArgs:
    """The forward op's arguments, checked (``quantizers``: what
    :func:`quantizer_fields` returns); ``benchmarks.grouped_host`` calls
    the ops with them too."""
    groups, out_features, in_features = weight.shape
    if inp.dtype != weight.dtype:
        raise TypeError(f"te.GroupedLinear: input dtype {inp.dtype} differs from the "
                        f"weight's {weight.dtype}")
    if inp.is_cuda:
        _check_cuda_operands(inp.dtype, in_features, out_features,
                             fp8="input_quantizer" in quantizers)
    x = inp.reshape(-1, in_features)
    offs = _offsets(groups, m_splits, m_offsets, x.shape[0], x.device)
    grad = torch.is_grad_enabled()
    args = GroupedLinearFwdArgs(
        inp=x, weight=weight, m_offsets=offs, bias=bias,
        input_requires_grad=inp.requires_grad and grad,
        weight_requires_grad=weight.requires_grad and grad,
        bias_requires_grad=bias is not None and bias.requires_grad and grad, **quantizers)
    _route(args)
    return args


def _route(args: GroupedLinearFwdArgs) -> None:
    """The routing's index tensors into ``args``: each row's expert, and
    for per-expert FP8 with a weight gradient the 16-aligned padded layout
    of its wgrad operands.  Computed here, in the traced code, they are a
    few fused kernels under inductor, computed once for the forward and
    the backward op rather than in each."""
    q = args.input_quantizer
    if q is None and args.bias is None:  # bf16 without a bias reads none
        return
    args.group_of_row = group_ids(args.m_offsets, args.inp.shape[0])
    if q is not None and tensorwise_fp8(q) and args.weight_requires_grad:
        args.pad_sources, _, args.pad_offsets = padded_sources(
            args.m_offsets, args.group_of_row, fp8_gemm.ALIGN)


def _check_cuda_operands(dtype: torch.dtype, in_features: int, out_features: int,
                         fp8: bool = False) -> None:
    """What CUDA's grouped GEMMs take, checked before any kernel: bfloat16
    operands, feature sizes multiples of 8 (16-byte bf16 rows) for
    ``torch._grouped_mm`` and of 16 for the FP8 ``torch._scaled_grouped_mm``."""
    if dtype != torch.bfloat16:
        raise TypeError("te.GroupedLinear: on CUDA the grouped GEMM (torch._grouped_mm) "
                        f"takes bfloat16, got {dtype}")
    align, kernel = (16, "FP8 grouped GEMM") if fp8 else (8, "grouped GEMM")
    bad = [f"{name}={n}" for name, n in (("in_features", in_features),
                                         ("out_features", out_features)) if n % align]
    if bad:
        raise ValueError(f"te.GroupedLinear: on CUDA the {kernel} needs feature sizes "
                         f"divisible by {align}, got {', '.join(bad)}")


def _offsets(groups: int, m_splits, m_offsets, tokens: int, device) -> torch.Tensor:
    """Each group's end row (int32, on ``device``), the arguments checked."""
    if (m_splits is None) == (m_offsets is None):
        raise TypeError("te.GroupedLinear: pass exactly one of m_splits and m_offsets")
    given = m_splits if m_offsets is None else m_offsets
    what = "m_splits" if m_offsets is None else "m_offsets"
    if isinstance(given, torch.Tensor):
        if given.dim() != 1 or given.shape[0] != groups:
            raise ValueError(f"te.GroupedLinear: {what} must hold one entry per expert "
                             f"({groups}), got shape {tuple(given.shape)}")
        if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
            raise TypeError(f"te.GroupedLinear: {what} must be an integer tensor, got "
                            f"{given.dtype}")
        if given.device != device:
            raise ValueError(f"te.GroupedLinear: {what} must be on the input's device "
                             f"({device}), got {given.device}")
        if m_offsets is None:
            offs = torch.cumsum(given, 0, dtype=torch.int32)
            ok = (offs[-1] == tokens) & (given >= 0).all()
        else:
            offs = given.to(torch.int32)
            ok = (offs[-1] == tokens) & (offs[0] >= 0) & (offs[1:] >= offs[:-1]).all()
        # checked on the device: no host synchronisation, in graphs too
        # (the message names no size: a traced token count would be specialized)
        torch._assert_async(ok, f"te.GroupedLinear: {what} must be non-negative "
                                f"{'counts summing to' if m_offsets is None else 'non-decreasing end rows ending at'}"
                                " the input's row count")
        return offs
    sizes = list(given)
    if len(sizes) != groups:
        raise ValueError(f"te.GroupedLinear: {what} must hold one entry per expert "
                         f"({groups}), got {len(sizes)}")
    if any(not isinstance(s, int) or isinstance(s, bool) for s in sizes):
        raise TypeError(f"te.GroupedLinear: {what} must hold ints, got {sizes!r}")
    if m_offsets is None:
        if any(s < 0 for s in sizes):
            raise ValueError(f"te.GroupedLinear: m_splits must not be negative, got {sizes}")
        if sum(sizes) != tokens:
            raise ValueError(f"te.GroupedLinear: m_splits sum to {sum(sizes)}, the input "
                             f"has {tokens} rows")
        ends = list(itertools.accumulate(sizes))
    else:
        ends = sizes
        if any(b < a for a, b in zip([0] + ends, ends)) or ends[-1] != tokens:
            raise ValueError(f"te.GroupedLinear: m_offsets must be non-decreasing end rows "
                             f"ending at the input's {tokens} rows, got {sizes}")
    return torch.tensor(ends, dtype=torch.int32, device=device)
