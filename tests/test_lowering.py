"""Inductor lowers the modules' ops into their kernels (dynamo/lowering.py).

On CUDA the lowered impl records the fast Triton kernels; here, on CPU, it
records the reference kernels (the lowering is switched on for CPU by the
fixture), which inductor compiles with its C++ backend.  Each test checks
which ops stayed in the generated code and that compiled training equals
eager: bit for bit for te.Linear; for the LayerNorm modules within the
formats' error here, because inductor sums the reference norm's rows in
another order than ATen (on CUDA the norm is a Triton kernel, the same in
both, and tests/gpu/test_gpu_lowering.py checks them bit for bit).
"""

import copy

import pytest
import torch
from torch.utils._pytree import tree_leaves as pytree_leaves

import transformer_engine_compile as te
from transformer_engine_compile.dynamo import lowering
from transformer_engine_compile.module.linear import (args as linear_args, lowering as
                                                      linear_lowering, ops as linear_ops)

pytestmark = pytest.mark.skipif(not linear_ops.LINEAR_OPS.available,
                                reason="torch without the opaque-object API")


@pytest.fixture
def lowered_on_cpu():
    previous = lowering.set_lowered_devices({"cpu"})
    torch._dynamo.reset()
    yield
    lowering.set_lowered_devices(previous)
    torch._dynamo.reset()


RECIPES = {
    "bf16": None,
    "fp8_current": te.recipe.Float8CurrentScaling,
    "fp8_delayed": te.recipe.DelayedScaling,
    "fp8_block": te.recipe.Float8BlockScaling,
    "mxfp8": te.recipe.MXFP8BlockScaling,
    "nvfp4": te.recipe.NVFP4BlockScaling,
}


def _forward(recipe):
    def fwd(layer, x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return layer(x)
    return fwd


def _step(layer, x, fwd):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = fwd(layer, x)
    ys = y if isinstance(y, tuple) else (y,)
    sum(t.float().square().sum() for t in ys).backward()
    return [*ys, x.grad, *[p.grad for p in layer.parameters()],
            *[b.clone() for b in layer.buffers()]]


# op pair name (te_compile::<name>_fwd / _bwd) -> constructor(n, bias, device, **options)
MODULES = {
    "linear": lambda n, bias, device, **kw: te.Linear(
        n, n, bias=bias, params_dtype=torch.bfloat16, device=device, **kw),
    "layernorm_linear": lambda n, bias, device, **kw: te.LayerNormLinear(
        n, n, bias=bias, params_dtype=torch.bfloat16, device=device, **kw),
    "layernorm_mlp": lambda n, bias, device, **kw: te.LayerNormMLP(
        n, 2 * n, bias=bias, params_dtype=torch.bfloat16, device=device, **kw),
}


def _assert_close(want, got, name, what, exact):
    if exact:
        assert torch.equal(want, got), f"{what}: compiled != eager"
        return
    # bf16: a LayerNorm's dx cancels terms, which magnifies the sums' last
    # bits; FP8: a last-bit difference in a norm output moves an amax, so
    # every element of a quantized operand may round the other way (e4m3: 2^-4)
    tol = 2e-2 if name == "bf16" else 0.1
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: compiled differs from eager by {err:.3g} (relative)"


def _train(name, bias, steps=2, device="cpu", mode=None, module="linear", exact=True,
           adjust=None, **options):
    """Op calls left in the generated code of the first compiled step, after
    checking ``steps`` compiled steps of ``module`` (built with ``options``,
    then passed to ``adjust``) against eager (bit for bit when ``exact``)."""
    from torch._inductor.utils import run_and_get_code
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    torch.manual_seed(0)
    n = 128 if name == "fp8_block" else 64
    eager = MODULES[module](n, bias, device, **options)
    if adjust is not None:
        adjust(eager)
    compiled = copy.deepcopy(eager)
    fwd = _forward(recipe)
    cfwd = torch.compile(fwd, backend="inductor", fullgraph=True, mode=mode)
    code = None
    for i in range(steps):
        x = torch.randn(32, n, dtype=torch.bfloat16, device=device)
        torch.manual_seed(10 + i)
        want = _step(eager, x, fwd)
        torch.manual_seed(10 + i)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if code is None:
            got, code = run_and_get_code(_step, compiled, x, cfwd)
        else:
            got = _step(compiled, x, cfwd)
        assert len(got) == len(want)
        for j, (a, b) in enumerate(zip(want, got)):
            _assert_close(a, b, name, f"{module} {name} bias={bias} step {i} tensor {j}", exact)
    text = "\n".join(code)
    return {op: text.count(f"torch.ops.te_compile.{module}_{op}.default(")
            for op in ("fwd", "bwd")}


# torch 2.11's C++ backend fails an internal assertion ("unexpected group",
# codegen/cpp.py) on the MXFP8 reference's scale layout; torch 2.13 compiles
# it (2.12 not tried).  CPU lowering is a test-only setting (lowered_on_cpu).
_MXFP8_ON_CPU = pytest.param("mxfp8", marks=pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch < 2.13: inductor's C++ backend asserts on the MXFP8 reference"))


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", _MXFP8_ON_CPU])
def test_lowered_without_bias(lowered_on_cpu, name):
    assert _train(name, bias=False) == {"fwd": 0, "bwd": 0}


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8"])
def test_bias_keeps_the_ops(lowered_on_cpu, name):
    """Without the bias kernels (CPU has none), inductor would fuse the bias
    add with the casts and GEMMs around it (other rounding) and reorder the
    bias gradient's reduction; on CUDA the kernels lower it
    (test_cuda_lowering_traces_without_copies, tests/gpu)."""
    assert _train(name, bias=True) == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("name", ["fp8_delayed", "nvfp4"])
def test_stateful_and_random_recipes_stay_ops(lowered_on_cpu, name):
    """Where the casts are torch ops (the reference, as on CPU).
    DelayedScaling: the forward reads the scale buffer it updates, and AOT's
    partitioner could recompute a cast in the backward from the updated
    buffer; NVFP4: inductor would fuse the reference's torch ops and round
    otherwise.  With Triton casts both lower (NVFP4 its forward only:
    test_cuda_lowering_traces_without_copies,
    test_cuda_lowering_nvfp4_forward_only, tests/gpu/test_gpu_lowering.py)."""
    assert _train(name, bias=False, steps=3) == {"fwd": 1, "bwd": 1}


def test_switching_lowering_off_recompiles(lowered_on_cpu):
    """The lowering setting is part of the graph (the ops' cache token), so
    a function compiled before the switch is not served stale code."""
    assert _train("fp8_current", bias=False, steps=1) == {"fwd": 0, "bwd": 0}
    lowering.set_lowered_devices(set())
    assert _train("fp8_current", bias=False, steps=1) == {"fwd": 1, "bwd": 1}


def test_not_lowered_on_other_devices_by_default():
    assert "cpu" not in lowering.lowered_devices()
    token = lowering.cache_token()
    assert token[0] == tuple(sorted(lowering.lowered_devices()))


def test_lowered_for_cuda_graphs_too(lowered_on_cpu):
    """mode="reduce-overhead" compiles with this config set: the calls lower
    as well (where current scaling keeps two launches per quantization:
    tests/gpu/test_gpu_lowering.py)."""
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert _train("fp8_current", bias=False, steps=1) == {"fwd": 0, "bwd": 0}


LN_CASES = [  # (module, options): both norms, gated MLP, the norm options
    ("layernorm_linear", {"normalization": "RMSNorm"}),
    ("layernorm_linear", {"normalization": "LayerNorm", "zero_centered_gamma": True,
                          "return_layernorm_output": True}),
    ("layernorm_mlp", {"normalization": "RMSNorm", "activation": "swiglu"}),
    ("layernorm_mlp", {"normalization": "LayerNorm", "activation": "gelu"}),
]


@pytest.mark.parametrize("module, options", LN_CASES)
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_block", _MXFP8_ON_CPU])
def test_layernorm_modules_lowered_without_bias(lowered_on_cpu, module, options, name):
    assert _train(name, bias=False, module=module, exact=False, **options) == {
        "fwd": 0, "bwd": 0}


@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
@pytest.mark.parametrize("name, bias", [("fp8_current", True), ("fp8_delayed", False),
                                        ("nvfp4", False)])
def test_layernorm_modules_keep_linear_exclusions(lowered_on_cpu, module, name, bias):
    """A GEMM's bias, DelayedScaling and NVFP4 keep the ops, as for te.Linear
    (compiled then equals eager bit for bit: the op runs its impl)."""
    assert _train(name, bias=bias, module=module, steps=3) == {"fwd": 1, "bwd": 1}


def test_layernorm_bias_grad_in_another_dtype_keeps_the_backward_op(lowered_on_cpu):
    """dbeta is computed in gamma's dtype and cast by a torch op, which
    inductor would fuse into its consumers without the rounding."""
    def fp32_beta(layer):
        layer.layer_norm_bias.data = layer.layer_norm_bias.data.float()
    for adjust, ops in ((None, {"fwd": 0, "bwd": 0}), (fp32_beta, {"fwd": 0, "bwd": 1})):
        assert _train("bf16", bias=False, module="layernorm_linear", exact=False,
                      adjust=adjust, normalization="LayerNorm") == ops


# -- the CUDA impls as inductor traces them, without a GPU (tests/cuda_trace.py) ----------
TRACE_CASES = [("linear", {}), *LN_CASES]
def _meta_module(module, options, bias=False):
    n = 256
    layer = MODULES[module](n, bias, "meta", **options)
    x = torch.empty(2, 128, n, dtype=torch.bfloat16, device="meta", requires_grad=True)
    return layer, x


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.t.default, torch.ops.aten.detach.default,
          torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default,
          torch.ops.aten.as_strided.default)


# the bias kernels' arguments (kernels/triton_bias.py)
_COLUMN_SUMS = {"x_ptr", "part_ptr", "M", "N", "G", "BM", "BN"}
_BIAS_ADD = {"y_ptr", "b_ptr", "M", "N", "BM", "BN"}


def _kernel_name(node) -> str:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    return kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__


def _graph_input(node) -> bool:
    """Whether ``node`` is a graph input or a view of one: a kernel that
    writes it makes inductor copy it first (a buffer the graph made is
    written in place instead)."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node.op == "placeholder"


def _step_kernels(op, kernels_run) -> list:
    """Names of the kernels that run a delayed-scaling step, checking that
    no kernel copies an input.  A step (its own kernel, or run by the op's
    last cast) is traced as writing over the history and scale buffers it
    updates, which inductor then writes in place (the update's copy
    matches), so the buffers themselves, not views."""
    steps = []
    for n in kernels_run:
        args = n.kwargs["kwargs"]
        copied = [k for k in n.kwargs["tensors_to_clone"] if _graph_input(args[k])]
        if "new_hist_ptr" in copied:
            steps.append(_kernel_name(n))
            assert copied == ["new_hist_ptr", "new_scale_ptr"], (op, copied)
            assert all(args[k].op == "placeholder" for k in copied), op
            assert args["hist_ptr"] is args["new_hist_ptr"], op
            continue
        assert copied == [], f"{op}: a kernel copies its inputs {copied}"
    return steps


_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default)


def _spare_allocations(gm) -> list:
    """Buffers the traced impl allocates that no kernel writes: pointer
    arguments a kernel never touches (its flag is a constexpr) should point
    at an input it reads, not at a buffer of their own, which a lowered
    graph allocates on every call."""
    kernels = [n for n in gm.graph.nodes
               if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    written = {id(n.kwargs["kwargs"][k]) for n in kernels for k in n.kwargs["tensors_to_clone"]}
    spares = []
    for n in gm.graph.nodes:
        if n.target in _ALLOCATIONS and id(n) not in written:
            users = {u.target for u in n.users}
            if users <= {torch.ops.higher_order.triton_kernel_wrapper_functional}:
                spares.append(n.name)
    return spares


def test_next_pow2_is_tritons():
    """``triton_launch.next_pow2`` stands in for ``triton.next_power_of_2``
    (a slow ``ConstexprFunction``) in the launch paths."""
    triton = pytest.importorskip("triton")
    from transformer_engine_compile.kernels.triton_launch import next_pow2
    for n in [*range(0, 4100), 65535, 65536, 65537, 2 ** 31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_cuda_lowering_weight_cache_read_steps_in_the_amax_launch():
    """DelayedScaling with the weight cached (``is_first_microbatch=False``):
    the launch recording the weight's amax (its cast kernel without copies)
    runs the forward's step, not a step launch of its own; it writes over the buffers as the step
    that dy's cast runs in the backward does.  (This trace names no counter
    pool, so the two-launch kernels run, as in AOTInductor; on the GPU the
    one launch of kernels/triton_delayed.py.)"""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    layer, x = _meta_module("linear", {})
    recipe = RECIPES["fp8_delayed"]()
    lowered_cuda_traces(layer, x, recipe, is_first_microbatch=True)  # fills the cache
    traces = lowered_cuda_traces(layer, x, recipe, is_first_microbatch=False)
    steps = []
    for op, _, gm in traces:
        nodes = list(gm.graph.nodes)
        assert nodes[-1].args[0] not in (None, [None]), f"{op}: not lowered"
        kernels_run = [n for n in nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        steps.append((op.name(), _step_kernels(op, kernels_run)))
    assert steps == [("te_compile::linear_fwd", ["_fp8_tensorwise_kernel"]),
                     ("te_compile::linear_bwd", ["_fp8_tensorwise_kernel"])]


@pytest.mark.parametrize("module, options", TRACE_CASES)
@pytest.mark.parametrize("name, bias", [*((n, False) for n in ("bf16", "fp8_current",
                                                                "fp8_delayed", "fp8_block",
                                                                "mxfp8")),
                                        *((n, True) for n in ("bf16", "fp8_current",
                                                              "fp8_delayed", "fp8_block",
                                                              "mxfp8"))])
def test_cuda_lowering_traces_without_copies(module, options, name, bias):
    """Each op call's CUDA impl traces into Triton kernels and GEMMs with
    the fake impl's output layout, and no kernel copies an input: torch's
    mutation analysis counts a pointer as written when a store address is
    derived from a call that took it, and inductor then clones that input
    (an activation, a weight) before every launch.  With a bias: added by
    ``_scaled_mm`` or the bias kernel and its gradient summed by a kernel,
    so quantized GEMMs lower with it; the unquantized forward (bias inside
    ``F.linear``) stays an op, its backward lowers."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    layer, x = _meta_module(module, options, bias)
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    traces = lowered_cuda_traces(layer, x, recipe)
    if module == "linear" and name == "bf16" and not bias:
        assert traces == []  # bias-free bf16 runs F.linear, not the ops
        return
    assert [op.name() for op, _, _ in traces] == [
        f"te_compile::{module}_fwd", f"te_compile::{module}_bwd"]
    for op, outputs, gm in traces:
        nodes = list(gm.graph.nodes)
        if name == "bf16" and bias and op.name().endswith("_fwd"):
            assert nodes[-1].args[0] in (None, [None]), f"{op}: lowered with F.linear's bias"
            continue
        assert nodes[-1].args[0] not in (None, [None]), f"{op}: not lowered"
        assert not any(getattr(n.target, "namespace", None) == "te_compile" for n in nodes)
        kernels_run = [n for n in nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert kernels_run or (name == "bf16" and not bias), f"{op}: no Triton kernel traced"
        steps = _step_kernels(op, kernels_run)
        assert _spare_allocations(gm) == [], op
        if name == "fp8_delayed":  # the casts of the weight and of dy run the steps
            gemms = 2 if module == "layernorm_mlp" else 1
            assert steps == ["_fp8_tensorwise_kernel"] * gemms, (op, steps)
        if bias:
            names = [set(n.kwargs["kwargs"]) for n in kernels_run]
            if op.name().endswith("_bwd"):
                assert _COLUMN_SUMS in names, f"{op}: no bias-gradient kernel"
            else:  # in _scaled_mm's epilogue (tensorwise) or by the bias kernel
                epilogue = [n for n in nodes if n.target is torch.ops.aten._scaled_mm.default
                            and len(n.args) > 4 and n.args[4] is not None]
                assert epilogue or _BIAS_ADD in names, f"{op}: bias added by a torch op"
        traced = [n.meta["val"] for n in pytree_leaves(nodes[-1].args)]
        assert len(traced) == len(outputs)
        for got, want in zip(traced, outputs):
            assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype,
                                                            want.stride()), op


_TWO_LAUNCH_KERNELS = {"_amax_partials_kernel", "_amax_partials_pair_kernel",
                       "_fp8_tensorwise_kernel"}


@pytest.mark.parametrize("module, options", TRACE_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_lowering_current_scaling_in_one_launch(module, options, bias):
    """With a counter slot, as a default-mode graph has on a GPU, each
    current-scaling quantization traces as one ``_fp8_current_kernel``
    (x with W; dy alone) or one cast from a norm's partial maxima, never
    the two-launch amax + cast.  The one-tensor launch points the second
    tensor's arguments at its input: no buffer is allocated for them and
    none of them is copied."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    layer, x = _meta_module(module, options, bias)
    traces = lowered_cuda_traces(layer, x, RECIPES["fp8_current"](), one_launch=True)
    assert [op.name() for op, _, _ in traces] == [
        f"te_compile::{module}_fwd", f"te_compile::{module}_bwd"]
    for op, outputs, gm in traces:
        nodes = list(gm.graph.nodes)
        kernels_run = [n for n in nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        names = [_kernel_name(n) for n in kernels_run]
        if module == "linear" or op.name().endswith("_bwd"):  # a norm gives its partials
            assert "_fp8_current_kernel" in names, (op, names)
        assert not _TWO_LAUNCH_KERNELS & set(names), (op, names)
        if module == "linear":  # plus the bias gradient's column sums
            assert names.count("_fp8_current_kernel") == 1, (op, names)
        assert _step_kernels(op, kernels_run) == []  # and no input copied
        assert _spare_allocations(gm) == [], op
        traced = [n.meta["val"] for n in pytree_leaves(nodes[-1].args)]
        assert [(t.shape, t.dtype, t.stride()) for t in traced] == [
            (t.shape, t.dtype, t.stride()) for t in outputs], op


@pytest.mark.parametrize("module, options", TRACE_CASES)
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_cuda_lowering_realizes_a_computed_input_once(module, options, name):
    """An input the graph computes (x, dy: a fused kernel's result in a
    model) reaches every Triton kernel of the call through one
    ``inductor_force_stride_order``.  Inductor fixes each user-kernel
    argument's layout separately and copies an unrealized one per argument
    (torch 2.11 on an H200: the SwiGLU backward stored dy five times, 153 us
    against 62); a realized one it passes as it is.  Graph inputs (weights)
    are not wrapped: they are buffers already."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    fixed = torch.ops.prims.inductor_force_stride_order.default
    layer, x = _meta_module(module, options)
    traces = lowered_cuda_traces(layer, x, RECIPES[name](), computed_input=True)
    assert len(traces) == 2
    for op, _, gm in traces:
        nodes = list(gm.graph.nodes)
        computed = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
        anchors = [n for n in nodes if n.target is fixed]
        assert [n.args[0] for n in anchors] == [computed], op  # only x / dy, once
        readers = {user.op if user.op != "call_function" else user.target
                   for user in computed.users}
        assert readers == {fixed}, (op, readers)  # no kernel reads it unfixed
        kernels_run = [n for n in nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert any(_reads(n, anchors[0]) for n in kernels_run), op


def test_calls_on_one_computed_input_share_its_fixed_layout(lowered_on_cpu):
    """q, k and v on one computed input: their lowered forward calls' fixed
    layout nodes merge in AOT's CSE, so inductor realizes the input once
    for all three (the forward graph inductor compiles)."""
    layers = [te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16) for _ in range(3)]
    graphs = []

    def record(graph):
        graphs.append([n for n in graph.nodes
                       if n.target is torch.ops.prims.inductor_force_stride_order.default])

    def loss(a, b):
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            h = a * b
            return sum(layer(h).float().square().sum() for layer in layers)

    a = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        torch.compile(loss, fullgraph=True)(a, b).backward()
    forward, backward = graphs
    assert [n.args[0].target for n in forward] == [torch.ops.aten.mul.Tensor]
    assert len([n for n in backward if n.op == "call_function"]) == 3  # each dy


def test_cuda_lowering_computed_input_when_the_mutation_analysis_fails(monkeypatch):
    """Where torch cannot analyse a kernel (it then takes every input as
    written: custom_ops.md, "Pitfalls seen"), a computed input still traces:
    the kernels get copies of the fixed-layout tensor, not a view chain
    that functionalization would have to write through."""
    pytest.importorskip("triton")
    from torch._higher_order_ops import triton_kernel_wrap

    from cuda_trace import lowered_cuda_traces

    def fail(*args, **kwargs):
        raise RuntimeError("no TTIR")
    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", fail)
    fixed = torch.ops.prims.inductor_force_stride_order.default
    layer, x = _meta_module("linear", {})
    traces = lowered_cuda_traces(layer, x, RECIPES["fp8_current"](), computed_input=True)
    for op, _, gm in traces:
        nodes = list(gm.graph.nodes)
        anchor = next(n for n in nodes if n.target is fixed)
        kernels_run = [n for n in nodes
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert kernels_run and all(n.kwargs["tensors_to_clone"] for n in kernels_run), op
        assert any(_reads(n, anchor) for n in kernels_run), op


def _reads(kernel_node, source) -> bool:
    """Whether a traced kernel takes ``source`` or a view of it."""
    for arg in kernel_node.kwargs["kwargs"].values():
        while isinstance(arg, torch.fx.Node) and arg is not source and arg.target in _VIEWS:
            arg = arg.args[0]
        if arg is source:
            return True
    return False


@pytest.mark.parametrize("fused", [True, False], ids=["one_kernel_gemm", "three_kernel_gemm"])
@pytest.mark.parametrize("module, options, x_grad", [
    *((m, o, True) for m, o in TRACE_CASES), ("linear", {}, False)])
def test_cuda_lowering_nvfp4_forward_only(module, options, x_grad, fused, monkeypatch):
    """NVFP4 (Transformer Engine's recipe rounds only gradients
    stochastically): the forward's CUDA impl traces into Triton kernels
    (quantize, then the emulated GEMM: for these small products one kernel,
    else the operand and epilogue kernels around a bf16 GEMM into fp32,
    ``cuda_gemm.nvfp4_fused``), with the fake impl's layout and no input
    copies; the backward, whose gradient quantizer draws from torch's
    generator, is refused and stays an op.  Without x's gradient the
    weight's columnwise copy is not written: a spare buffer stands in."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    from transformer_engine_compile.quantization import cuda_gemm
    if not fused:
        monkeypatch.setattr(cuda_gemm, "NVFP4_FUSED_MAX", 0)
    layer, x = _meta_module(module, options)
    x.requires_grad_(x_grad)
    (fwd, outputs, gm), (bwd, _, bwd_gm) = lowered_cuda_traces(layer, x,
                                                                RECIPES["nvfp4"]())
    assert (fwd.name(), bwd.name()) == (f"te_compile::{module}_fwd", f"te_compile::{module}_bwd")
    assert list(bwd_gm.graph.nodes)[-1].args[0] in (None, [None]), "nvfp4 backward lowered"
    nodes = list(gm.graph.nodes)
    assert nodes[-1].args[0] not in (None, [None]), "nvfp4 forward not lowered"
    assert not any(getattr(n.target, "namespace", None) == "te_compile" for n in nodes)
    kernels_run = [n for n in nodes
                   if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert _step_kernels(fwd, kernels_run) == []
    names = {_kernel_name(n) for n in kernels_run}
    three = {"_nvfp4_blocks_pair_kernel", "_nvfp4_epilogue_kernel"}
    if fused:
        assert "_nvfp4_gemm_kernel" in names and not three & names, names
    else:
        assert three <= names and "_nvfp4_gemm_kernel" not in names, names
    assert "_nvfp4_kernel" in names
    assert any(n.target is torch.ops.aten.mm.dtype for n in nodes) is not fused
    traced = [n.meta["val"] for n in pytree_leaves(nodes[-1].args)]
    assert [(t.shape, t.dtype, t.stride()) for t in traced] == [
        (t.shape, t.dtype, t.stride()) for t in outputs]


@pytest.mark.parametrize("dtype, lowered", [(torch.bfloat16, True), (torch.float16, False),
                                            (torch.float32, False)])
def test_mxfp8_outputs_other_than_bf16_keep_the_ops(dtype, lowered):
    """Hopper's MXFP8 GEMMs are bf16 GEMMs: an fp16 output is a converted
    bf16 product whose rounding inductor drops (GPU, autocast fp16), an fp32
    one the reference GEMM; either keeps the op (forward, dgrad, wgrad)."""
    from transformer_engine_compile.quantization.mxfp8 import MXFP8Quantizer
    q = MXFP8Quantizer()
    x = torch.empty(32, 64, dtype=dtype)
    fwd = linear_args.LinearFwdArgs(inp=x, weight=torch.empty(64, 64, dtype=torch.bfloat16),
                                   input_quantizer=q, weight_quantizer=q)
    assert linear_lowering._lowers_forward(fwd) is lowered
    dgrad = linear_args.LinearBwdArgs(grad_output=x, grad_output_quantizer=q,
                                     input_requires_grad=True)
    assert linear_lowering._lowers_backward(dgrad) is lowered
    wgrad = linear_args.LinearBwdArgs(grad_output=torch.empty(32, 64, dtype=torch.bfloat16),
                                     grad_output_quantizer=q, weight_requires_grad=True,
                                     weight_dtype=dtype)
    assert linear_lowering._lowers_backward(wgrad) is lowered


@pytest.mark.parametrize("module, options", LN_CASES)
def test_cuda_lowering_norm_hands_both_amaxes_to_one_cast(module, options):
    """FP8 current scaling, weight quantized by the call: the norm kernel also
    writes the weight's partial maxima (``side``), and one pair-cast launch
    quantizes the norm's output and the weight, where a separate weight
    quantize would take an amax launch and a cast launch of its own."""
    pytest.importorskip("triton")
    from cuda_trace import lowered_cuda_traces
    layer, x = _meta_module(module, options)
    (op, _, gm), _ = lowered_cuda_traces(layer, x, RECIPES["fp8_current"]())
    assert op.name().endswith("_fwd")
    kernels_run = [set(n.kwargs["kwargs"]) for n in gm.graph.nodes
                   if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    norm, cast = kernels_run[:2]
    assert {"x_ptr", "s_ptr", "amax_ptr"} <= norm
    assert {"a_ptr", "b_ptr", "part_ptr", "a_data", "b_data"} <= cast
    first_gemm = next(i for i, n in enumerate(gm.graph.nodes)
                      if n.target is torch.ops.aten._scaled_mm.default)
    launches_before = [n for n in list(gm.graph.nodes)[:first_gemm]
                       if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(launches_before) == 2


def _count_input_quantizations(monkeypatch) -> list:
    """Patch the quantizers to count quantizations of the layers' input
    here (3-D with 128 features; weights are 2-D, gradients have 256),
    traced or run; returns the count holder.  The callers turn the compile
    caches off (``compile_caches_off``): a cached graph is not traced."""
    from transformer_engine_compile.quantization import base, float8
    count = [0]

    def counting(method):
        def wrapper(self, x, *args):
            count[0] += x.dim() == 3 and x.shape[-1] == 128
            return method(self, x, *args)
        return wrapper
    monkeypatch.setattr(base.Quantizer, "quantize_unchecked",
                        counting(base.Quantizer.quantize_unchecked))
    for cls in (float8.Float8CurrentScalingQuantizer, base.Quantizer):
        monkeypatch.setattr(cls, "quantize_pair_unchecked", counting(cls.quantize_pair_unchecked))
    return count


def _three_layers_on_one_input(name, mutate: bool):
    """One compiled step, then one eager step, of three te.Linear reading
    h = a * b (q, k, v), checked equal bit for bit; with ``mutate``, h is
    scaled in place between the first layer and the other two."""
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    eager = torch.nn.ModuleList(te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16)
                                for _ in range(3))
    compiled = copy.deepcopy(eager)

    def fwd(layers, a, b):
        with te.autocast(recipe=recipe):
            h = a * b
            ys = [layers[0](h)]
            if mutate:
                h.mul_(2)
            return ys + [layer(h) for layer in layers[1:]]

    a = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    b = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    dys = [torch.randn(2, 64, 256, dtype=torch.bfloat16) for _ in range(3)]
    got = torch.compile(fwd, fullgraph=True)(compiled, a, b)
    torch.autograd.backward(got, dys)
    want = fwd(eager, a, b)
    torch.autograd.backward(want, dys)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), f"{name} layer {i}: compiled != eager"
    for i, (w, g) in enumerate(zip(eager, compiled)):
        assert torch.equal(w.weight.grad, g.weight.grad), f"{name} layer {i} wgrad"


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8"])
def test_layers_reading_one_input_quantize_it_once(lowered_on_cpu, compile_caches_off, monkeypatch,
                                                  name):
    """q, k and v on one input: the lowered trace quantizes it once and the
    other two layers reuse its buffers (dynamo/shared_inputs.py), bit for
    bit what eager computes; once h changes in place, the layers after it
    quantize the new value."""
    count = _count_input_quantizations(monkeypatch)
    _three_layers_on_one_input(name, mutate=False)
    traced_once = count[0] - 1  # the eager step shares it too (test_eager_shared_inputs.py)
    torch._dynamo.reset()
    count[0] = 0
    _three_layers_on_one_input(name, mutate=True)
    assert (traced_once, count[0] - 2) == (1, 2)  # eager: before and after the write


def test_input_sharing_needs_equal_quantizers(lowered_on_cpu, compile_caches_off, monkeypatch):
    """A layer that saves its input unquantized quantizes it rowwise only
    (and columnwise again in its backward): another quantizer, so it makes
    its own copy, while the third layer reuses the first one's."""
    count = _count_input_quantizations(monkeypatch)
    recipe = RECIPES["fp8_current"]()
    layers = [te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16,
                        save_original_input=save) for save in (False, True, False)]

    def fwd(a, b):
        with te.autocast(recipe=recipe):
            h = a * b
            return [layer(h) for layer in layers]

    a = torch.randn(2, 64, 128, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    ys = torch.compile(fwd, fullgraph=True)(a, b)
    assert count[0] == 3  # traced: layer 0 (both copies); layer 1 forward, backward
    want = fwd(a, b)
    assert all(torch.equal(w, g) for w, g in zip(want, ys))
