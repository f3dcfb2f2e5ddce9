"""te.convert: an existing torch.nn model's Linear layers become
te.Linear in place, with the same parameters; the converted model equals
the original without a recipe and trains under one, eager and compiled."""

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.convert import shape_limits

from test_linear import _reset


@pytest.fixture(autouse=True)
def _fresh():
    _reset()
    yield


class Block(torch.nn.Module):
    """A small pre-norm transformer block written with torch.nn layers."""

    def __init__(self, dim=128, heads=4, ffn=256, vocab=256):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, ffn), torch.nn.GELU(),
                                       torch.nn.Linear(ffn, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as many language models

    def forward(self, tokens):
        x = self.embed(tokens)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def _tokens(seed=0, batch=2, seq=64, vocab=256):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _linears(model, cls):
    return [n for n, m in model.named_modules() if type(m) is cls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_converted_block_equals_the_original_without_a_recipe(dtype):
    torch.manual_seed(0)
    original = Block().to(dtype)
    model = copy.deepcopy(original)
    params = {n: p for n, p in model.named_parameters()}
    assert te.convert(model) is model
    assert _linears(model, torch.nn.Linear) == []
    assert len(_linears(model, te.Linear)) == 5
    for n, p in model.named_parameters():  # the same Parameter objects, dtype, device
        assert p is params[n]
    assert model.head.weight is model.embed.weight  # still tied
    assert model.mlp[0].name == "mlp.0"
    tokens = _tokens()
    assert torch.equal(model(tokens), original(tokens))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(tokens), torch.compile(original, backend="aot_eager")(tokens))
    assert not counters["graph_break"]


def _train(model, rec, compiled, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built after convert: same params
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    losses = []
    tokens = _tokens(0)  # one batch, so the loss must fall
    for _ in range(steps):
        with te.autocast(recipe=rec):
            logits = fn(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_converted_block_trains_eager_and_compiled_under_a_recipe():
    """63 tokens per sequence (126 rows): Float8CurrentScaling takes any
    count.  Compiled equals eager bit for bit, step after step."""
    torch.manual_seed(0)
    base = Block().to(torch.bfloat16)
    rec = recipe.Float8CurrentScaling()
    eager_losses, eager_params = _train(te.convert(copy.deepcopy(base)), rec, compiled=False)
    comp_losses, comp_params = _train(te.convert(copy.deepcopy(base)), rec, compiled=True)
    assert torch.equal(eager_losses, comp_losses)
    assert all(torch.equal(a, b) for a, b in zip(eager_params, comp_params))
    assert eager_losses[-1] < eager_losses[0]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_filter_and_skips_are_reported(caplog):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "keep": torch.nn.Linear(128, 128),
        "filtered": torch.nn.Linear(128, 128),
        "odd": torch.nn.Linear(100, 128),  # FP8 blockwise needs multiples of 128
        "attn": torch.nn.MultiheadAttention(128, 4),  # out_proj: a Linear subclass
    })
    seen = []

    def keep(module, fqn):
        seen.append(fqn)
        return fqn != "filtered"
    with caplog.at_level(logging.INFO, logger="transformer_engine_compile.convert"):
        te.convert(model, module_filter_fn=keep, recipe=recipe.Float8BlockScaling())
    assert sorted(seen) == ["attn.out_proj", "filtered", "keep", "odd"]
    assert isinstance(model["keep"], te.Linear)
    assert type(model["filtered"]) is torch.nn.Linear
    assert type(model["odd"]) is torch.nn.Linear
    assert type(model["attn"].out_proj) is not te.Linear
    text = caplog.text
    assert "kept odd as it is: 100 -> 128: the recipe does not take these sizes" in text
    assert "needs in_features divisible by 128" in text
    assert "kept attn.out_proj as it is: NonDynamicallyQuantizableLinear subclasses" in text
    # without a recipe, 100 -> 128 is converted (Float8CurrentScaling takes it) and the
    # recipes that cannot take it are named
    caplog.clear()
    odd = torch.nn.Sequential(torch.nn.Linear(100, 128))
    with caplog.at_level(logging.INFO, logger="transformer_engine_compile.convert"):
        te.convert(odd)
    assert isinstance(odd[0], te.Linear)
    assert "0 runs under every recipe but mxfp8" in caplog.text


def test_shape_limits_name_the_rule():
    limits = shape_limits(128, 100)
    assert limits["fp8_current"] is None
    assert limits["fp8_block"] == ("FP8 blockwise (128x128) needs out_features divisible "
                                   "by 128")
    assert all(v is None for v in shape_limits(256, 512).values())


def test_params_dtype_shared_layer_and_a_bare_linear():
    torch.manual_seed(0)
    shared = torch.nn.Linear(64, 64)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    x = torch.randn(16, 64)
    ref = model(x)
    te.convert(model, params_dtype=torch.bfloat16)
    assert model[0] is model[2] and isinstance(model[0], te.Linear)  # one layer, two places
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, shared.weight.detach().to(torch.bfloat16))
    assert model(x.bfloat16()).dtype == torch.bfloat16
    bare = torch.nn.Linear(64, 32)
    new = te.convert(bare)
    assert isinstance(new, te.Linear) and new.weight is bare.weight
    assert torch.equal(new(x), bare(x))
    assert torch.equal(model[0](x.bfloat16()), torch.nn.functional.linear(
        x.bfloat16(), model[0].weight, model[0].bias))
    assert ref.shape == model(x.bfloat16()).shape
    with pytest.raises(TypeError, match="params_dtype"):
        te.convert(torch.nn.Linear(4, 4), params_dtype=torch.int8)


def test_hugging_face_llama_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = te.convert(copy.deepcopy(original))
    assert _linears(model, torch.nn.Linear) == []
    assert len(_linears(model, te.Linear)) == 2 * 7 + 1  # q k v o gate up down, lm_head
    tokens = _tokens()
    assert torch.equal(model(tokens).logits, original(tokens).logits)
    rec = recipe.Float8CurrentScaling()
    for compiled in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        fn = torch.compile(m, backend="aot_eager") if compiled else m
        losses = []
        for _ in range(3):
            with te.autocast(recipe=rec):
                loss = fn(tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (compiled, losses)
