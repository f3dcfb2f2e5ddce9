"""``te.GroupedExperts``: a mixture of experts' SwiGLU experts (gate and up
projections, activation, down projection) as two grouped GEMMs, over tokens
a router sent to ``top_k`` experts each.

Its call is Hugging Face's experts interface, ``experts(hidden_states,
top_k_index, top_k_weights)``, and its parameters Hugging Face's stacked
layout and names: ``gate_up_proj`` ``(num_experts, 2 * ffn, hidden)`` (gate
rows first, then up) and ``down_proj`` ``(num_experts, hidden, ffn)``, so
``te.convert`` swaps a model's experts for it keeping their parameters, and
its state dict loads into the model it came from.

The step, torchtitan's pattern, without a host synchronisation:
permute the (token, slot) pairs by expert (a stable sort), count each
expert's rows on the device (``histc``), run gate/up, the activation of
the gate times up, and down as grouped GEMMs (:func:`~.layer.grouped_linear`),
scale by the routing weights, and unpermute back to each token's ``top_k``
slots, summed in slot order.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ...dynamo.state import register_module
from ..extra_state import LoadsWithoutExtraState
from ..linear.setup import first_microbatch_flag
from .layer import fused_main_grad, grouped_linear, init_experts_
from .state import bind_delayed_state, get_grouped_extra_state, set_grouped_extra_state
from .weight_cache import weight_cache

__all__ = ["GroupedExperts", "permute", "tokens_per_expert", "unpermute"]


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert (int32, on the device) of routed expert ids:
    ``histc`` rather than ``bincount``, which reads its maximum on the host
    (CPU ``histc`` takes floats, CUDA's integers)."""
    ids = expert_ids.float() if expert_ids.device.type == "cpu" else expert_ids.int()
    return torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1).to(torch.int32)


def permute(hidden_states: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> tuple:
    """``(rows, perm, counts)``: each token's row once per slot, grouped by
    expert (a stable sort), the permutation, and each expert's row count."""
    ids_sorted, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    rows = hidden_states[perm // top_k_index.shape[-1]]
    return rows, perm, tokens_per_expert(ids_sorted, num_experts)


def unpermute(y: torch.Tensor, perm: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The expert outputs ``y`` (rows in :func:`permute`'s order) scaled by
    the routing weights and summed per token over its slots, in slot order:
    every slot is written once (``index_copy``, no scatter-add)."""
    tokens, top_k = top_k_weights.shape
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    return torch.empty_like(y).index_copy(0, perm, y).view(tokens, top_k, -1).sum(dim=1)


class GroupedExperts(LoadsWithoutExtraState, torch.nn.Module):
    # as te.GroupedLinear's: the backward quantizes the saved weights again
    save_original_weight = False

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 activation: Optional[Callable] = None, params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None, init_method=None,
                 fuse_wgrad_accumulation: bool = False):
        super().__init__()
        # te.GroupedLinear's: both weights' gradients are added into their
        # main_grad (gate_up_proj.main_grad, down_proj.main_grad)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.num_experts, self.hidden_size, self.ffn_hidden_size = (num_experts, hidden_size,
                                                                    ffn_hidden_size)
        self.act_fn = activation if activation is not None else torch.nn.functional.silu
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(
            num_experts, 2 * ffn_hidden_size, hidden_size, dtype=dtype, device=device))
        self.down_proj = torch.nn.Parameter(torch.empty(
            num_experts, hidden_size, ffn_hidden_size, dtype=dtype, device=device))
        self.init_method = init_method
        self._state_key = register_module(self)  # names it for trace-time buffer allocation
        self.reset_parameters()

    def __setstate__(self, state):
        """Copies and unpickled modules get their own state key (dynamo/state.py)."""
        super().__setstate__(state)
        self._state_key = register_module(self)

    def _gemms(self) -> tuple:
        return (("gate_up_", self.num_experts), ("down_", self.num_experts))

    def get_extra_state(self) -> torch.Tensor:
        """The DelayedScaling state of both grouped GEMMs (gate/up, then
        down), packed as ``te.GroupedLinear.get_extra_state`` packs one."""
        return get_grouped_extra_state(self, self._gemms(), self.gate_up_proj.device)

    def set_extra_state(self, state) -> None:
        set_grouped_extra_state(self, "te.GroupedExperts", self._gemms(), state,
                                self.gate_up_proj.device)


    def reset_parameters(self) -> None:
        if self.gate_up_proj.is_meta:
            return
        init_experts_(self.gate_up_proj, self.down_proj, init_method=self.init_method)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, is_first_microbatch: Optional[bool] = None
                ) -> torch.Tensor:
        """Hugging Face's experts call.  ``is_first_microbatch``: FP8 weight
        caching across gradient-accumulation microbatches for both grouped
        GEMMs, as ``te.GroupedLinear.forward`` takes it (buffers
        ``gate_up_fp8_weight_*`` and ``down_fp8_weight_*``).  Under
        ``fuse_wgrad_accumulation`` both weights' gradients go into their
        ``main_grad`` instead of ``.grad``."""
        first = first_microbatch_flag("te.GroupedExperts", is_first_microbatch)
        caches = [((), None)] * 2
        if first is not None:
            caches = [weight_cache(self, prefix, w, first, "te.GroupedExperts")
                      for (prefix, _), w in zip(self._gemms(), (self.gate_up_proj, self.down_proj))]
        # every buffer allocated before any is read (dynamo/state.py)
        gate_up_state, down_state = bind_delayed_state(
            self, self._gemms(), self.gate_up_proj.device, caches[0][0] + caches[1][0])
        gate_up_cache, down_cache = (None if bind is None else {**bind(), "cache_weight": first}
                                     for _, bind in caches)
        gate_up_main, down_main = (
            fused_main_grad(self.fuse_wgrad_accumulation, w, "te.GroupedExperts", name)
            for name, w in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)))
        x, perm, counts = permute(hidden_states, top_k_index, self.num_experts)
        keep = self.save_original_weight
        gate, up = grouped_linear(x, self.gate_up_proj, None, counts, delayed_state=gate_up_state,
                                  save_original_weight=keep, weight_cache=gate_up_cache,
                                  main_grad=gate_up_main).chunk(2, dim=-1)
        y = grouped_linear(self.act_fn(gate) * up, self.down_proj, None, counts,
                           delayed_state=down_state, save_original_weight=keep,
                           weight_cache=down_cache, main_grad=down_main)
        return unpermute(y, perm, top_k_weights).to(hidden_states.dtype)
