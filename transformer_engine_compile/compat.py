"""Every difference between supported torch versions lives here.

Supported: torch 2.11 to 2.13 (``register_opaque_type`` with ``typ="value"``),
and 2.14 / 2.15 where the API is renamed ``register_custom_class`` with
``typ="constant"`` and the base class moves to ``torch._custom_class_base``.  On a torch with neither, eager mode keeps working and
:data:`OPAQUE_UNAVAILABLE_REASON` says why compile support is off.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

try:  # torch >= 2.11 (private module in every supported release)
    from torch._library import opaque_object as _opaque_mod
except ImportError:  # pragma: no cover - torch without opaque objects
    _opaque_mod = None

try:  # torch >= 2.14: the base class's new home (the old module warns there)
    from torch._custom_class_base import CustomClassBase as OpaqueBase
except ImportError:
    try:
        from torch._opaque_base import OpaqueBase  # 2.11 requires it for value types
    except ImportError:  # pragma: no cover
        class OpaqueBase:  # type: ignore[no-redef]
            """Stand-in base class on a torch without opaque objects."""


def _find_register():
    """Return ``(register(cls, members), reason)``; reason is None when usable."""
    if _opaque_mod is None:
        return None, f"torch {torch.__version__} has no torch._library.opaque_object"
    member_type = getattr(_opaque_mod, "MemberType", None)
    new = getattr(_opaque_mod, "register_custom_class", None)
    old = getattr(_opaque_mod, "register_opaque_type", None)
    if member_type is None or (new is None and old is None):
        return None, (
            f"torch {torch.__version__} lacks register_opaque_type/register_custom_class "
            "with MemberType"
        )

    def register(cls, members, inlined=()):
        member_map = {m: member_type.USE_REAL for m in members}
        member_map.update({m: member_type.INLINED for m in inlined})
        if new is not None:  # newer torch: renamed, value types are "constant"
            new(cls, typ="constant", members=member_map)
        else:
            old(cls, typ="value", members=member_map)

    return register, None


_REGISTER, OPAQUE_UNAVAILABLE_REASON = _find_register()


def register_value_type(cls, members, inlined=()) -> bool:
    """Register ``cls`` as a value-typed opaque class; False when unsupported.

    ``members`` are read/called on the real object at trace time and baked
    in as constants (USE_REAL); ``inlined`` methods are traced (INLINED), for
    methods that compute on tensors.  torch 2.11 refuses any unlisted member.
    """
    if _REGISTER is None:
        return False
    _REGISTER(cls, members, inlined)
    return True


def opaque_type_name(cls) -> str:
    """Schema type name of a registered opaque class (for ``"<name>? q"``)."""
    if _opaque_mod is None:
        raise RuntimeError(OPAQUE_UNAVAILABLE_REASON)
    getter = getattr(_opaque_mod, "get_opaque_type_name", None)
    if getter is None:  # pragma: no cover - renamed API only
        getter = getattr(_opaque_mod, "get_custom_class_name")
    return getter(cls)


# -- trace-time calls -------------------------------------------------------------------
def run_at_trace_time(fn):
    """Make Dynamo call ``fn`` (constant arguments, constant result) while
    tracing instead of putting it in the graph: ``assume_constant_result``,
    public as ``torch.compiler.assume_constant_result`` on every supported
    torch.  Eager calls run it as usual."""
    return torch.compiler.assume_constant_result(fn)


# -- side effects inside higher-order ops -------------------------------------------------
def unchecked_side_effects(fn, *args):
    """``fn(*args)``; while Dynamo traces the body of a higher-order op
    (``torch.utils.checkpoint``), its writes to outside Python state are
    allowed instead of refused (``_disable_side_effect_safety_checks_for_current_subtracer``,
    private on every supported torch).  Only for writes whose net effect the
    caller undoes inside the same body."""
    return fn(*args) if _ALLOW_SIDE_EFFECTS is None else _ALLOW_SIDE_EFFECTS(fn, *args)


def _find_side_effect_switch():
    import torch._dynamo.utils as dynamo_utils

    return getattr(dynamo_utils, "_disable_side_effect_safety_checks_for_current_subtracer",
                   None)


_ALLOW_SIDE_EFFECTS = _find_side_effect_switch()


# -- torch.utils.checkpoint ---------------------------------------------------------------
def checkpoint_region():
    """``(frame, phase, token)`` when called inside a non-reentrant
    ``torch.utils.checkpoint`` region, else None.

    ``phase`` is ``"forward"`` (the checkpointed forward) or ``"recompute"``
    (its recomputation in the backward); ``frame`` is the region's
    ``_CheckpointFrame`` (one per checkpoint call, alive until its backward
    is done); ``token`` is distinct for each recomputation pass.  torch has
    no public way to ask this: the region is read from the innermost
    saved-tensors hooks, which torch's checkpoint installs around both
    phases (``_checkpoint_hook`` holds the frame, ``_recomputation_hook`` a
    weak reference to it).  None if this torch's hooks look different; the
    tests pin it for every supported version."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = None if top is None else top(False)
    if not hooks:
        return None
    pack = inspect.unwrap(hooks[0])  # 2.13+ wraps the recomputation hook in dynamo.disable
    owner = getattr(pack, "__qualname__", "").split(".", 1)[0]
    if owner not in ("_checkpoint_hook", "_recomputation_hook") or not pack.__closure__:
        return None
    cells = dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in pack.__closure__)))
    if owner == "_checkpoint_hook":
        frame = cells.get("frame")
        return None if frame is None else (frame, "forward", None)
    ref = cells.get("target_frame_ref")
    frame = None if ref is None else ref()
    return None if frame is None else (frame, "recompute", hooks[0])


def _reentrant_checkpoint_codes() -> tuple:
    fn = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    if fn is None:
        return ()
    return (fn.forward.__code__, fn.backward.__code__)


def reentrant_checkpoint_region():
    """``(ctx, phase, token)`` when called inside a reentrant
    ``torch.utils.checkpoint`` (``use_reentrant=True``), else None.

    ``ctx`` is the checkpoint's autograd context (one per checkpoint call,
    alive until its graph is freed); ``phase`` is ``"forward"`` (the first
    run, under ``no_grad``) or ``"recompute"`` (inside its backward);
    ``token`` is distinct for each recomputation pass (the pass's
    detached inputs).  torch has no public way to ask this and installs no
    hooks for it: the region is the nearest ``CheckpointFunction.forward``
    or ``.backward`` frame on the call stack.  The tests pin it for every
    supported version."""
    codes = _reentrant_checkpoint_codes()
    if not codes:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is codes[0] or frame.f_code is codes[1]:
            local = frame.f_locals
            ctx = local.get("ctx")
            if ctx is None:
                return None
            if frame.f_code is codes[0]:
                return ctx, "forward", None
            token = local.get("detached_inputs")
            return None if token is None else (ctx, "recompute", token)
        frame = frame.f_back
    return None


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward on this thread
    (``torch._C._current_graph_task_id``, private on every supported torch)."""
    return torch._C._current_graph_task_id() != -1


# -- the custom ops' autograd kernel ----------------------------------------------------
def library_autograd_kernel(op, backward, setup_context):
    """The Autograd-key kernel ``torch.library.register_autograd`` would
    register for ``op`` (``torch._library.autograd``, private on every
    supported torch), for a caller that wraps it before registering."""
    from torch._library import autograd as library_autograd

    return library_autograd.make_autograd_impl(
        op, library_autograd.Info(backward, setup_context))


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_DK = torch._C.DispatchKey
_PLAIN_KEYS = (_DK.CPU, _DK.CUDA)
_plain_keysets: dict = {}  # DispatchKeySet.raw_repr() -> bool


def below_autograd_is_plain(keyset) -> bool:
    """True when, below the Autograd key, ``keyset`` reaches a CPU or CUDA
    kernel directly: no ``__torch_dispatch__`` (mode or subclass), no
    functionalization, no meta or other wrapper keys.  An op's Autograd
    kernel may then call its backend impl itself instead of redispatching
    (one Python<->C++ crossing less); anything else must redispatch."""
    raw = keyset.raw_repr()
    plain = _plain_keysets.get(raw)
    if plain is None:
        below = (keyset & _AFTER_AUTOGRAD).remove(_DK.ADInplaceOrView)
        plain = _plain_keysets[raw] = below.highestPriorityTypeId() in _PLAIN_KEYS
    return plain


# -- state read by a compiled backward ----------------------------------------------------
_NO_VC_CHECK_KEY = "saved_tensor_with_no_vc_check"
_no_vc_check_support = None  # None: not looked up yet


def saved_without_version_check_supported() -> bool:
    """True when AOTAutograd can save a forward value for the backward
    without ``save_for_backward``'s version check (its runtime keeps a
    separate slice of such tensors: ``ViewAndMutationMeta.
    num_tensors_saved_with_no_vc_check``, filled by the partitioner from
    the joint graph's node meta; private on every supported torch)."""
    global _no_vc_check_support
    if _no_vc_check_support is None:
        import dataclasses

        try:
            from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta
            from torch.fx.experimental.proxy_tensor import _get_proxies  # noqa: F401
        except ImportError:  # pragma: no cover - layout of another torch
            _no_vc_check_support = False
        else:
            _no_vc_check_support = "num_tensors_saved_with_no_vc_check" in {
                f.name for f in dataclasses.fields(ViewAndMutationMeta)}
    return _no_vc_check_support


def save_without_version_check(tensors) -> None:
    """While AOTAutograd traces a joint graph, mark the graph nodes of
    ``tensors`` so that, if the backward needs them, the compiled forward
    hands them over without a version check: what eager autograd does for
    a tensor an ``autograd.Function`` keeps on ``ctx`` instead of
    ``save_for_backward``.  torch sets this node meta itself for such
    tensors of a Dynamo-traced ``autograd.Function`` (``AutogradFunctionApply``
    in ``torch/_functorch/autograd_function.py``); a custom op's autograd
    formula has no such path.  Outside a proxy trace (eager, Dynamo's fake
    run) it does nothing."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None:
        return
    if not saved_without_version_check_supported():
        return
    from torch.fx.experimental.proxy_tensor import _get_proxies

    for t in tensors:
        if isinstance(t, torch.Tensor):
            for proxy in _get_proxies(t):
                proxy.node.meta[_NO_VC_CHECK_KEY] = True


# -- torch.export ------------------------------------------------------------------------
def export_keeps_opaque_constants() -> bool:
    """True when a program whose opaque objects are lifted constants
    (``dynamo/export.py``) still unlifts (``ep.module()``) and saves: torch
    2.13 and 2.15 pickle them into the archive.  torch 2.11's unlift assigns
    only tensors and script objects and its archive writer refuses other
    constants ("Unsupported constant type"); 2.12 is untested, so off."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


# -- torch.distributed ----------------------------------------------------------------
def all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Gather ``x`` from every rank into ``out`` along dim 0 (rank order).

    torch 2.13 renames ``all_gather_into_tensor`` to ``all_gather_single``
    (the old name warns); 2.11 has only the old one."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Sum ``x`` over ranks and keep this rank's dim-0 chunk in ``out``
    (``reduce_scatter_tensor`` before torch 2.13)."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (``mesh`` itself if none):
    ``DeviceMesh._get_root_mesh`` (private, torch 2.11-2.15), else the mesh
    resources' ``get_root_mesh`` of older releases."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources
    return _mesh_resources.get_root_mesh(mesh)


def local_shape_and_offset(global_shape, mesh, placements) -> tuple:
    """(local shape, global offset) of this rank's piece of a DTensor
    (``torch.distributed.tensor._utils``, private)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def inductor_fallback(op) -> None:
    """Give ``op`` now the lowering inductor makes itself for a custom op it
    cannot lower (a fallback kernel with the op's layout constraint).  An op
    with a decomposition (dynamo/lowering.py) needs it for the calls whose
    decomposition declines: inductor refuses to make a fallback for an op
    in its decomposition table on its own."""
    from torch._inductor import lowering as inductor_lowering
    if op in inductor_lowering.lowerings:
        return
    try:
        from torch._library.utils import get_layout_constraint_tag
        constraint = inductor_lowering.tag_to_layout_constraint(
            get_layout_constraint_tag(op, with_default=True))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - older internals
        constraint = None
    inductor_lowering.make_fallback(op, layout_constraint=constraint, warn=False,
                                    override_decomp=True)


def functionalized(fn):
    """``fn`` run under the Python functionalization AOTAutograd itself uses
    (``torch.func.functionalize``'s wrappers do not mix with the fake mode
    of a trace in progress)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    return dispatch_functionalize(fn, FunctionalTensorMode())


def fixed_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` through inductor's ``inductor_force_stride_order`` with its own
    strides (a no-op on values), so inductor realizes a fused producer's
    result once, in one buffer, for every Triton kernel of a lowered call
    that reads it.  Inductor fixes the layout of each user-kernel argument
    separately, and an argument that is still a fusable expression then
    becomes a copy of its own: with x or dy passed to an amax and a cast
    kernel, the producer stored it up to five times (docs/custom_ops.md).
    ``t`` itself where it is a graph input (realized already) and on a
    torch without the prim."""
    op = _force_stride_order()
    return t if op is None or _traced_graph_input(t) else op(t, t.stride())


def _traced_graph_input(t) -> bool:
    """Whether ``t``, in the make_fx trace in progress (AOT's, seen through
    its functionalization), is a placeholder of the graph."""
    traced = traced_node(t)
    return traced is not None and traced[1].op == "placeholder"


def traced_node(t):
    """``(tracer, node)``: the graph node of ``t`` in the make_fx trace in
    progress (AOT's, seen through its functionalization), else None."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental import proxy_tensor
    try:
        mode = proxy_tensor.get_proxy_mode()
        if mode is None:
            return None
        inner = torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t
        slot = proxy_tensor.get_proxy_slot(inner, mode.tracer, None)
    except (AttributeError, TypeError):  # another torch's internals
        return None
    node = getattr(getattr(slot, "proxy", None), "node", None)
    return None if node is None else (mode.tracer, node)


def unfixed_node(node):
    """``node`` seen through a :func:`fixed_layout`: the node it fixes."""
    op = _force_stride_order()
    while op is not None and node.target is op:
        node = node.args[0]
    return node


def plain_of_functional(t: torch.Tensor) -> torch.Tensor:
    """The traced value a FunctionalTensor of the session in progress holds
    now (its writes applied)."""
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def functional_of_plain(t: torch.Tensor) -> torch.Tensor:
    """A traced value from outside the functionalization session in
    progress, wrapped into it (as the session wraps its inputs)."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    return FunctionalTensor.to_functional(t)


@functools.lru_cache(maxsize=None)
def _force_stride_order():
    try:
        from torch._inductor import inductor_prims  # noqa: F401 - registers the prims
    except ImportError:  # pragma: no cover - a torch without inductor
        return None
    packet = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return None if packet is None else packet.default


def triton_access_analysis():
    """``(module, name)`` of torch's analysis of which arguments a user
    Triton kernel accesses: ``identify_accessed_tensors`` (torch 2.13 on,
    returns reads and writes) or ``identify_mutated_tensors`` (torch 2.11,
    returns the written names); both take ``(kernel, kwargs,
    tma_descriptor_metadata)``.  None where neither exists."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as module
    except ImportError:  # pragma: no cover - a torch without it
        return None
    for name in ("identify_accessed_tensors", "identify_mutated_tensors"):
        if callable(getattr(module, name, None)):
            return module, name
    return None  # pragma: no cover - another torch's internals


def compiling_for_cuda_graphs() -> bool:
    """Whether the inductor compile in progress records CUDA graphs
    (``mode="reduce-overhead"`` patches this config for its compile)."""
    from torch._inductor import config
    return bool(config.triton.cudagraphs)


# -- FSDP2 internals ---------------------------------------------------------------------
def fsdp_gathers_again_for_backward(unit) -> bool:
    """Whether FSDP2 is gathering the parameters of the unit ``unit`` (a
    module given to ``fully_shard``) for its forward pass and will free them
    after it and gather them again before their backward
    (``reshard_after_forward``; not the root, which keeps them).  False
    wherever that cannot be told: the caller then assumes the gathered
    parameters live on into the backward.  Reads FSDP2's private state
    (``_get_fsdp_state``, the parameter group's training state and
    post-forward mesh; read on torch 2.11 and 2.13); a torch without them
    gets False."""
    if unit is None or in_backward_pass():  # a recomputation inside the backward keeps them
        return False
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        group = unit._get_fsdp_state()._fsdp_param_group
        return (group is not None and group._training_state == TrainingState.FORWARD
                and group.post_forward_mesh_info is not None)
    except (AttributeError, ImportError):
        return False


def compile_cache_config():
    """``torch.compiler.config`` where it has ``cache_key_tag`` (a string in
    every on-disk compile cache key), else None."""
    config = getattr(torch.compiler, "config", None)
    return config if hasattr(config, "cache_key_tag") else None
