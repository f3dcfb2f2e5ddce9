"""The training patterns users rely on, on CUDA (fast kernels): copies and
checkpoint resume under reduce-overhead, torch.autocast in bf16 and fp16,
a layer applied in two compiled calls before one backward.
Skips without CUDA; qa/L0_gpu runs it."""

import copy
import io

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from test_linear import _reset
from test_training_patterns import _applied_twice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {"bf16": None, "current": recipe.Float8CurrentScaling(),
           "delayed": recipe.DelayedScaling(amax_history_len=4),
           "block": recipe.Float8BlockScaling(), "mxfp8": recipe.MXFP8BlockScaling()}


def _steps(layer, fn, n, start=0, dtype=torch.bfloat16):
    out = []
    for i in range(start, start + n):
        torch.compiler.cudagraph_mark_step_begin()
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(256, 256, device="cuda", generator=g).to(dtype).requires_grad_()
        y = fn(layer, x)
        y.float().square().mean().backward()
        out.append([y.detach().clone(), x.grad.clone()]
                   + [p.grad.clone() for p in layer.parameters()])
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.1 * p.grad
        layer.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    for i, (ra, rb) in enumerate(zip(a, b)):
        for j, (ta, tb) in enumerate(zip(ra, rb)):
            assert torch.equal(ta, tb), f"step {i}, tensor {j} differs"


def _fn(rec):
    def fn(layer, x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x)
    return fn


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_deepcopy_and_resume_under_reduce_overhead(name):
    _reset()
    rec = RECIPES[name]
    torch.manual_seed(0)
    original = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    clone = copy.deepcopy(original)  # before the first run
    ro = torch.compile(_fn(rec), fullgraph=True, mode="reduce-overhead")
    got = _steps(clone, ro, 3)
    _same(got, _steps(original, _fn(rec), 3))
    buf = io.BytesIO()
    torch.save(clone.state_dict(), buf)
    want = _steps(clone, ro, 2, start=3)  # uninterrupted
    buf.seek(0)
    torch.manual_seed(1)
    resumed = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    resumed.load_state_dict(torch.load(buf), strict=True)
    # the resumed layer continues from the checkpoint: replay the same two steps
    _same(_steps(resumed, torch.compile(_fn(rec), fullgraph=True, mode="reduce-overhead"), 2,
                 start=3), want)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_torch_autocast_cuda(name, dtype):
    _reset()
    rec = RECIPES[name]

    def fn(layer, x):
        with torch.autocast("cuda", dtype=dtype), te.autocast(enabled=rec is not None,
                                                              recipe=rec):
            return layer(x)

    def make():
        torch.manual_seed(0)
        return te.Linear(256, 256, params_dtype=torch.float32, device="cuda")

    eager, comp = make(), make()
    got = _steps(comp, torch.compile(fn, fullgraph=True), 2, dtype=torch.float32)
    want = _steps(eager, fn, 2, dtype=torch.float32)
    assert want[0][0].dtype == dtype and want[0][2].dtype == torch.float32
    _same(got, want)
    assert not counters["graph_break"]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
        self.fc2 = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))  # exact under inductor too


@pytest.mark.parametrize("how,mode", [("te", "eager"), ("te", "default"),
                                      ("te", "reduce-overhead"), ("reentrant", "eager")])
@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8", "block"])
def test_te_checkpoint_cuda(name, where, how, mode):
    """te.checkpoint on the fast kernels, eager, compiled and under CUDA
    graphs, and torch's reentrant checkpoint eagerly: gradients and layer
    state equal the eager model without checkpointing, te.autocast outside
    or inside the checkpointed function."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    rec = RECIPES[name]

    def train(checkpointed, mode):
        _reset()
        model = _Block()

        def body(x):
            if where == "inside":
                with te.autocast(recipe=rec):
                    return model(x)
            return model(x)

        def f(_, x):
            if not checkpointed:
                return body(x)
            if how == "reentrant":
                return torch_checkpoint(body, x, use_reentrant=True)
            return te.checkpoint(body, x)
        if mode != "eager":
            f = torch.compile(f, mode=mode, fullgraph=True)
        if where == "outside":
            g = f

            def f(layer, x):
                with te.autocast(recipe=rec):
                    return g(layer, x)
        out = _steps(model, f, 4)
        return out + [[b.clone() for _, b in sorted(model.named_buffers())]]

    ref = train(False, "eager")
    _same(train(True, mode), ref)
    if mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_two_compiled_calls_before_backward_cuda(mode):
    """DelayedScaling and fuse_wgrad_accumulation, two calls of the compiled
    function before one backward (CUDA graphs included): equal to eager."""
    _reset()
    _applied_twice(RECIPES["delayed"], "two_calls", "two_calls", backend="inductor",
                   device="cuda", mode=mode)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
