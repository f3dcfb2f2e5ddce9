"""te.GroupedExperts under FSDP2 on 2 gloo ranks: the stacked expert weights
shard by experts, and data-parallel training (per block compiled or eager)
follows the same model trained on the whole batch in one process."""

import copy

import pytest
import torch

import transformer_engine_compile as te

import tp_harness as H

E, TOP_K, HIDDEN, FFN, TOKENS = 4, 2, 64, 32, 16


class MoE(torch.nn.Module):
    """Router (top-k of a softmax), te.GroupedExperts, a residual."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, E, bias=False)
        self.experts = te.GroupedExperts(E, HIDDEN, FFN)

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weights, index = probs.topk(TOP_K, dim=-1)
        return x + self.experts(x, index, weights)


def _batches(steps):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2 * TOKENS, HIDDEN, generator=g) for _ in range(steps)]


def _train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in batches:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def fsdp_worker(group, compiled):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = MoE()
    initial = copy.deepcopy(ref.state_dict())
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # not the machine's GPUs
    te.fsdp.fully_shard(model.experts, mesh=mesh)
    if compiled:  # torchtitan's way: each FSDP2 block compiled after sharding
        model.experts.compile(fullgraph=True, backend="aot_eager")
    fully_shard(model, mesh=mesh)
    local = model.experts.gate_up_proj.to_local()
    assert local.shape == (E // 2, 2 * FFN, HIDDEN), local.shape  # sharded by experts
    batches = _batches(3)
    _train(model, [x[rank * TOKENS:(rank + 1) * TOKENS] for x in batches])
    _train(ref, batches)  # the whole batch, one process
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor()
        torch.testing.assert_close(full, r, rtol=1e-4, atol=1e-5, msg=name)
        assert not torch.equal(full, initial[name]), f"{name} did not train"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_experts_train_under_fsdp2(compiled):
    H.spawn(fsdp_worker, compiled)
