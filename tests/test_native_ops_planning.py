"""The native ops' planning step on CPU (module/linear_native_ops.py): when
a call site's entry gets planned and when a call runs natively.  The
native calls themselves run on CUDA only (tests/gpu/test_gpu_native_ops.py)."""

import torch

from transformer_engine_compile.module import linear_native_ops as lno


class _Plan:
    def __init__(self, slot):
        self.slot = slot

    def slot_for(self, t):
        return self.slot


def _planning(monkeypatch, capturing=False, plan=None):
    planned = []

    def op_plan(args, fake, flat, entry, backward):
        planned.append((args, backward))
        entry.plan = plan

    monkeypatch.setattr(lno, "_capturing", lambda t: capturing)
    monkeypatch.setattr(lno, "_op_plan", op_plan)
    return planned


def test_ready_plans_once_then_returns_plan_and_slot(monkeypatch):
    plan = _Plan(("lo", "hi"))
    planned = _planning(monkeypatch, plan=plan)
    entry, t = lno._Entry(), torch.empty(1)
    for _ in range(2):
        assert lno._ready(entry, lambda: "args", None, [], True, t) == (plan, ("lo", "hi"))
    assert planned == [("args", True)]  # planned at the first ask only


def test_ready_declines_without_a_plan_a_slot_or_during_capture(monkeypatch):
    t = torch.empty(1)
    planned = _planning(monkeypatch, capturing=True, plan=_Plan(("lo", "hi")))
    entry = lno._Entry()
    assert lno._ready(entry, lambda: "args", None, [], False, t) is None
    assert planned == [] and entry.plan is None  # nothing planned while capturing
    _planning(monkeypatch, plan=False)
    assert lno._ready(entry, lambda: "args", None, [], False, t) is None
    assert entry.plan is False  # no plan for this configuration
    entry = lno._Entry()
    entry.plan = _Plan(None)  # a slot the plan cannot use
    assert lno._ready(entry, lambda: "args", None, [], False, t) is None
