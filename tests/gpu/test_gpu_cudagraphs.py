"""CUDA-graph training (torch.compile mode="reduce-overhead") for every
recipe: bit-identical to eager and to default mode, zero cudagraph skips,
flat memory after warm-up.  Skips without CUDA; qa/L0_gpu runs it."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

from test_linear import RECIPES, SHAPES, compare_compiled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _skips():
    return counters["inductor"].get("cudagraph_skips", 0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", RECIPES)
def test_reduce_overhead_equals_eager(name, bias):
    compare_compiled(RECIPES[name], SHAPES["3d"], bias, backend="inductor", device="cuda",
                     mode="reduce-overhead", steps=4)
    assert _skips() == 0


def _train(rec, mode, steps, layers=3, hidden=256, tokens=256):
    """SGD on a stack of te.Linear; returns (losses, final params, memory per step)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[te.Linear(hidden, hidden, params_dtype=torch.bfloat16,
                                            device="cuda") for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return model(x).float().pow(2).mean()

    step = torch.compile(loss_fn, fullgraph=True, mode=mode)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
          for _ in range(4)]
    losses = torch.zeros(steps, device="cuda")
    memory = []
    torch.manual_seed(2)  # NVFP4 stochastic rounding
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        loss = step(xs[i % len(xs)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[i].copy_(loss.detach())
        memory.append(torch.cuda.memory_allocated())
    return losses.cpu(), [p.detach().cpu() for p in model.parameters()], memory


@pytest.mark.parametrize("name", RECIPES)
def test_reduce_overhead_training_200_steps(name):
    rec = RECIPES[name]
    base_losses, base_params, _ = _train(rec, None, 210)
    losses, params, memory = _train(rec, "reduce-overhead", 210)
    assert _skips() == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(losses, base_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, base_params))
    assert len(set(memory[10:])) == 1, "memory grows after warm-up"
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]
