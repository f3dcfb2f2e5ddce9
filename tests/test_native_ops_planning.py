"""The native ops' planning step on CPU (module/linear/native_ops.py): when
a call site's entry gets planned and when a call runs natively.  The
native calls themselves run on CUDA only (tests/gpu/test_gpu_native_ops.py)."""

import torch

from transformer_engine_compile.module.linear import native_ops as lno


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


def _bf16_bwd_args(bias, x_grad=True, w_grad=True):
    """The backward op's arguments of a bf16 te.Linear call (no recipe)."""
    import transformer_engine_compile as te
    from transformer_engine_compile.module.linear.ops import LINEAR_OPS as ops
    layer = te.Linear(32, 16, bias=bias, params_dtype=torch.bfloat16)
    layer.weight.requires_grad_(w_grad)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=x_grad)
    args = layer._make_args(x, None, False, False)
    with torch.no_grad():
        result = ops.forward(args)
    return ops.make_bwd_args(dict(result.saved), ops.setup_context(args),
                             {"grad_output": torch.randn(8, 16, dtype=torch.bfloat16)}), x, layer


def test_plain_backward_takes_x_and_w_where_the_bias_trains():
    """Without a recipe the native backward takes x and W themselves, and
    only where the bias takes a gradient and both were saved."""
    args, x, layer = _bf16_bwd_args(True)
    saved = lno._saved(args)
    assert saved[0] is args.inputmat and saved[3] is args.weightmat
    assert torch.equal(saved[0], x) and saved[3] is layer.weight
    assert saved[1:3] == [None, None] and saved[4:] == [None, None]
    assert lno._saved(_bf16_bwd_args(False)[0]) is None  # no bias: the short path
    assert lno._saved(_bf16_bwd_args(True, x_grad=False)[0]) is None  # W not saved
    assert lno._saved(_bf16_bwd_args(True, w_grad=False)[0]) is None  # x not saved
    # the key tells plain calls of other dtypes apart
    assert lno._backward_key(args)[5:9] == (None, None, torch.bfloat16, torch.bfloat16)


def test_plain_backward_without_a_bias_gradient_skips_the_native_impl(monkeypatch):
    """linear_ops._native_backward: a bias-free plain backward goes straight
    to the short path; one with a bias gradient asks the native impl first
    and takes the short path where it declines (here: on CPU)."""
    from transformer_engine_compile.module.linear import (ops as linear_ops, plain as
                                                          linear_plain_ops)
    asked = []
    monkeypatch.setattr(lno, "backward", lambda *a: asked.append(a) or None)
    for bias in (False, True):
        args = _bf16_bwd_args(bias)[0]
        out = linear_ops._native_backward(None, None, None, args)
        want = linear_plain_ops.backward(args)
        assert len(out) == len(want) and all(torch.equal(a, b) for a, b in zip(out, want))
        assert len(asked) == int(bias)
