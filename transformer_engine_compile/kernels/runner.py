"""Kernels compiled at run time (CuTeDSL) as one opaque custom op.

Dynamo cannot trace a DSL's JIT, so such a kernel runs inside the custom op
``te_compile::run_kernel(Tensor[] inputs, KernelConfig config) -> Tensor[]``:

* :class:`KernelConfig` names the kernel family (``kind``) and its
  configuration (dtypes, tile shapes, layouts) as plain values.  It is a
  value-opaque object: equal configurations are one compile-time constant
  (no recompilation), ``__fx_repr__`` rebuilds it from its values (the FX
  graph cache is keyed by them), and no integer id points into a
  process-wide table, so copies of a model, two models in one process and
  compile caches cannot confuse runners;
* a :class:`RunnerKind` (one small class per kernel family) says how to
  build the runner for a configuration (:meth:`RunnerKind.build`, where the
  DSL is imported and the kernel compiled) and the shapes of its outputs
  (:meth:`RunnerKind.fake`, which never touches the DSL);
* :func:`runner_for` builds a configuration's runner once and keeps it,
  keyed by the configuration's value; never while a CUDA graph is being
  captured (compile before capture: a warm-up step does it).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import compat

NAMESPACE = "te_compile"
_SIMPLE = (type(None), bool, int, float, str)


class KernelConfig(compat.OpaqueBase):
    """A kernel family's name and its configuration: ``items`` is a sorted
    tuple of ``(name, value)`` with None/bool/int/float/str values (or
    tuples of them).  Build with :meth:`make`."""

    def __init__(self, kind: str, items: tuple):
        self.kind = kind
        self.items = items

    @classmethod
    def make(cls, kind: str, **values) -> "KernelConfig":
        for name, value in values.items():
            if not _simple(value):
                raise TypeError(f"KernelConfig({kind!r}): {name}={value!r} is not a plain "
                                "value (None, bool, int, float, str or a tuple of them)")
        return cls(kind, tuple(sorted(values.items())))

    def as_dict(self) -> dict:
        return dict(self.items)

    def __eq__(self, other):
        return type(other) is KernelConfig and (self.kind, self.items) == (other.kind, other.items)

    def __hash__(self):
        return hash((self.kind, self.items))

    def __fx_repr__(self):
        return f"KernelConfig({self.kind!r}, {self.items!r})", {"KernelConfig": KernelConfig}

    def __repr__(self):
        return f"KernelConfig({self.kind!r}, {', '.join(f'{k}={v!r}' for k, v in self.items)})"


def _simple(value) -> bool:
    if isinstance(value, tuple):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


CONFIG_REGISTERED = compat.register_value_type(KernelConfig, ("kind", "items", "as_dict"))


class RunnerKind:
    """One kernel family.  Subclasses set ``name`` and implement :meth:`build`
    and :meth:`fake`; :meth:`unavailable` says why it cannot run here."""

    name = ""

    def build(self, config: KernelConfig) -> Callable:
        """The runner for ``config``: ``runner(inputs) -> list of tensors``.
        Imports and compiles the kernel; called once per configuration."""
        raise NotImplementedError

    def fake(self, config: KernelConfig, inputs: list) -> list:
        """Empty outputs of the runner's shapes and dtypes (under fake
        tensors while tracing): never imports or calls the DSL."""
        raise NotImplementedError

    def unavailable(self) -> Optional[str]:
        """Why this family cannot run in this process (a missing package, no
        GPU), or None."""
        return None


class RunnerCache:
    """Kernel families by name and their built runners by configuration.
    The package holds one (:data:`RUNNERS`); runners are keyed by the
    configuration's value, never by an id handed to a model."""

    def __init__(self):
        self.kinds: dict = {}
        self.runners: dict = {}

    def register(self, kind: RunnerKind) -> RunnerKind:
        old = self.kinds.get(kind.name)
        if old is not None and type(old) is not type(kind):
            raise ValueError(f"a kernel family named {kind.name!r} is registered already "
                             f"({type(old).__name__})")
        self.kinds[kind.name] = kind
        return kind

    def kind(self, config: KernelConfig) -> RunnerKind:
        kind = self.kinds.get(config.kind)
        if kind is None:
            raise KeyError(f"no kernel family {config.kind!r}; known: {sorted(self.kinds)}")
        return kind

    def runner_for(self, config: KernelConfig) -> Callable:
        runner = self.runners.get(config)
        if runner is None:
            kind = self.kind(config)
            why = kind.unavailable()
            if why is not None:
                raise RuntimeError(f"{config!r} cannot run here: {why}")
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{config!r}: its kernel would be compiled while a CUDA graph is captured; "
                    "run the step once before capturing (warm-up)")
            runner = self.runners[config] = kind.build(config)
        return runner


RUNNERS = RunnerCache()


def _real(inputs: list, config: KernelConfig) -> list:
    return list(RUNNERS.runner_for(config)(list(inputs)))


def _fake(inputs: list, config: KernelConfig) -> list:
    return list(RUNNERS.kind(config).fake(config, list(inputs)))


def _define():
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(f"run_kernel(Tensor[] inputs, {compat.opaque_type_name(KernelConfig)} config)"
               " -> Tensor[]")
    lib.impl("run_kernel", _real, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::run_kernel", _fake, lib=lib)
    return lib, torch.ops.te_compile.run_kernel.default


# defined at import (a torch without opaque objects has no such op)
_LIB, RUN_KERNEL = _define() if CONFIG_REGISTERED else (None, None)


def run_kernel(config: KernelConfig, inputs: list) -> list:
    """The outputs of ``config``'s kernel on ``inputs``, through the opaque op
    (eager and compiled alike)."""
    if RUN_KERNEL is None:
        raise RuntimeError(f"run_kernel needs opaque objects: {compat.OPAQUE_UNAVAILABLE_REASON}")
    return RUN_KERNEL(list(inputs), config)
