"""Which recipe is active: ``te.autocast`` and its alias ``te.fp8_autocast``.

State lives in the module-level dict ``_STATE``.  Compiled code that reads
it gets guards (a change of recipe recompiles), and entering the context
manager inside a compiled function traces without a graph break: Dynamo
replays the dict writes as side effects.  (A dict, not class attributes:
torch 2.11's Dynamo cannot trace ``setattr`` on a class.)  Inside a
higher-order op's body (``torch.utils.checkpoint`` under compile) Dynamo
refuses writes to outside state unless told they are safe; entering and
leaving the context restores what it wrote, so both are run through
:func:`~.compat.unchecked_side_effects`.
"""

from __future__ import annotations

import functools

import torch

from .compat import unchecked_side_effects
from .recipe import DelayedScaling, Float8CurrentScaling, Recipe


_STATE = {"enabled": False, "recipe": None, "amax_reduction_group": None}


def default_recipe() -> Recipe:
    """Recipe used by ``autocast(enabled=True)`` without one (compile-friendly)."""
    return Float8CurrentScaling()


class autocast:  # noqa: N801 - mirrors torch.autocast / te.autocast
    """Quantize ``te`` layers under ``recipe`` inside the block; nesting restores.

    ``autocast(enabled=False)`` inside an enabled block turns quantization off
    for the inner block only.
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None,
                 amax_reduction_group=None):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a transformer_engine_compile.recipe.Recipe, "
                            f"got {type(recipe).__name__}")
        self.enabled = bool(enabled)
        self.recipe = recipe if recipe is not None else default_recipe()
        self.amax_reduction_group = amax_reduction_group
        self._saved = None

    def __enter__(self):
        self._saved = current_state()
        _set_state((self.enabled, self.recipe, self.amax_reduction_group))
        return self

    def __exit__(self, exc_type, exc, tb):
        _set_state(self._saved)
        return False

    def __call__(self, fn):
        """Use as a decorator, as ``torch.autocast``: each call of ``fn``
        runs inside a fresh context with this one's settings (so recursion
        and concurrent calls restore correctly)."""
        enabled, recipe, group = self.enabled, self.recipe, self.amax_reduction_group

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group):
                return fn(*args, **kwargs)

        return wrapper


def current_state() -> tuple:
    """(enabled, recipe, amax reduction group): what a checkpointed forward
    records for its recomputation (``checkpointing.py``)."""
    return (_STATE["enabled"], _STATE["recipe"], _STATE["amax_reduction_group"])


def _write_state(state: tuple) -> None:
    _STATE["enabled"], _STATE["recipe"], _STATE["amax_reduction_group"] = state


def _set_state(state: tuple) -> None:
    if torch.compiler.is_compiling():
        unchecked_side_effects(_write_state, state)
    else:
        _write_state(state)


def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None, fp8_group=None):
    """Transformer Engine's older name for :class:`autocast`."""
    return autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group)


def is_autocast_enabled() -> bool:
    return _STATE["enabled"]


def get_autocast_recipe() -> Recipe | None:
    """The active recipe, or None when quantization is off."""
    return _STATE["recipe"] if _STATE["enabled"] else None


def get_amax_reduction_group():
    """The group DelayedScaling all-reduces each step's amaxes over: the one
    given to :class:`autocast`, else, under an initialised process group of
    more than one rank, every rank (``torch.distributed.group.WORLD``, as
    Transformer Engine's ``fp8_group=None``), so data-parallel replicas keep
    identical scales; None when quantization is off, the recipe is not
    DelayedScaling or its ``reduce_amax`` is False (each rank keeps its own)."""
    if not _STATE["enabled"]:
        return None
    recipe = _STATE["recipe"]
    if not isinstance(recipe, DelayedScaling) or not recipe.reduce_amax:
        return None
    group = _STATE["amax_reduction_group"]
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        group = torch.distributed.group.WORLD
    return group
