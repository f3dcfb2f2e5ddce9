"""The arguments of ``te.GroupedLinear``'s ops: the contract with the op
generator (``dynamo/custom_op.py``), as ``linear/args.py`` is te.Linear's.

The tokens of all experts arrive as one ``(tokens, in_features)`` input,
rows grouped by expert; ``m_offsets`` (int32, one entry per expert) holds
the end row of each group, the layout ``torch._grouped_mm`` takes.  Group
sizes live on the device only, so routing that changes every step needs
no host synchronisation and no recompilation.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...dynamo.buckets import TensorOrQuantized
from ...quantization.base import Quantizer

try:
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed
    ProcessGroup = None


@dataclasses.dataclass
class GroupedLinearFwdArgs:
    inp: torch.Tensor                    # (tokens, in_features), rows grouped by expert
    weight: torch.Tensor                 # (num_gemms, out_features, in_features)
    m_offsets: torch.Tensor              # (num_gemms,) int32: each group's end row
    bias: Optional[torch.Tensor] = None  # (num_gemms, out_features)
    # a recipe's quantizers (none: bf16); each expert quantized as its own te.Linear
    input_quantizer: Optional[Quantizer] = None
    weight_quantizer: Optional[Quantizer] = None
    grad_output_quantizer: Optional[Quantizer] = None
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    # the routing's index tensors, computed in the traced code (one fused
    # kernel under inductor, not host work inside the ops) and shared by the
    # forward and the backward; None: the ops compute them
    group_of_row: Optional[torch.Tensor] = None  # (tokens,) int64: each row's expert
    pad_sources: Optional[torch.Tensor] = None   # (P,) int32: padded layout's source rows, -1 pad
    pad_offsets: Optional[torch.Tensor] = None   # (num_gemms,) int32: its groups' end rows
    # DelayedScaling state (module buffers, ``state.py``), one column per
    # expert and tensor: forward x of experts 0..n-1 then their W, backward dy
    amax_history_fwd: Optional[torch.Tensor] = None  # (L, 2 n), updated by the forward
    scale_fwd: Optional[torch.Tensor] = None         # (2 n,)
    amax_history_bwd: Optional[torch.Tensor] = None  # (L, n), updated by the backward
    scale_bwd: Optional[torch.Tensor] = None         # (n,)
    amax_group: Optional[ProcessGroup] = None        # amaxes all-reduced (max) over it
    # the FP8 GEMMs' fast accumulation (the recipe's fp8_gemm_*)
    fprop_fast_accum: bool = True
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False
    # per-expert FP8 current scaling: the backward gets W itself and quantizes
    # its transposed copy again (te.Linear's save_original_weight)
    save_original_weight: bool = False
    # Transformer Engine's weight caching (``is_first_microbatch``) under
    # per-expert FP8: the layer's buffers for W's FP8 copies and scales,
    # written by the first microbatch's forward (``cache_weight``), read
    # instead of quantizing W by the others
    weight_cache_data: Optional[torch.Tensor] = None        # (num_gemms, out, in) FP8
    weight_cache_transposed: Optional[torch.Tensor] = None  # (num_gemms, in, out) FP8
    weight_cache_scale_inv: Optional[torch.Tensor] = None   # (num_gemms,) fp32
    # FP8 blockwise on the CuTeDSL kernel: W as one (num_gemms * out, in)
    # quantized matrix, both copies (blockwise_gemm.py)
    weight_cache_blockwise: TensorOrQuantized = None
    cache_weight: bool = False
    # fuse_wgrad_accumulation: W's gradient is added into it (a backward
    # update) instead of being returned; (num_gemms, out, in), its dtype
    # the wgrad GEMMs' output dtype
    main_grad: Optional[torch.Tensor] = None


@dataclasses.dataclass
class GroupedLinearBwdArgs:
    grad_output: torch.Tensor                # (tokens, out_features)
    m_offsets: Optional[torch.Tensor] = None
    group_of_row: Optional[torch.Tensor] = None
    pad_sources: Optional[torch.Tensor] = None
    pad_offsets: Optional[torch.Tensor] = None
    inputmat: Optional[torch.Tensor] = None  # x (FP8 under current scaling), for wgrad
    # W (FP8 under current scaling), for dgrad; on the blockwise kernel with a
    # weight cache, the cache's quantized W (its columnwise copy is read)
    weightmat: TensorOrQuantized = None
    input_scale_inv: Optional[torch.Tensor] = None   # (num_gemms,) fp32, the FP8 x's
    weight_scale_inv: Optional[torch.Tensor] = None  # (num_gemms,) fp32, the FP8 W's
    grad_output_quantizer: Optional[Quantizer] = None
    # the block-scaled recipes quantize the saved x and W again (blocked.py);
    # per-expert FP8 the saved W, with save_original_weight
    input_quantizer: Optional[Quantizer] = None
    weight_quantizer: Optional[Quantizer] = None
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    weight_dtype: torch.dtype = torch.float32
    bias_dtype: Optional[torch.dtype] = None
    amax_history_bwd: Optional[torch.Tensor] = None
    scale_bwd: Optional[torch.Tensor] = None
    amax_group: Optional[ProcessGroup] = None
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False
    main_grad: Optional[torch.Tensor] = None  # receives wgrad by add_ (backward update)
