"""``torch.export`` programs that ``torch.export.save`` / ``load`` can store.

The custom ops take value-opaque objects (``SimpleValues``, ``QuantizerSlot``,
quantizers), and ``torch.export.export`` bakes them into the graph as inline
constants.  ``torch.export.save`` writes only the program's lifted constants
(``ExportedProgram.constants``): the serializer names each inline object
``_custom_obj_<n>`` but the archive writer drops it, so the save succeeds and
``torch.export.load`` fails with ``KeyError: '_custom_obj_0'`` (torch 2.13 and
2.15).  That save never pickles or otherwise calls into these objects (only
their ``__fx_repr__``, for a debug log), so it cannot be made to raise instead.

:func:`lift_value_opaque` turns each such object into a lifted custom-object
input (``InputKind.CUSTOM_OBJ``, as torch lifts its reference-type opaque
objects): ``save`` pickles it with the program's constants and ``load``
restores it.  :func:`export` is ``torch.export.export`` followed by it.  A pass that traces
the program again (``run_decompositions``) inlines them again: lift after it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.export.graph_signature import CustomObjArgument, InputKind, InputSpec

from .. import compat
from .buckets import QuantizerSlot, SimpleValues
from ..quantization.opaque import is_value_opaque


_LIFTING = [False]  # inside te.export: its program gets lifted


def _unlifted_text() -> str:
    if compat.export_keeps_opaque_constants():
        return ("te_compile: this torch.export program holds te layers, whose value-opaque "
                "arguments torch.export.save drops (the file then fails to load with "
                "KeyError '_custom_obj_0'): call te.lift_value_opaque(ep) before saving, "
                "or export with te.export(...) instead. The program runs in this process "
                "either way.")
    return (f"te_compile: torch {torch.__version__} cannot save a torch.export program "
            "holding te layers (torch.export.save raises 'Unsupported argument type'; a "
            "saveable program needs torch >= 2.13). The program runs in this process; to "
            "move the model elsewhere, save its state_dict and export it there.")


@compat.run_at_trace_time
def warn_if_unlifted() -> None:
    """Called by each traced op call: while ``torch.export`` traces, a
    program from plain ``torch.export.export`` (not :func:`export`) gets a
    warning at export time, since its save cannot be made to fail (module
    doc).  The flag is read here, at trace time in Python: Dynamo on torch
    2.11 answers ``is_exporting()`` True inside any ``torch.compile``
    (pytorch#176347)."""
    if torch.compiler.is_exporting() and not _LIFTING[0]:
        warnings.warn(_unlifted_text(), UserWarning, stacklevel=3)


@contextlib.contextmanager
def _lifting():
    previous, _LIFTING[0] = _LIFTING[0], True
    try:
        yield
    finally:
        _LIFTING[0] = previous


def _is_ours(value) -> bool:
    return type(value) in (SimpleValues, QuantizerSlot) or is_value_opaque(value)


def _wrap_hops() -> tuple:
    """Higher-order ops whose body receives the trailing operands as its
    inputs (``torch.no_grad()`` / ``torch.autocast`` regions of a forward)."""
    names = ("wrap_with_set_grad_enabled", "wrap_with_autocast")
    return tuple(op for op in (getattr(torch.ops.higher_order, n, None) for n in names)
                 if op is not None)


def _custom_obj(node, value) -> CustomObjArgument:
    arg = CustomObjArgument(name=node.name, class_fqn=compat.opaque_type_name(type(value)))
    node.meta["val"] = arg
    return arg


def _replace_in(gm: torch.fx.GraphModule, node_for) -> None:
    """Replace each value-opaque argument in ``gm`` by ``node_for(value)``,
    threading them into the bodies of the wrap higher-order ops."""
    wraps = _wrap_hops()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in wraps:
            body_at = next((i for i, a in enumerate(node.args)
                            if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
            if body_at is not None:
                _thread_into(gm, node, body_at, node_for)
            continue
        node.args = torch.fx.node.map_aggregate(
            node.args, lambda a: node_for(a) if _is_ours(a) else a)
        node.kwargs = torch.fx.node.map_aggregate(
            node.kwargs, lambda a: node_for(a) if _is_ours(a) else a)
    gm.recompile()


def _thread_into(gm, hop_node, body_at: int, node_for) -> None:
    """Make the body of ``hop_node`` take its value-opaque objects as extra
    trailing inputs, passed by ``hop_node`` from the outer graph."""
    body = getattr(gm, hop_node.args[body_at].target)
    inputs: dict = {}  # value -> placeholder in the body

    def body_input(value):
        node = inputs.get(value)
        if node is None:
            last = [n for n in body.graph.nodes if n.op == "placeholder"]
            anchor = last[-1].next if last else next(iter(body.graph.nodes))
            with body.graph.inserting_before(anchor):
                node = inputs[value] = body.graph.placeholder("te_opaque")
            node.target = node.name  # the body's parameter name
            _custom_obj(node, value)
        return node

    _replace_in(body, body_input)
    if inputs:
        hop_node.args = tuple(hop_node.args) + tuple(node_for(v) for v in inputs)


def _inline_left(ep) -> list[str]:
    """Names of the nodes (in any graph of ``ep``) that still hold a
    value-opaque argument."""
    left = []
    for gm in ep.graph_module.modules():
        for node in gm.graph.nodes if isinstance(gm, torch.fx.GraphModule) else ():
            values = []
            torch.fx.node.map_aggregate((node.args, node.kwargs), values.append)
            if any(_is_ours(v) for v in values):
                left.append(node.name)
    return left


def _require_saveable() -> None:
    """Raise ``NotImplementedError`` on a torch that cannot keep value-opaque
    constants in a saved program (before 2.13)."""
    if not compat.export_keeps_opaque_constants():
        raise NotImplementedError(
            f"te: torch {torch.__version__} cannot save the te layers' value-opaque "
            "arguments (its torch.export archive refuses them; torch.export.save of a plain "
            "torch.export.export program fails at save time): a saveable program needs "
            "torch >= 2.13. The program of torch.export.export runs in this process; to "
            "move a model elsewhere, save its state_dict and export it there")


def lift_value_opaque(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Lift the inline value-opaque arguments of ``ep`` (in place) into
    custom-object inputs with their values in ``ep.constants``, so that
    ``torch.export.save`` stores them.  Equal values share one input.

    Raises ``NotImplementedError`` on a torch that cannot keep such
    constants (``compat.export_keeps_opaque_constants``: before 2.13), or
    when one sits inside a higher-order op
    other than the ``torch.no_grad()`` / ``torch.autocast`` wrappers
    (``torch.cond``, ...): saving that program would lose it."""
    _require_saveable()
    gm = ep.graph_module
    specs = ep.graph_signature.input_specs
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    users = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
    at = users[0] if users else len(specs)
    anchor = placeholders[at] if at < len(placeholders) else nodes[len(placeholders)]
    lifted: dict = {}  # value -> placeholder
    taken = set(ep.constants) | {n.name for n in nodes}

    def lifted_input(value):
        node = lifted.get(value)
        if node is None:
            name = next(f"te_opaque_{i}" for i in range(len(taken) + 1)
                        if f"te_opaque_{i}" not in taken)
            taken.add(name)
            with gm.graph.inserting_before(anchor):
                node = gm.graph.placeholder(name)
            node.target = node.name  # the graph's parameter name and the constant's
            if node.name in ep.constants:
                raise RuntimeError(f"constant {node.name!r} exists already")
            spec = InputSpec(kind=InputKind.CUSTOM_OBJ, arg=_custom_obj(node, value),
                             target=node.name)
            specs.insert(at + len(lifted), spec)
            ep.constants[node.name] = value
            lifted[value] = node
        return node

    _replace_in(gm, lifted_input)
    left = _inline_left(ep)
    if left:
        raise NotImplementedError(
            "te: cannot make this program saveable: te layers called inside a higher-order "
            "op other than a torch.no_grad() / torch.autocast region (torch.cond, ...) keep "
            "their value-opaque arguments inline, and torch.export.save drops those "
            "(torch.export.load then fails with KeyError '_custom_obj_<n>'); the program "
            f"runs in this process as exported. Nodes: {', '.join(left)}")
    return ep


def export(module: torch.nn.Module, args: tuple, kwargs: dict | None = None,
           **export_kwargs) -> torch.export.ExportedProgram:
    """``torch.export.export(module, args, kwargs, **export_kwargs)`` whose
    program ``torch.export.save`` can store and ``torch.export.load`` run:
    the te layers' value-opaque arguments are lifted (:func:`lift_value_opaque`)."""
    _require_saveable()
    with _lifting():
        ep = torch.export.export(module, args, kwargs, **export_kwargs)
    return lift_value_opaque(ep)
