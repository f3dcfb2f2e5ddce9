"""A real model on CUDA: Hugging Face's LlamaForCausalLM after te.convert,
trained as a user trains it (its own loss, AdamW), eager, compiled and
under CUDA graphs.  Skips without CUDA or ``transformers``; qa/L0_gpu runs
it."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from native_steps import native_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")

REC = recipe.Float8CurrentScaling()
LINEARS = 2 * 7 + 1  # q k v o gate up down per layer, and the LM head


def _model():
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg)
    return te.convert(model.to(torch.bfloat16))


def _tokens():
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, 512, (2, 128), device="cuda", generator=g)


def _train(model, fn, steps=3, mark=False):
    """Losses and the last step's gradients of ``steps`` AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, losses = _tokens(), []
    for _ in range(steps):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with te.autocast(recipe=REC):
            loss = fn(tokens)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def test_converted_llama_eager_runs_natively_and_equals_the_python_path(ext, calls):
    """Every converted layer runs natively from its second call, with the
    Python eager path's losses and gradients bit for bit."""
    model = _model()
    ref = copy.deepcopy(model)
    assert sum(isinstance(m, te.Linear) for m in model.modules()) == LINEARS
    got = _train(model, lambda t: model(t, labels=t).loss)
    assert calls["native"] == 2 * LINEARS  # steps 2 and 3: the first builds the memos
    with native_path(False):
        want = _train(ref, lambda t: ref(t, labels=t).loss)
    assert got[0] == want[0]
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
    assert got[0][-1] < got[0][0]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_converted_llama_compiles_without_breaks(mode):
    """torch.compile of the whole model: no graph break, no cudagraph skip
    under reduce-overhead, and it trains."""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    fn = torch.compile(lambda t: model(t, labels=t).loss, mode=mode)
    losses, _ = _train(model, fn, steps=4, mark=mode == "reduce-overhead")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["inductor"].get("cudagraph_skips", 0) == 0
    assert losses[-1] < losses[0] and all(l == l for l in losses)
