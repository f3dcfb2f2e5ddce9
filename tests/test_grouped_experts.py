"""te.GroupedExperts and te.convert of a Hugging Face mixture-of-experts
model (Qwen3-MoE from a tiny config, no weights): the same outputs and
gradients as Hugging Face's experts, the parameters kept, one compiled
graph over changing routing."""

import copy
import logging

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.convert import experts_layout

transformers = pytest.importorskip("transformers")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

E, TOP_K, HIDDEN, FFN = 8, 2, 64, 32


def _config():
    return transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=FFN,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
        num_experts_per_tok=TOP_K, head_dim=16, max_position_embeddings=64)


def _hf_experts(seed=0):
    torch.manual_seed(seed)
    experts = qwen3_moe.Qwen3MoeExperts(_config())
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    return experts


def _routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, E, generator=g)
    weights, index = scores.topk(TOP_K, dim=-1)
    return index, weights


def test_experts_match_hugging_face_experts():
    hf = _hf_experts()
    ours = te.convert(torch.nn.Sequential(copy.deepcopy(hf)))[0]
    assert isinstance(ours, te.GroupedExperts)
    index, weights = _routing(24, 1)
    index[:, 0] = index[:, 0].clamp(max=E - 2)  # ... and one expert without tokens
    index[:, 1] = index[:, 1].clamp(max=E - 2)
    x = torch.randn(24, HIDDEN)
    outs = []
    for experts in (hf, ours):
        xi = x.clone().requires_grad_()
        y = experts(xi, index, weights)
        y.pow(2).sum().backward()
        outs.append((y, xi.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=5e-5)  # fp32, other sum orders
    assert ours.gate_up_proj.grad[E - 1].count_nonzero() == 0


def test_convert_keeps_parameters_state_dict_and_loss():
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(_config())
    model = copy.deepcopy(ref)
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    te.convert(model)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts, te.GroupedExperts)
    assert isinstance(layer.self_attn.q_proj, te.Linear)
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    assert all(p is before[n] for n, p in model.named_parameters())  # the same Parameters
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert list(state) == keys  # te.Linear adds its (empty) _extra_state, as in Transformer Engine
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(ids, labels=ids).loss, ref(ids, labels=ids).loss,
                               rtol=1e-5, atol=1e-6)
    back = copy.deepcopy(ref)
    back.load_state_dict(state)  # loads into the model it came from


def _train(model, steps, compiled):
    step_model = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10))
    for _ in range(steps):
        loss = step_model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_convert_mixtral():
    """Mixtral's experts have the same layout: converted, the same loss,
    compiled fullgraph with no graph break."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
        num_experts_per_tok=TOP_K, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = mixtral.MixtralForCausalLM(cfg)
    model = te.convert(copy.deepcopy(ref))
    assert isinstance(model.model.layers[0].mlp.experts, te.GroupedExperts)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = ref(ids, labels=ids).loss
    torch.testing.assert_close(model(ids, labels=ids).loss, expected, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, labels=ids).loss, expected, rtol=1e-5, atol=1e-6)


def test_converted_model_trains_compiled_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = transformers.Qwen3MoeForCausalLM(_config())
    eager, compiled = te.convert(copy.deepcopy(base)), te.convert(copy.deepcopy(base))
    a, b = _train(eager, 3, False), _train(compiled, 3, True)
    assert a == b, (a, b)
    assert a[-1] < a[0]  # one batch, fitted


def test_routing_changes_without_recompiling():
    torch._dynamo.reset()
    ours = te.convert(torch.nn.Sequential(_hf_experts()))[0]
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    step = torch.compile(ours, fullgraph=True, backend=backend)
    x = torch.randn(24, HIDDEN)
    for seed in range(5):
        index, weights = _routing(24, seed)
        torch.testing.assert_close(step(x, index, weights), ours(x, index, weights),
                                   rtol=0, atol=0)
    assert len(compiles) == 1


def test_convert_checks_the_experts_sizes_against_the_recipe(caplog):
    """Every recipe runs the experts; sizes a recipe's formats cannot take
    keep the Hugging Face module, with the reason logged."""
    model = torch.nn.Sequential(_hf_experts())
    te.convert(model, recipe=te.recipe.Float8CurrentScaling())
    assert isinstance(model[0], te.GroupedExperts)
    model = torch.nn.Sequential(_hf_experts())
    with caplog.at_level(logging.WARNING, logger="transformer_engine_compile.convert"):
        te.convert(model, recipe=te.recipe.Float8BlockScaling())  # 128-wide blocks
    assert isinstance(model[0], qwen3_moe.Qwen3MoeExperts)
    assert "the experts' gate/up GEMM" in caplog.text and "divisible by 128" in caplog.text


def test_experts_layout_names_what_it_cannot_take():
    experts = _hf_experts()
    assert experts_layout(experts) is None
    experts.is_transposed = True
    assert "is_transposed=True" in experts_layout(experts)
    experts.is_transposed = False
    experts.has_bias = True
    assert "has_bias=True" in experts_layout(experts)
