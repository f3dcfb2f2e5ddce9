"""``te.convert``: swap the ``torch.nn.Linear`` layers of an existing model
for ``te.Linear``, and its mixture-of-experts experts for
``te.GroupedExperts``, in place, keeping their parameters."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from . import recipe as R
from .module.grouped.experts import GroupedExperts
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


def experts_layout(module: torch.nn.Module) -> Optional[str]:
    """Why ``module``, a Hugging Face experts module (stacked ``gate_up_proj``
    and ``down_proj`` parameters, ``act_fn``), cannot become a
    :class:`~.module.grouped.experts.GroupedExperts`, or None when it can:
    gate rows then up rows, ``(out, in)`` weights, no bias (the layout of
    ``transformers``' Mixtral, Qwen2/3-MoE experts)."""
    for flag, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                       ("is_concatenated", True), ("has_post_expert_norm", False)):
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)} (te.GroupedExperts takes {flag}={want})"
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or \
            gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "(experts, 2 ffn, hidden) and (experts, hidden, ffn)")
    return None


def _is_experts(module: torch.nn.Module) -> bool:
    return (not isinstance(module, GroupedExperts)
            and isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
            and isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)
            and callable(getattr(module, "act_fn", None)))


def _experts_shape_limit(module: torch.nn.Module, recipe) -> Optional[str]:
    """Why ``recipe`` cannot take the experts' GEMMs (each expert quantized
    as a te.Linear of its own), or None."""
    _, ffn2, hidden = module.gate_up_proj.shape
    for what, (n_in, n_out) in (("gate/up", (hidden, ffn2)), ("down", (ffn2 // 2, hidden))):
        reason = shape_limits(n_in, n_out, {type(recipe).__name__: recipe})[type(recipe).__name__]
        if reason is not None:
            return f"the experts' {what} GEMM ({n_in} -> {n_out}): {reason}"
    return None


def _new_experts(old: torch.nn.Module, params_dtype) -> GroupedExperts:
    experts, ffn2, hidden = old.gate_up_proj.shape
    new = GroupedExperts(experts, hidden, ffn2 // 2, activation=old.act_fn,
                         params_dtype=old.gate_up_proj.dtype, device="meta")
    for pname in ("gate_up_proj", "down_proj"):
        p = getattr(old, pname)
        if params_dtype is not None and p.dtype != params_dtype:
            p = torch.nn.Parameter(p.detach().to(params_dtype), requires_grad=p.requires_grad)
        setattr(new, pname, p)
    new.train(old.training)
    return new


def convert(model: torch.nn.Module,
            module_filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None,
            params_dtype: Optional[torch.dtype] = None,
            recipe: Optional[R.Recipe] = None) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` of ``model`` that
    ``module_filter_fn(module, fqn)`` accepts (all when None) by a
    ``te.Linear``, and every Hugging Face experts module (stacked
    ``gate_up_proj`` / ``down_proj``, see :func:`experts_layout`) by a
    ``te.GroupedExperts``, each holding the same parameters (cast to ``params_dtype`` when
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
    Experts whose feature sizes the given recipe cannot take are kept the
    same way (logged).
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

    def experts_replacement(module, fqn):
        if id(module) in new_of:
            return new_of[id(module)]
        new = None
        if module_filter_fn is None or module_filter_fn(module, fqn):
            reason = experts_layout(module)
            if reason is None and recipe is not None:
                reason = _experts_shape_limit(module, recipe)
            if reason is not None:
                skipped[fqn] = reason
            else:
                new = _new_experts(module, params_dtype)
                converted_experts.append(fqn)
        new_of[id(module)] = new
        return new

    converted_experts: list = []
    if isinstance(model, torch.nn.Linear):
        new = replacement(model, "")
        _log(converted, skipped, converted_experts)
        return model if new is None else new
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):  # duplicates included
            fqn = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, torch.nn.Linear):
                new = replacement(child, fqn)
            elif child is not None and _is_experts(child):
                new = experts_replacement(child, fqn)
            else:
                continue
            if new is not None:
                setattr(parent, name, new)
    _log(converted, skipped, converted_experts)
    return model


def _log(converted, skipped, converted_experts=()) -> None:
    log.info("te.convert: %d torch.nn.Linear layer(s) converted to te.Linear", len(converted))
    if converted_experts:
        log.info("te.convert: %d experts module(s) converted to te.GroupedExperts",
                 len(converted_experts))
    for fqn, reason in skipped.items():
        log.warning("te.convert: kept %s as it is: %s", fqn or "the model", reason)
