"""Training patterns users rely on: copies and pickles of layers
with state, initialisation on the meta device.  Each copy must have its own
state, run eager and compiled, equal what the original would do, and leave
the original alone."""

import copy
import gc
import io
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_compile as te
from transformer_engine_compile import recipe

from test_linear import _reset

RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling()}


class Block(torch.nn.Module):
    """Two te.Linear layers; ``first`` is is_first_microbatch (weight caching)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = te.Linear(128, 128, params_dtype=torch.bfloat16)
        self.fc2 = te.Linear(128, 128, bias=False, params_dtype=torch.bfloat16)

    def forward(self, x, first=None):
        return self.fc2(torch.relu(self.fc1(x, is_first_microbatch=first)),
                        is_first_microbatch=first)


def _step(rec):
    def step(model, x, first):
        with te.autocast(recipe=rec):
            return model(x, first)
    return step


def _run(model, step, steps, start=0):
    """Outputs, gradients and buffers of ``steps`` training steps (SGD on the
    weights, so the next step sees new weights)."""
    out = []
    for i in range(start, start + steps):
        x = (torch.randn(128, 128, generator=torch.Generator().manual_seed(i))
             .to(torch.bfloat16).requires_grad_())
        y = step(model, x, i % 2 == 0)
        y.float().square().mean().backward()
        out.append([y.detach().clone(), x.grad.clone()]
                   + [p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
        model.zero_grad(set_to_none=True)
    out.append([b.detach().clone().view(torch.uint8) if b.dtype.itemsize == 1 else
                b.detach().clone() for _, b in sorted(model.named_buffers())])
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (ra, rb) in enumerate(zip(a, b)):
        assert len(ra) == len(rb), i
        for j, (ta, tb) in enumerate(zip(ra, rb)):
            assert torch.equal(ta, tb), f"step {i}, tensor {j} differs"


def _state_names(model):
    return sorted(n for n, _ in model.named_buffers())


@pytest.fixture(autouse=True)
def _fresh():
    _reset()
    yield


@pytest.mark.parametrize("name", RECIPES)
def test_deepcopy_before_first_run(name):
    rec = RECIPES[name]
    original = Block()
    clone = copy.deepcopy(original)
    compiled = torch.compile(_step(rec), fullgraph=True, backend="aot_eager")
    got = _run(clone, compiled, 3)
    assert _state_names(original) == []  # the copy's buffers landed on the copy
    assert _state_names(clone) != []
    want = _run(original, _step(rec), 3)  # the original still runs, eagerly
    _assert_same(got, want)
    assert not counters["graph_break"]


@pytest.mark.parametrize("name", RECIPES)
def test_deepcopy_after_first_run_outlives_the_original(name):
    rec = RECIPES[name]
    original = Block()
    _run(original, _step(rec), 2)
    clone, reference = copy.deepcopy(original), copy.deepcopy(original)
    for (n, a), (_, b) in zip(clone.named_buffers(), original.named_buffers()):
        assert a.data_ptr() != b.data_ptr(), n  # own state, copied
    del original
    gc.collect()
    compiled = torch.compile(_step(rec), fullgraph=True, backend="aot_eager")
    _assert_same(_run(clone, compiled, 3, start=2), _run(reference, _step(rec), 3, start=2))


def test_copy_runs_do_not_touch_the_original():
    rec = RECIPES["delayed"]
    original = Block()
    _run(original, _step(rec), 1)
    before = {n: b.clone() for n, b in original.named_buffers()}
    clone = copy.deepcopy(original)
    _run(clone, torch.compile(_step(rec), fullgraph=True, backend="aot_eager"), 2, start=1)
    for n, b in original.named_buffers():
        assert torch.equal(b.view(torch.uint8) if b.dtype.itemsize == 1 else b,
                           before[n].view(torch.uint8) if b.dtype.itemsize == 1 else before[n]), n


@pytest.mark.parametrize("after_run", [False, True], ids=["fresh", "trained"])
def test_torch_save_whole_model_same_process(after_run):
    rec = RECIPES["delayed"]
    model = Block()
    if after_run:
        _run(model, _step(rec), 2)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    start = 2 if after_run else 0
    got = _run(loaded, torch.compile(_step(rec), fullgraph=True, backend="aot_eager"), 2, start)
    _assert_same(got, _run(model, _step(rec), 2, start))


_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
import transformer_engine_compile as te
from transformer_engine_compile import recipe
import test_training_patterns as t
model = torch.load(sys.argv[1], weights_only=False)
rec = recipe.DelayedScaling(amax_history_len=4)
out = t._run(model, torch.compile(t._step(rec), fullgraph=True, backend="aot_eager"), 2, 2)
torch.save(out, sys.argv[1] + ".out")
"""


def test_torch_save_whole_model_loaded_in_a_new_process(tmp_path):
    rec = RECIPES["delayed"]
    model = Block()
    _run(model, _step(rec), 2)
    path = str(tmp_path / "model.pt")
    torch.save(model, path)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, here], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same(torch.load(path + ".out"), _run(model, _step(rec), 2, start=2))


# -- initialisation -----------------------------------------------------------------------
def test_reset_parameters_reinitialises_like_init():
    torch.manual_seed(3)
    fresh = te.Linear(64, 32, params_dtype=torch.float32)
    layer = te.Linear(64, 32, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.fill_(7.0)
        layer.bias.fill_(7.0)
    torch.manual_seed(3)
    layer.reset_parameters()
    assert torch.equal(layer.weight, fresh.weight) and torch.equal(layer.bias, torch.zeros(32))
    ref = torch.nn.Linear(64, 32)
    torch.manual_seed(5)
    ref.reset_parameters()
    torch.manual_seed(5)
    layer.reset_parameters()
    assert torch.equal(layer.weight, ref.weight)  # the default init is torch.nn.Linear's
    seen = []
    custom = te.Linear(64, 32, init_method=lambda w: (seen.append(w.shape), w.fill_(0.5)))
    custom.weight.data.zero_()
    custom.reset_parameters()
    assert seen == [torch.Size([32, 64])] * 2 and bool((custom.weight == 0.5).all())


def test_meta_device_then_to_empty_then_reset_parameters():
    rec = RECIPES["delayed"]
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = Block()
    assert meta.fc1.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in (meta.fc1, meta.fc2):
        m.reset_parameters()
    real = Block()  # seed 0: the same initialisation order
    for (n, a), (_, b) in zip(meta.named_parameters(), real.named_parameters()):
        assert torch.equal(a, b), n
    got = _run(meta, torch.compile(_step(rec), fullgraph=True, backend="aot_eager"), 2)
    _assert_same(got, _run(real, _step(rec), 2))
    direct = te.Linear(64, 64, device="meta")
    assert direct.weight.is_meta and direct.bias.is_meta


# -- checkpoint resume --------------------------------------------------------------------
def _train_with_adamw(model, step, steps, start, opt):
    out = []
    for i in range(start, start + steps):
        x = (torch.randn(128, 128, generator=torch.Generator().manual_seed(i))
             .to(torch.bfloat16).requires_grad_())
        y = step(model, x, True)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([y.detach().clone(), x.grad.clone()])
    out.append([b.detach().clone() for _, b in sorted(model.named_buffers())]
               + [p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("compiled_resume", [False, True], ids=["eager", "compiled"])
def test_checkpoint_resume_continues_bit_identically(compiled_resume):
    rec = RECIPES["delayed"]
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_with_adamw(model, _step(rec), 3, 0, opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    sd = model.state_dict()
    assert sd["fc1._extra_state"].shape == (4 * 4 + 4,)  # amax_history_len 4
    assert not any(k.startswith("fc1.fp8") for k in sd)  # only through _extra_state
    want = _train_with_adamw(model, _step(rec), 3, 3, opt)  # uninterrupted

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    resumed = Block(seed=1)  # other weights, no state yet
    resumed.load_state_dict(ckpt["model"], strict=True)
    ropt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    ropt.load_state_dict(ckpt["opt"])
    step = _step(rec)
    if compiled_resume:
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    _assert_same(_train_with_adamw(resumed, step, 3, 3, ropt), want)


def test_checkpoint_without_state_loads_cleanly_and_drops_stale_state():
    rec = RECIPES["delayed"]
    fresh_sd = Block().state_dict()  # saved before any layer ran
    assert fresh_sd["fc1._extra_state"].numel() == 0
    trained = Block()
    _run(trained, _step(rec), 2)
    assert _state_names(trained)
    trained.load_state_dict(fresh_sd, strict=True)
    # as the checkpointed layer: no history yet (the FP8 weight cache is not
    # checkpoint state: the next is_first_microbatch=True rebuilds it)
    assert not [n for n in _state_names(trained) if "amax_history" in n or "fp8_scale_" in n]
    _assert_same(_run(trained, _step(rec), 2), _run(Block(), _step(rec), 2))
    # a torch.nn.Linear checkpoint (no extra state at all) loads strictly
    lin = torch.nn.Linear(128, 128, dtype=torch.bfloat16)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16)
    layer.load_state_dict(lin.state_dict(), strict=True)
    assert torch.equal(layer.weight, lin.weight)
    with pytest.raises(ValueError, match="extra state"):
        layer.load_state_dict({**layer.state_dict(), "_extra_state": torch.ones(5)})


def _spawned_child(model, queue):
    rec = recipe.DelayedScaling(amax_history_len=4)
    buf = io.BytesIO()  # as bytes: shared-memory tensors would die with this process
    torch.save(_run(model, torch.compile(_step(rec), fullgraph=True, backend="aot_eager"), 2, 2),
               buf)
    queue.put(buf.getvalue())


def test_model_handed_to_a_spawned_process():
    import torch.multiprocessing as mp
    rec = RECIPES["delayed"]
    model = Block()
    _run(model, _step(rec), 2)
    # torch.multiprocessing shares the tensors' memory with the child (parameters
    # and buffers alike, as for any module), so compare with a copy made before
    reference = copy.deepcopy(model)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawned_child, args=(model, queue))
    proc.start()
    got = torch.load(io.BytesIO(queue.get(timeout=300)))
    proc.join(timeout=60)
    assert proc.exitcode == 0
    _assert_same(got, _run(reference, _step(rec), 2, start=2))


# -- inference first ----------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", RECIPES)
def test_inference_mode_before_training(name, compiled):
    """Validation under inference_mode, then training: the state it left is
    ordinary tensors, and training equals a model validated under no_grad."""
    rec = RECIPES[name]
    model, reference = Block(), Block()
    x = torch.randn(128, 128).to(torch.bfloat16)
    step = _step(rec)
    if compiled:  # validation and training through the same compiled function
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        y = step(model, x, True)
    with torch.no_grad():
        y_ref = _step(rec)(reference, x, True)
    assert torch.equal(y, y_ref)
    assert not any(b.is_inference() for b in model.buffers())
    _assert_same(_run(model, step, 3), _run(reference, _step(rec), 3))
    assert not counters["graph_break"]


# -- a layer applied more than once before backward -----------------------------------------
def _fused_layer(fuse=True, device="cpu"):
    torch.manual_seed(0)
    layer = te.Linear(128, 128, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=fuse,
                      device=device)
    if fuse:
        layer.weight.main_grad = torch.zeros(128, 128, device=device)
    return layer


def _twice(rec, separate_calls):
    one = _step(rec)

    def in_one_call(layer, x1, x2):
        with te.autocast(recipe=rec):
            return layer(x1) + layer(x2)

    def run(fn, layer, x1, x2):
        return fn(layer, x1, None) + fn(layer, x2, None) if separate_calls else fn(layer, x1, x2)
    return (one if separate_calls else in_one_call), run


def _applied_twice(rec, eager_calls, compiled_calls, backend="aot_eager", fuse=True,
                   steps=3, device="cpu", mode=None):
    """Eager and compiled copies of one layer, each applied to two inputs
    before one backward (in one function or in two calls), ``steps``
    times: outputs, input gradients, the weight's gradient (``main_grad``,
    else ``.grad``, both accumulating over the steps) and the state must be
    equal bit for bit."""
    eager_fn, eager_run = _twice(rec, eager_calls == "two_calls")
    fn, run = _twice(rec, compiled_calls == "two_calls")
    compiled = torch.compile(fn, fullgraph=True, backend=backend, mode=mode)
    layers = {"eager": _fused_layer(fuse, device), "compiled": _fused_layer(fuse, device)}
    c = torch.linspace(-1, 1, 128, device=device)
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless reduce-overhead
        results = {}
        for kind, layer in layers.items():
            g = torch.Generator(device=device).manual_seed(i)
            x1, x2 = (torch.randn(128, 128, generator=g, device=device).to(torch.bfloat16)
                      .requires_grad_() for _ in range(2))
            y = (eager_run(eager_fn, layer, x1, x2) if kind == "eager"
                 else run(compiled, layer, x1, x2))
            (y.float() * c).sum().backward()
            wgrad = layer.weight.main_grad if fuse else layer.weight.grad
            results[kind] = [y.detach(), x1.grad, x2.grad, wgrad.clone(), layer.bias.grad] + [
                b.detach().clone() for _, b in sorted(layer.named_buffers())
                if b.dtype.itemsize > 1]
        assert results["eager"][3].abs().sum() > 0
        for j, (a, b) in enumerate(zip(results["eager"], results["compiled"])):
            assert torch.equal(a, b), f"step {i}, tensor {j} differs"
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.parametrize("compiled_calls", ["one_call", "two_calls"])
@pytest.mark.parametrize("eager_calls", ["one_call", "two_calls"])
@pytest.mark.parametrize("name", RECIPES)
def test_layer_applied_twice_before_backward(name, eager_calls, compiled_calls):
    """Tied weights / two micro-batch losses summed, with DelayedScaling and
    fuse_wgrad_accumulation: eager (both applications in one function, or
    two calls) equals compiled (one function applying the layer twice, or
    two calls of the compiled function before one backward): outputs,
    input gradients, main_grad, state.  Between two compiled calls the
    first backward writes main_grad and the backward history/scale, which
    the other call's compiled backward reads: they reach it without a
    version check, as in eager (compat.save_without_version_check)."""
    _applied_twice(RECIPES[name], eager_calls, compiled_calls)


def test_no_version_check_saved_tensors_pinned():
    """compat.save_without_version_check relies on private AOTAutograd
    machinery (node meta read by the partitioner, a runtime slice of saved
    tensors kept off save_for_backward); pin it on every supported torch."""
    from transformer_engine_compile import compat

    assert compat.saved_without_version_check_supported()


def test_layer_applied_in_two_compiled_calls_without_fused_wgrad():
    """DelayedScaling without fuse_wgrad_accumulation: the backward history
    and scale alone (weight.grad accumulated by autograd)."""
    _applied_twice(RECIPES["delayed"], "two_calls", "two_calls", fuse=False)


def test_layer_applied_in_two_compiled_calls_inductor():
    """The same under inductor (DelayedScaling and fuse_wgrad_accumulation)."""
    _applied_twice(RECIPES["delayed"], "two_calls", "two_calls", backend="inductor",
                   steps=2)


def test_two_compiled_calls_keep_the_version_check_of_saved_activations():
    """Only the state the backward writes is handed over unchecked: an
    input the op saves (bf16, for wgrad) and then modified in place before
    the backward is refused, compiled as eagerly."""
    for compiled in (False, True):
        torch._dynamo.reset()
        layer = _fused_layer()
        fn = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        base = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
        x = base * 1
        y = fn(x) + fn(base * 2)
        x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.float().sum().backward()


def test_layer_applied_twice_accumulates_both_contributions():
    """Stateless quantization: y = f(x1) + f(x2) in one backward gives the
    main_grad of two separate forward-backward passes."""
    rec = RECIPES["current"]
    c = torch.linspace(-1, 1, 128)
    g = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(128, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    together, apart = _fused_layer(), _fused_layer()
    with te.autocast(recipe=rec):
        ((together(x1.requires_grad_()) + together(x2.requires_grad_())).float() * c).sum().backward()
        for x in (x1, x2):
            (apart(x.detach()).float() * c).sum().backward()
    assert apart.weight.main_grad.abs().sum() > 0
    assert torch.equal(together.weight.main_grad, apart.weight.main_grad)


# -- torch.autocast -----------------------------------------------------------------------
AUTOCAST_RECIPES = {"bf16": None, "current": recipe.Float8CurrentScaling(),
                    "delayed": recipe.DelayedScaling(amax_history_len=4),
                    "block": recipe.Float8BlockScaling(), "mxfp8": recipe.MXFP8BlockScaling()}


@pytest.mark.parametrize("name", AUTOCAST_RECIPES)
def test_torch_autocast_with_fp32_parameters(name):
    """Under torch.autocast(bf16) with fp32 parameters the layer computes and
    returns bf16 as torch.nn.Linear does, gradients reach the fp32
    parameters, and compiled equals eager bit for bit (weight caching on)."""
    rec = AUTOCAST_RECIPES[name]

    def step(layer, x, first):
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=rec is not None,
                                                                       recipe=rec):
            return layer(x, is_first_microbatch=first)

    def make():
        torch.manual_seed(0)
        return te.Linear(128, 128, params_dtype=torch.float32)

    eager, comp = make(), make()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i in range(3):
        out = []
        for layer, fn in ((eager, step), (comp, compiled)):
            x = torch.randn(128, 128, generator=torch.Generator().manual_seed(i)).requires_grad_()
            y = fn(layer, x, i == 0 if rec is not None else None)
            assert y.dtype == torch.bfloat16
            y.float().square().mean().backward()
            assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
            out.append([y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()])
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.1 * p.grad
            layer.zero_grad(set_to_none=True)
        for j, (a, b) in enumerate(zip(*out)):
            assert torch.equal(a, b), f"step {i}, tensor {j} differs"
    assert not counters["graph_break"]
    if rec is None:  # the same GEMM as torch.nn.Linear under autocast
        lin = torch.nn.Linear(128, 128)
        lin.load_state_dict({"weight": eager.weight, "bias": eager.bias})
        x = torch.randn(128, 128)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = lin(x)
        assert torch.equal(step(eager, x, None), want)


# -- is_first_microbatch from a step counter ------------------------------------------------
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("name", RECIPES)
def test_first_microbatch_computed_inside_the_compiled_function(name, dynamic):
    """``is_first_microbatch=(step % accum == 0)`` with the step counter an
    argument Dynamo makes symbolic: works, equals eager, one graph per value
    (plus the first, static one under automatic dynamic shapes)."""
    rec = RECIPES[name]

    def step(model, x, i, accum):
        with te.autocast(recipe=rec):
            return model(x, first=(i % accum == 0))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    eager_model, comp_model = Block(), Block()
    for i in range(6):
        x = torch.randn(128, 128, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        assert torch.equal(compiled(comp_model, x, i, 3), step(eager_model, x, i, 3)), i
        with torch.no_grad():  # an optimizer step: the cache must follow only on firsts
            for m in (eager_model, comp_model):
                m.fc1.weight.mul_(1.0625)
    assert counters["stats"]["unique_graphs"] == (2 if dynamic else 3)
    assert not counters["graph_break"]
    with pytest.raises(TypeError, match="Python bool"):
        Block().fc1(torch.ones(128, 128, dtype=torch.bfloat16),
                    is_first_microbatch=torch.tensor(True))
