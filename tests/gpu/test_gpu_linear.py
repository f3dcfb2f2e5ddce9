"""te.Linear on CUDA: compiled (inductor, default mode) equals eager bit for
bit for every recipe, with zero graph breaks and one graph.  Skips without
CUDA; qa/L0_gpu/test.sh runs it on a GPU machine."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

from test_linear import RECIPES, SHAPES, assert_compiled_step_equals_eager, compare_compiled

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", RECIPES)
def test_cuda_compiled_equals_eager_inductor(name, bias, shape):
    compare_compiled(RECIPES[name], SHAPES[shape], bias, backend="inductor", device="cuda")


@pytest.mark.parametrize("name", RECIPES)
def test_cuda_eager_matches_cpu_eager(name):
    """The same layer on CUDA and on CPU: bf16 within matmul rounding, the
    quantized recipes within their format's error (the GEMM sums in another order)."""
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)  # same values on both devices: draw on the CPU, then move
        layer = te.Linear(128, 128, params_dtype=torch.float32).to(device)
        x = torch.randn(128, 128).to(device)
        with torch.no_grad(), te.autocast(enabled=RECIPES[name] is not None, recipe=RECIPES[name]):
            results[device] = layer(x).cpu()
    a, b = results["cpu"], results["cuda"]
    assert ((a - b).norm() / a.norm()).item() < (5e-3 if name != "nvfp4" else 5e-2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_fp8_primary_weight_and_fp8_output(backend):
    torch._dynamo.reset()
    counters.clear()
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    layer.weight = torch.nn.Parameter(te.Float8CurrentScalingQuantizer()(layer.weight.detach()))
    rec = RECIPES["fp8_current"]

    def train(x):
        with te.autocast(recipe=rec):
            return layer(x)

    def infer(x):
        with torch.no_grad(), te.autocast(recipe=rec):
            return layer(x, fp8_output=True)

    x0 = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
    assert_compiled_step_equals_eager(layer, train, x0, backend)
    q_eager, q_comp = infer(x0), torch.compile(infer, fullgraph=True, backend=backend)(x0)
    assert type(q_comp) is te.Float8Tensor
    assert torch.equal(q_eager.dequantize(), q_comp.dequantize())


@pytest.mark.parametrize("name", [n for n in RECIPES if RECIPES[n] is not None])
def test_cuda_saved_original_weight_requantized_bit_for_bit(name):
    """``save_original_weight`` (te.fsdp.fully_shard's high-precision
    gather): eager (native plans decline it: the Python path runs) and
    compiled with inductor, the backward quantizing W again gives the
    outputs and gradients of the layer that keeps the forward's copy,
    bit for bit, and the layer holds no FP8 copy of W between its
    forward and backward."""
    rec = RECIPES[name]
    results, kept = {}, {}
    for compiled in (False, True):
        for sow in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            layer = te.Linear(1024, 2048, params_dtype=torch.bfloat16, device="cuda")
            layer.save_original_weight = sow
            x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            f = torch.compile(layer, fullgraph=True, backend="inductor") if compiled else layer
            held = []
            for _ in range(2):  # the second call: compiled, the native plans made
                x.grad = layer.weight.grad = None
                before = torch.cuda.memory_allocated()
                with te.autocast(recipe=rec):
                    y = f(x)
                held.append(torch.cuda.memory_allocated() - before - y.numel() * y.element_size())
                y.float().pow(2).sum().backward()
            results[compiled, sow] = (y.detach(), x.grad, layer.weight.grad)
            kept[compiled, sow] = held[-1]
    copy = layer.weight.numel() // (2 if name == "nvfp4" else 1)  # the quantized W's data
    for compiled in (False, True):
        assert kept[compiled, False] - kept[compiled, True] >= copy, kept
    for key, got in results.items():
        for a, b in zip(results[False, False], got):
            assert torch.equal(a, b), key
