"""``parameters_split``: te.Linear / te.LayerNormLinear holding the weight and
bias as several named parameters (Transformer Engine's fused-QKV layout)."""

import copy
import io

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe
from transformer_engine_compile.module.param_split import join_rows, split_layout

import tp_harness as H

RECIPES = {name: recipe.by_name(name) for name in recipe.RECIPE_NAMES}
QKV = {"query_": 64, "key_": 32, "value_": 32}  # 128 output features


def _pair(cls=te.Linear, bias=True, split=QKV, dtype=torch.bfloat16, **kw):
    """An unsplit layer and a split one holding the same parameters."""
    torch.manual_seed(0)
    ref = cls(128, 128, bias=bias, params_dtype=dtype, **kw)
    if bias:
        with torch.no_grad():
            ref.bias.normal_()
    layer = cls(128, 128, bias=bias, params_dtype=dtype, parameters_split=split, **kw)
    layer.load_state_dict({k: v for k, v in ref.state_dict().items()
                           if k not in ("weight", "bias")}, strict=False)
    layer.load_full_weight_(ref.weight.detach(), ref.bias.detach() if bias else None)
    return ref, layer


def run_steps(layer, step, x0, steps=3, dy=None):
    """Forward, backward (of ``dy``, else of a weighted sum), SGD; [out, dx,
    wgrad, bgrad] per step, the split layer's gradients joined (also the
    GPU tests')."""
    out = []
    torch.manual_seed(1)  # NVFP4 stochastic rounding draws from the global RNG
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        x = (x0 * (1 + 0.1 * i)).requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = step(x)
        if dy is not None:
            y.backward(dy)
        else:
            (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
        grads = [torch.cat([layer._parameters[n].grad for n in names])
                 for names in (layer._weight_names, layer._bias_names)
                 if layer._parameters[names[0]] is not None]
        out.append([y.detach().clone(), x.grad.clone()] + [g.clone() for g in grads])
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.01 * p.grad.to(p.dtype)
    return out


def make_step(layer, rec):
    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x)
    return step


def _assert_equal(a_runs, b_runs, what):
    for i, (a, b) in enumerate(zip(a_runs, b_runs)):
        for name, s, t in zip(("out", "dgrad", "wgrad", "bgrad"), a, b):
            assert torch.equal(s, t), f"{what}: step {i} {name} differs"


# -- names, checks ------------------------------------------------------------------------
def test_parameter_names_follow_transformer_engine():
    layer = te.Linear(16, 24, parameters_split=("query_", "key_", "value_"))
    names = ["query_weight", "key_weight", "value_weight", "query_bias", "key_bias",
             "value_bias"]
    assert [n for n, _ in layer.named_parameters()] == names
    assert list(layer.state_dict()) == names + ["_extra_state"]
    assert [tuple(p.shape) for p in layer.parameters()] == [(8, 16)] * 3 + [(8,)] * 3
    assert not hasattr(layer, "weight") and not hasattr(layer, "bias")
    assert "parameters_split={'query': 8, 'key': 8, 'value': 8}" in repr(layer)

    nobias = te.Linear(16, 24, bias=False, parameters_split={"q": 16, "kv": 8})
    assert list(nobias.state_dict()) == ["q_weight", "kv_weight", "_extra_state"]
    assert nobias.q_bias is None and nobias.kv_bias is None
    assert [tuple(p.shape) for p in nobias.parameters()] == [(16, 16), (8, 16)]


@pytest.mark.parametrize("split,err,match", [
    ((), ValueError, "0 parameters"),
    ({}, ValueError, "0 parameters"),
    ("qkv", TypeError, "tuple or list of names"),
    (("a", 1), TypeError, "tuple or list of names"),
    (("a", "b", "c", "d", "e"), ValueError, "do not divide"),
    ({"a": 10, "b": 10}, ValueError, "add up to out_features"),
    ({"a": 24, "b": 0}, ValueError, "positive int"),
    ({"a": 12.0, "b": 12}, ValueError, "positive int"),
    ({"1a": 12, "b": 12}, ValueError, "identifier"),
    (("a_", "a"), ValueError, "must differ"),
])
def test_bad_parameters_split_is_refused(split, err, match):
    with pytest.raises(err, match=match):
        te.Linear(16, 24, parameters_split=split)


def test_column_parallel_split_sizes_divide_by_tp_size():
    assert split_layout({"q": 8, "kv": 4}, 12, "column", 4, "x") == (("q", 2), ("kv", 1))
    assert split_layout({"q": 8, "kv": 4}, 12, "row", 4, "x") == (("q", 8), ("kv", 4))
    with pytest.raises(ValueError, match="not divisible by tp_size 4"):
        split_layout({"q": 10, "kv": 2}, 12, "column", 4, "x")


def test_fused_wgrad_accumulation_is_refused():
    with pytest.raises(NotImplementedError, match="parameters_split"):
        te.Linear(16, 24, parameters_split=("a", "b"), fuse_wgrad_accumulation=True)


# -- numerics: the split layer is the unsplit layer ---------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("name", RECIPES)
def test_split_layer_equals_the_unsplit_layer_eager_and_compiled(name, bias):
    """Every recipe: the split layer's outputs and input gradients equal the
    unsplit layer's bit for bit over 3 SGD steps, its parameters' gradients
    are the rows of the unsplit gradients, and compiled (fullgraph, one
    graph) equals eager."""
    rec = RECIPES[name]
    ref, layer = _pair(bias=bias)
    state = copy.deepcopy(layer.state_dict())
    x0 = torch.randn(64, 128, dtype=torch.bfloat16)
    expected = run_steps(ref, make_step(ref, rec), x0)
    eager = run_steps(layer, make_step(layer, rec), x0)
    _assert_equal(expected, eager, f"{name} split eager vs unsplit")
    torch._dynamo.reset()
    counters.clear()
    layer.load_state_dict(state)
    compiled = run_steps(layer, torch.compile(make_step(layer, rec), fullgraph=True,
                                           backend="aot_eager"), x0)
    _assert_equal(eager, compiled, f"{name} split compiled vs eager")
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_split_layer_compiles_with_inductor():
    rec = RECIPES["fp8_current"]
    ref, layer = _pair()
    x0 = torch.randn(64, 128, dtype=torch.bfloat16)
    expected = run_steps(ref, make_step(ref, rec), x0, steps=2)
    torch._dynamo.reset()
    compiled = run_steps(layer, torch.compile(make_step(layer, rec), fullgraph=True), x0,
                         steps=2)
    _assert_equal(expected, compiled, "inductor")


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8"])
def test_layernorm_linear_split_equals_unsplit(name):
    rec = RECIPES[name]
    ref, layer = _pair(te.LayerNormLinear, normalization="RMSNorm")
    assert [n for n, _ in layer.named_parameters()][-1] == "layer_norm_weight"
    x0 = torch.randn(64, 128, dtype=torch.bfloat16)
    expected = run_steps(ref, make_step(ref, rec), x0)
    _assert_equal(expected, run_steps(layer, make_step(layer, rec), x0), f"{name} eager")
    torch._dynamo.reset()
    ref2, layer2 = _pair(te.LayerNormLinear, normalization="RMSNorm")
    compiled = run_steps(layer2, torch.compile(make_step(layer2, rec), fullgraph=True,
                                            backend="aot_eager"), x0)
    _assert_equal(expected, compiled, f"{name} compiled")


def test_return_bias_hands_back_the_joined_bias():
    _, layer = _pair(return_bias=True)
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    y, b = layer(x)
    assert torch.equal(b, torch.cat([layer.query_bias, layer.key_bias, layer.value_bias]))
    b.float().sum().backward()  # the caller adds it: its gradient reaches the parts
    assert torch.equal(layer.key_bias.grad, torch.ones(32, dtype=torch.bfloat16))


def test_torch_autocast_split_equals_unsplit():
    ref, layer = _pair(dtype=torch.float32)
    x = torch.randn(16, 128)
    outs = []
    for m in (ref, layer):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
        outs.append((y, torch.cat([p.grad for n, p in m.named_parameters()
                                   if n.endswith("weight")])))
    assert outs[0][0].dtype == torch.bfloat16
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# -- storage: the GEMM reads the parameters in place --------------------------------------
def _reads_in_place(layer) -> bool:
    """Whether a call without gradients reads the parts where they lie."""
    with torch.no_grad():
        w, _ = layer._gemm_parameters()
    return w.data_ptr() == layer._weights()[0].data_ptr()


def test_gradient_free_calls_read_the_parameters_without_a_copy():
    """Without gradients the parts, adjacent rows of one buffer, are read in
    place, also after ``.to()``, a deep copy and ``torch.save`` /
    ``torch.load``; where they are not adjacent (an assigning load), and
    wherever a gradient is recorded, the layer concatenates them."""
    _, layer = _pair()
    assert _reads_in_place(layer)
    w, _ = layer._gemm_parameters()  # a recorded gradient: torch.cat, its C++ backward
    assert w.grad_fn.name() == "CatBackward0"
    layer.to(torch.float32)
    assert _reads_in_place(layer) and layer.query_weight.dtype == torch.float32
    assert _reads_in_place(copy.deepcopy(layer))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert _reads_in_place(loaded)
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert torch.equal(loaded(x), layer(x))
    assert torch.equal(loaded(x), layer(x))

    fresh = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.load_state_dict(fresh, assign=True)
    assert not _reads_in_place(layer)  # concatenated
    with torch.no_grad():
        assert torch.equal(layer(x), loaded(x))
    layer(x).sum().backward()
    assert layer.value_weight.grad is not None


def test_meta_device_then_to_empty_and_reset():
    layer = te.Linear(128, 128, device="meta", parameters_split=QKV)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert _reads_in_place(layer)
    assert all(p.abs().sum() > 0 for p in layer._weights())
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in layer.named_parameters()
               if n.endswith("bias"))


def test_each_part_is_initialised_as_a_layer_of_its_own():
    calls = []
    te.Linear(128, 128, parameters_split=QKV, init_method=lambda w: calls.append(w.shape))
    assert calls == [torch.Size([64, 128]), torch.Size([32, 128]), torch.Size([32, 128])]


def test_join_rows_copies_what_is_not_adjacent():
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(1, 3, requires_grad=True)
    j = join_rows([a, b])
    assert torch.equal(j, torch.cat([a, b])) and j.grad_fn.name() == "CatBackward0"
    with torch.no_grad():
        assert torch.equal(join_rows([a, b]), j)
    assert join_rows([a]) is a and join_rows([]) is None


# -- training patterns ----------------------------------------------------------------------
def test_adamw_and_gradient_accumulation_match_the_unsplit_layer():
    rec = RECIPES["fp8_current"]
    ref, layer = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, layer)]
    torch.manual_seed(3)
    batches = [torch.randn(32, 128, dtype=torch.bfloat16) for _ in range(4)]
    for step in range(2):
        for m, opt in zip((ref, layer), opts):
            for x in batches[2 * step: 2 * step + 2]:  # two microbatches per step
                with te.autocast(recipe=rec):
                    m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    joined = torch.cat([p.detach() for p in layer._weights()])
    assert torch.equal(joined, ref.weight.detach())
    assert _reads_in_place(layer)  # the optimizer wrote the parts in place


def test_activation_checkpointing():
    rec = RECIPES["fp8_current"]
    _, layer = _pair()
    x = torch.randn(16, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=rec):
        layer(x).float().sum().backward()
    plain = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    with te.autocast(recipe=rec):
        te.checkpoint(layer, x).float().sum().backward()
    assert all(torch.equal(a, b) for a, b in
               zip(plain, [p.grad for p in layer.parameters()] + [x.grad]))


# -- tensor parallelism (gloo, 2 processes) -------------------------------------------------
def _tp_split_worker(group):
    from transformer_engine_compile.parallel.fsdp import gemm_weight_names
    from transformer_engine_compile.parallel.fsdp_tp import tp_split_dims

    rank = torch.distributed.get_rank(group)
    split = {"q": 128, "k": 64, "v": 64}
    for mode in ("column", "row"):
        rec = None
        x, w, b, dy = H.full_tensors(rec, "cpu")
        sl = H.Slicer(mode, False, rank, 2)
        ref = te.Linear(H.IN, H.OUT, params_dtype=torch.bfloat16, parameters_split=split)
        ref.load_full_weight_(w, b)
        layer = te.Linear(H.IN, H.OUT, params_dtype=torch.bfloat16, parameters_split=split,
                          parallel_mode=mode, tp_group=group)
        layer.load_full_weight_(w, b)
        parts = w.split([128, 64, 64])
        for (name, rows), part in zip(split.items(), parts):
            got = layer._parameters[f"{name}_weight"]
            want = part.chunk(2, 0)[rank] if mode == "column" else part.chunk(2, 1)[rank]
            assert torch.equal(got, want), f"{mode}: {name}_weight is not this rank's shard"
        dims = tp_split_dims(layer)
        assert dims == ({"q_weight": 0, "k_weight": 0, "v_weight": 0, "q_bias": 0,
                         "k_bias": 0, "v_bias": 0} if mode == "column"
                        else {"q_weight": 1, "k_weight": 1, "v_weight": 1}), dims
        assert gemm_weight_names(layer) == ()
        y_ref = ref(x)
        xin = sl.inp(x).requires_grad_()
        for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
            y = fn(xin)
            if mode == "column":  # each rank: its rows of q, k and v
                want = torch.cat([t.chunk(2, -1)[rank] for t in y_ref.split([128, 64, 64], -1)],
                                 -1)
            else:
                want = y_ref
            assert torch.equal(y, want), f"{mode}: TP split output differs"


def test_tensor_parallel_split_layers_shard_each_part():
    """Column TP: each rank holds its rows of every part (Transformer
    Engine's layout), row TP its columns; bf16 integer data, so the TP
    layer's output equals the single-device split layer's exactly, eager and
    compiled; tp_split_dims names every part for 2-D FSDP; FSDP2's
    quantized gather is not offered for the parts."""
    H.spawn(_tp_split_worker)
