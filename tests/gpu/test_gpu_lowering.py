"""Inductor lowering of the modules' ops on CUDA (dynamo/lowering.py): the
ops' Triton kernels (wrap_triton) and cuBLAS calls in inductor's code,
bit-identical to eager, in default and reduce-overhead mode: te.Linear,
te.LayerNormLinear and te.LayerNormMLP.  Skips without CUDA; qa/L0_gpu
runs it."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te

from test_lowering import LN_CASES, _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name, mode", [
    *[(n, None) for n in ("bf16", "fp8_current", "fp8_block", "mxfp8")],
    *[(n, "reduce-overhead") for n in ("fp8_current", "mxfp8")],
])
def test_lowered_on_cuda(name, mode):
    torch._dynamo.reset()
    counters.clear()
    assert _train(name, bias=False, steps=3, device="cuda", mode=mode) == {"fwd": 0, "bwd": 0}
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("name, ops_left", [
    *[(n, {"fwd": 0, "bwd": 0}) for n in ("fp8_current", "fp8_block", "mxfp8")],
    ("bf16", {"fwd": 1, "bwd": 0}),  # the bias inside F.linear keeps the forward op
])
def test_bias_on_cuda(name, ops_left):
    """A bias lowers with the GEMM: added in _scaled_mm's epilogue or by the
    bias kernel, its gradient summed by the column-sum kernel, bit for bit."""
    torch._dynamo.reset()
    assert _train(name, bias=True, steps=3, device="cuda") == ops_left


@pytest.mark.parametrize("module, options", LN_CASES)
def test_layernorm_modules_with_bias_lowered_on_cuda(module, options):
    torch._dynamo.reset()
    assert _train("fp8_current", bias=True, steps=3, device="cuda", module=module,
                  **options) == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module, options", [("linear", {}), *LN_CASES])
def test_nvfp4_forward_lowered_on_cuda(module, options):
    """NVFP4's forward lowers (its quantizers do not round stochastically),
    bit for bit; the backward, whose gradient quantizer draws from torch's
    generator, stays an op."""
    torch._dynamo.reset()
    assert _train("nvfp4", bias=False, steps=3, device="cuda", module=module,
                  **options) == {"fwd": 0, "bwd": 1}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_delayed_scaling_lowered_on_cuda(bias):
    """With Triton casts DelayedScaling lowers both ways (never recomputed by
    the partitioner), bit for bit over steps whose scales change."""
    torch._dynamo.reset()
    assert _train("fp8_delayed", bias=bias, steps=4, device="cuda") == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_delayed_scaling_writes_its_buffers_in_place(module):
    """Lowered, the delayed-scaling step runs inside the weight's (forward)
    and dy's (backward) cast (te.Linear: the one launch casting x and W, and
    dy's, kernels/triton_delayed.py), traced as writing over the layer's history and
    scale buffers, and inductor does those writes in place: no step or
    write-back copy kernel is left in the generated code (before: a step
    kernel, two write-back copies per op and a copy and scatter per amax
    slot).  Its reinplacing pass may miss only amax vectors: inductor folds
    every op's zeroed vector into one constant ``full``, so a second GEMM
    in one graph (LayerNormMLP's fc2) gets its zeros filled by a copy of
    that constant, the same one fill per op as an unshared vector."""
    import re

    import test_lowering
    from torch._dynamo.utils import ReinplaceCounters

    from transformer_engine_compile.kernels import reference as ref
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = test_lowering.MODULES[module](64, False, "cuda")
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    fwd = torch.compile(test_lowering._forward(test_lowering.RECIPES["fp8_delayed"]()),
                        fullgraph=True)
    ReinplaceCounters.clear()
    _, code = run_and_get_code(test_lowering._step, layer, x, fwd)
    missed = dict(ReinplaceCounters._values)
    vector_bytes = 4 * (ref.STEP_COUNTER + 1)
    assert missed.get("missed_bytes_TRITON_OPS", 0) == vector_bytes * missed.get(
        "missed_tensors_TRITON_OPS", 0), missed
    text = "\n".join(code)
    if module == "linear":  # x and W, and dy, cast in one launch each, no amax vector
        assert re.search(r"\b_fp8_delayed_kernel_\d+\.run\(", text)
        assert not re.search(r"\b_fp8_tensorwise_kernel_\d+\.run\(", text)
        assert missed.get("missed_tensors_TRITON_OPS", 0) == 0
    else:  # the norm writes x's FP8 copy: W's cast records the last amax
        assert re.search(r"\b_fp8_tensorwise_kernel_\d+\.run\(", text)
    assert not re.search(r"\b_delayed_step_kernel_\d+\.run\(", text)
    assert re.findall(r"def (triton_\w*copy_\w*)\(", text) == []


def test_current_scaling_lowers_to_one_launch_per_quantization():
    """Lowered, each current-scaling quantization (x with W, dy) is one
    launch of the counter-slot kernel, whose slot lies in the pool the
    ops' simple values name (kernels/grid_state.py); no amax pass is left."""
    import re

    import test_lowering
    from torch._inductor.utils import run_and_get_code

    from transformer_engine_compile.kernels import grid_state
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = test_lowering.MODULES["linear"](64, False, "cuda")
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    fwd = torch.compile(test_lowering._forward(test_lowering.RECIPES["fp8_current"]()),
                        fullgraph=True)
    _, code = run_and_get_code(test_lowering._step, layer, x, fwd)
    text = "\n".join(code)
    calls = re.findall(r"\b_fp8_current_kernel_\d+\.run\(([^\n]*)\)", text)
    assert len(calls) == 2  # x with W; dy
    assert not re.search(r"\b_amax_partials\w*_\d+\.run\(", text)
    # torch's mutation analysis of the kernel succeeds: no input is copied
    # (a failed analysis makes inductor copy x, W and dy in kernels of its own)
    assert re.findall(r"def (triton_\w+)\(", text) == []
    base = grid_state.pool(torch.device("cuda", torch.cuda.current_device())).data_ptr()
    for call in calls:  # the slot's high half, a constant of the call
        assert str(base >> 31) in [a.strip() for a in call.split(",")], call
    torch.cuda.synchronize()
    assert all(int(p.count_nonzero()) == 0 for p in grid_state._POOLS.values())


def test_current_scaling_keeps_two_launches_for_cuda_graphs():
    """Lowered for CUDA graphs (mode="reduce-overhead"), a current-scaling
    quantization is an amax pass and a cast, without a counter slot: a
    replay costs no host time, and the two launches less GPU time
    (dynamo/lowering.py).  No op is left and no graph is skipped."""
    import re

    import test_lowering
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = test_lowering.MODULES["linear"](64, False, "cuda")
    fwd = torch.compile(test_lowering._forward(test_lowering.RECIPES["fp8_current"]()),
                        fullgraph=True, mode="reduce-overhead")
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    _, code = run_and_get_code(test_lowering._step, layer, x, fwd)
    for _ in range(2):
        torch.compiler.cudagraph_mark_step_begin()
        test_lowering._step(layer, x, fwd)
    text = "\n".join(code)
    assert "te_compile" not in re.sub(r"#.*", "", text)
    assert not re.search(r"\b_fp8_current_kernel_\d+\.run\(", text)
    assert re.search(r"\b_amax_partials\w*_\d+\.run\(", text)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0


@pytest.mark.parametrize("module, options", LN_CASES)
def test_layernorm_modules_lowered_on_cuda_under_delayed_scaling(module, options):
    torch._dynamo.reset()
    assert _train("fp8_delayed", bias=False, steps=4, device="cuda", module=module,
                  **options) == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module, options", LN_CASES)
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", "mxfp8"])
def test_layernorm_modules_lowered_on_cuda(module, options, name):
    """The norm and activation are Triton kernels in both: bit for bit."""
    torch._dynamo.reset()
    assert _train(name, bias=False, steps=3, device="cuda", module=module, **options) == {
        "fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
def test_layernorm_modules_lowered_for_cuda_graphs(module):
    torch._dynamo.reset()
    counters.clear()
    assert _train("fp8_current", bias=False, steps=3, device="cuda", mode="reduce-overhead",
                  module=module, normalization="RMSNorm") == {"fwd": 0, "bwd": 0}
    assert counters["inductor"].get("cudagraph_skips", 0) == 0



@pytest.mark.parametrize("module, options", [LN_CASES[0], LN_CASES[3]])  # gamma as given
def test_norm_kernels_read_their_inputs_uncopied(module, options):
    """torch's mutation analysis of the norm kernels succeeds, so inductor
    hands them the layer's input and weights as they are.  When it failed
    (torch 2.11 on ``eps.to``), every input counted as written and was
    copied before each launch."""
    import re

    import test_lowering
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = test_lowering.MODULES[module](64, False, "cuda", **options)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    fwd = torch.compile(test_lowering._forward(test_lowering.RECIPES["fp8_current"]()),
                        fullgraph=True)
    _, code = run_and_get_code(test_lowering._step, layer, x, fwd)
    text = "\n".join(code)
    # (kernel, positions of the graph inputs it reads: x and the norm weight;
    # the backward's dy is a buffer of its graph)
    for kernel, positions in (("_norm_fwd_kernel", (0, 1)), ("_norm_bwd_kernel", (1, 2))):
        calls = re.findall(rf"\b{kernel}_\d+\.run\(([^)]*)\)", text)
        assert calls, f"{kernel} not lowered"
        for call in calls:
            args = [a.strip() for a in call.split(",")]
            assert all(args[i].startswith("primals_") for i in positions), (kernel, args)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_a_computed_input_is_stored_once(name):
    """x and dy computed by fused kernels (a product and the loss's
    gradient: exact in both, unlike a SiLU) are stored once each, not once
    per Triton-kernel argument that reads them (dynamo/lowering.py,
    ``trace_impl``): every generated kernel stores each value it computes
    once.  Compiled equals eager bit for bit."""
    import re

    import test_lowering
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_layer = te.Linear(256, 128, bias=False, device="cuda", params_dtype=torch.bfloat16)
    compiled_layer = copy.deepcopy(eager_layer)
    recipe = test_lowering.RECIPES[name]()

    def loss_of(layer):
        def loss(a, b):
            with te.autocast(recipe=recipe):
                y = layer(a * b)
            return y.float().square().sum()
        return loss

    def step(fn, a, b):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        fn(a, b).backward()
        return a.grad, b.grad

    a, b = (torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = step(loss_of(eager_layer), a, b)
    got, code = run_and_get_code(step, torch.compile(loss_of(compiled_layer), fullgraph=True),
                                 a, b)
    text = "\n".join(code)
    assert "te_compile" not in re.sub(r"#.*", "", text)  # lowered
    kernels = re.findall(r"def (triton_\w+)\(.*?\):(.*?)'''", text, re.S)
    assert kernels
    for kernel, body in kernels:
        stored = re.findall(r"tl\.store\(\w+[^,]*, (\w+)", body)
        assert len(stored) == len(set(stored)), (kernel, stored)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert torch.equal(eager_layer.weight.grad, compiled_layer.weight.grad)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8"])
def test_layers_reading_one_input_quantize_it_once_on_cuda(name):
    """q, k and v on one computed input: one Triton kernel of the lowered
    forward reads it (x's quantization, shared: dynamo/shared_inputs.py),
    the other two layers quantize only their weights; the three backwards
    share x's saved columnwise copy.  Compiled equals eager bit for bit."""
    import test_lowering
    from test_lowering import _reads
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = torch.nn.ModuleList(te.Linear(256, 128, bias=False, device="cuda",
                                          params_dtype=torch.bfloat16) for _ in range(3))
    compiled = copy.deepcopy(eager)
    recipe = test_lowering.RECIPES[name]()

    def fwd(layers, a, b):
        with te.autocast(recipe=recipe):
            h = a * b
            return [layer(h) for layer in layers]

    a, b = (torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dys = [torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    graphs = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=graphs.append,
                                      fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(fwd, fullgraph=True)(compiled, a, b)
        torch.autograd.backward(got, dys)
    want = fwd(eager, a, b)
    torch.autograd.backward(want, dys)
    forward = graphs[0]
    product = next(n for n in forward.nodes if n.target is torch.ops.aten.mul.Tensor)
    hops = torch.ops.higher_order  # inductor's reinplacing makes most kernels mutating
    kernel_nodes = (hops.triton_kernel_wrapper_functional, hops.triton_kernel_wrapper_mutation)
    kernels_run = [n for n in forward.nodes if n.target in kernel_nodes]
    readers = [n for n in kernels_run
               if _reads(n, product) or any(_reads(n, u) for u in product.users)]
    assert len(readers) == 1, readers
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for w, g in zip(eager, compiled):
        assert torch.equal(w.weight.grad, g.weight.grad)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_each_kernel_analysed_once_per_signature(compile_caches_off, monkeypatch, mode):
    """torch analyses which arguments a user Triton kernel writes for every
    kernel node, at several stages (dynamo/kernel_analysis.py): with the
    memo, a compile of four layers runs torch's analysis as often as one of
    two, and the compiled steps still equal eager bit for bit."""
    from test_kernel_analysis import counted_analyses
    recipe = te.recipe.Float8CurrentScaling()

    def analyses(layers):
        calls = counted_analyses(monkeypatch)
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = torch.nn.Sequential(*[te.Linear(256, 256, bias=False, device="cuda",
                                                params_dtype=torch.bfloat16)
                                      for _ in range(layers)])
        compiled = copy.deepcopy(eager)

        def loss(model, x):
            with te.autocast(recipe=recipe):
                return model(x).float().square().sum()

        closs = torch.compile(loss, fullgraph=True, mode=mode)
        for i in range(2):
            x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
            loss(eager, x).backward()
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            closs(compiled, x).backward()
            for a, b in zip(eager, compiled):  # read before the next replay
                assert torch.equal(a.weight.grad, b.weight.grad)
                a.weight.grad = b.weight.grad = None
        return len(calls)

    two = analyses(2)
    assert two > 0
    assert analyses(4) == two
