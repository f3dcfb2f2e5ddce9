"""``te.convert``: swap the ``torch.nn.Linear`` layers of an existing model
for ``te.Linear``, in place, keeping their parameters."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from . import recipe as R
from .module.linear.layer import Linear
from .quantization import factory

log = logging.getLogger(__name__)


def shape_limits(in_features: int, out_features: int, recipes=None) -> dict:
    """Per recipe (``{name: recipe}``, default every recipe by its short
    name), why a ``te.Linear(in_features -> out_features)`` cannot run under
    it (the feature sizes its formats need), or None when it can.  Token
    counts are not checked here."""
    if recipes is None:
        recipes = {n: R.by_name(n) for n in R.RECIPE_NAMES if n != "bf16"}
    out = {}
    for name, rec in recipes.items():
        reason = None
        # (role, feature size as the matrix's columns, as its rows; None: tokens)
        for role, cols, rows in (("weight", "in_features", "out_features"),
                                 ("input", "in_features", None),
                                 ("grad_output", "out_features", None)):
            q = factory.quantizer_for(rec, role, internal=True).usage_variant(True, True)
            k_mult, m_mult, label = q.divisibility()
            sizes = {"in_features": in_features, "out_features": out_features}
            if sizes[cols] % k_mult:
                reason = f"{label} needs {cols} divisible by {k_mult}"
            elif rows is not None and sizes[rows] % m_mult:
                reason = f"{label} needs {rows} divisible by {m_mult}"
            if reason is not None:
                break
        out[name] = reason
    return out


def _new_linear(old: torch.nn.Linear, fqn: str, params_dtype) -> Linear:
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                 params_dtype=old.weight.dtype, device="meta", name=fqn)
    for pname in ("weight", "bias"):
        p = getattr(old, pname)
        if p is None:
            continue
        if params_dtype is not None and p.dtype != params_dtype:
            p = torch.nn.Parameter(p.detach().to(params_dtype), requires_grad=p.requires_grad)
        setattr(new, pname, p)  # the same Parameter: optimizers and tied weights keep it
    new.train(old.training)
    return new


def convert(model: torch.nn.Module,
            module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None,
            params_dtype: Optional[torch.dtype] = None,
            recipe: Optional[R.Recipe] = None) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` of ``model`` that
    ``module_filter_fn(module, fqn)`` accepts (all when None) by a
    ``te.Linear`` holding the same parameters (cast to ``params_dtype`` when
    given, else the same Parameter objects, so tied weights stay tied and an
    optimizer built before still updates them).  In place; returns the model
    (the new layer when ``model`` itself is a ``torch.nn.Linear``).

    Skipped, with the reason logged (logger ``transformer_engine_compile.convert``,
    WARNING): subclasses of ``torch.nn.Linear`` (their forward, or a parent
    reading their weight directly as ``torch.nn.MultiheadAttention`` does,
    would not go through ``te.Linear``) and layers whose feature sizes no
    recipe can take, or, with ``recipe`` given, that this recipe cannot
    take (so training under it needs no other filter).  A layer that some
    recipes cannot take is converted and those are named (INFO).  Without a
    recipe the converted layer runs the same GEMM as ``torch.nn.Linear``.
    """
    if recipe is not None and not isinstance(recipe, R.Recipe):
        raise TypeError(f"te.convert: recipe must be a transformer_engine_compile.recipe.Recipe, "
                        f"got {type(recipe).__name__}")
    if params_dtype is not None and (not params_dtype.is_floating_point
                                     or params_dtype.itemsize < 2):
        raise TypeError(f"te.convert: params_dtype must be float32, bfloat16 or float16, "
                        f"got {params_dtype}")
    new_of: dict = {}  # id(old layer) -> te.Linear (a layer reached by two paths: one copy)
    skipped, converted = {}, []

    def replacement(module, fqn):
        if id(module) in new_of:
            return new_of[id(module)]
        new = None
        if module_filter_fn is None or module_filter_fn(module, fqn):
            if type(module) is not torch.nn.Linear:
                skipped[fqn] = (f"{type(module).__name__} subclasses torch.nn.Linear; only "
                                f"torch.nn.Linear itself is converted")
            else:
                limits = shape_limits(module.in_features, module.out_features,
                                      None if recipe is None else {type(recipe).__name__: recipe})
                if all(v is not None for v in limits.values()):
                    whom = "no recipe takes" if recipe is None else "the recipe does not take"
                    skipped[fqn] = (f"{module.in_features} -> {module.out_features}: {whom} "
                                    f"these sizes ({'; '.join(limits.values())})")
                else:
                    new = _new_linear(module, fqn, params_dtype)
                    converted.append(fqn)
                    bad = {n: r for n, r in limits.items() if r is not None}
                    if bad:
                        log.info("te.convert: %s runs under every recipe but %s", fqn,
                                 ", ".join(f"{n} ({r})" for n, r in bad.items()))
        new_of[id(module)] = new
        return new

    if isinstance(model, torch.nn.Linear):
        new = replacement(model, "")
        _log(converted, skipped)
        return model if new is None else new
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):  # duplicates included
            if isinstance(child, torch.nn.Linear):
                fqn = f"{parent_name}.{name}" if parent_name else name
                new = replacement(child, fqn)
                if new is not None:
                    setattr(parent, name, new)
    _log(converted, skipped)
    return model


def _log(converted, skipped) -> None:
    log.info("te.convert: %d torch.nn.Linear layer(s) converted to te.Linear", len(converted))
    for fqn, reason in skipped.items():
        log.warning("te.convert: kept %s as it is: %s", fqn or "the model", reason)
