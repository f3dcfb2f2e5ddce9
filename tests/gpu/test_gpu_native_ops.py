"""The linear ops' native real impls (module/linear/native_ops.py): each
recipe's ``te_compile::linear_fwd`` / ``linear_bwd`` run by the C++
extension return what the Python impls return, output for output, bit for
bit, in the fakes' layout; a compiled training loop whose ops stay ops
(``backend="aot_eager"``) equals the eager Python path.  Skips without CUDA."""

import copy

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile.benchmarks import host as bench_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native
    from transformer_engine_compile.module.linear import native_ops as linear_native_ops
    from transformer_engine_compile.module.linear.ops import LINEAR_OPS as OPS

RECIPES = ("fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4")


@pytest.fixture(scope="module", autouse=True)
def _built():
    if native.extension(wait=True) is None:
        pytest.skip(f"native extension unavailable: {native._state['failed']}")


def _flat_args(name, bias, x_grad=True, w_grad=True, main_grad=False, shape=(2, 128, 256),
               n=384, seed=0):
    """The forward op's flat arguments for one layer call, and the layer."""
    torch.manual_seed(seed)
    layer = te.Linear(shape[-1], n, bias=bias, params_dtype=torch.bfloat16, device="cuda",
                      fuse_wgrad_accumulation=main_grad)
    layer.weight.requires_grad_(w_grad)
    if main_grad:
        layer.weight.main_grad = torch.zeros(n, shape[-1], device="cuda")
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=x_grad)
    rec = bench_host.host_recipe(name)
    with te.autocast(enabled=rec is not None, recipe=rec):
        args = layer._make_args(x, None, False, False)
    return OPS.fwd_plan.encode(args), args, layer


def _planned(flat, backward=False):
    plan = linear_native_ops.planned(OPS, flat, backward)
    return plan if plan in (None, False) else type(plan).__name__


def _same(a, b, native_b=True):
    """``b`` are ``a`` (the Python impl's outputs), bit for bit; native
    outputs are no views."""
    assert len(a) == len(b)
    for s, t in zip(a, b):
        assert (s.shape, s.dtype, s.stride()) == (t.shape, t.dtype, t.stride())
        assert t._base is None or not native_b
        assert torch.equal(s.view(torch.uint8), t.view(torch.uint8))


def _bwd_flat(args, fwd_out, seed=1):
    """The backward op's flat arguments from a forward op's flat outputs."""
    from transformer_engine_compile.dynamo.flat_result import unflatten_result
    _, saved = unflatten_result(OPS.fwd_layout(args), fwd_out, args)
    torch.manual_seed(seed)
    dy = torch.randn(fwd_out[0].shape, device="cuda", dtype=torch.bfloat16)
    bwd = OPS.make_bwd_args(saved, OPS.setup_context(args), {"grad_output": dy})
    return OPS.bwd_plan.encode(bwd)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grads", [(True, True), (False, True), (True, False)])
def test_ops_native_equal_python(name, bias, grads):
    """Each op through the dispatcher: its first call (the Python impl) and
    its later ones (native) return the same outputs, and a native plan ran."""
    flat, args, _ = _flat_args(name, bias, *grads)
    with torch.no_grad():
        outs = [OPS.fwd_op(*flat) for _ in range(3)]
    _same(outs[0], outs[1])
    _same(outs[0], outs[2])
    assert _planned(flat) == "NativeLinear"
    bflat = _bwd_flat(args, outs[0])
    grads_out = []
    with torch.no_grad():
        for _ in range(3):
            torch.cuda.manual_seed(7)  # NVFP4's stochastic rounding of dy draws the same
            grads_out.append(OPS.bwd_op(*bflat))
    _same(grads_out[0], grads_out[1], all(grads))
    _same(grads_out[0], grads_out[2], all(grads))
    # a backward whose forward saved no copy of x or of W stays Python
    assert _planned(bflat, True) == ("NativeLinear" if all(grads) else False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grads", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("shape,n", [((2, 128, 256), 384), ((3, 50, 72), 40)], ids=str)
def test_bf16_ops(bias, grads, shape, n):
    """Without a recipe the forward takes the short path, and so does the
    backward but where the bias takes a gradient (and x and W were saved):
    that one runs the plain plan, at any sizes, with the short path's bits."""
    flat, args, _ = _flat_args("bf16", bias, *grads, shape=shape, n=n)
    with torch.no_grad():
        outs = [OPS.fwd_op(*flat) for _ in range(3)]
        bflat = _bwd_flat(args, outs[0])
        grads_out = [OPS.bwd_op(*bflat) for _ in range(3)]
    _same(outs[0], outs[2], native_b=False)
    native_bwd = bias and all(grads)
    _same(grads_out[0], grads_out[1], native_bwd)
    _same(grads_out[0], grads_out[2], native_bwd)
    assert _planned(flat) is False
    assert _planned(bflat, True) == ("NativeLinear" if native_bwd else False)


def test_bf16_backward_native_with_a_transposed_input():
    """The saved x is the input as it came (a transposed view): the plain
    plan's GEMM reads it as the short path does."""
    torch.manual_seed(2)
    layer = te.Linear(128, 64, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16).t().requires_grad_(True)
    args = layer._make_args(x, None, False, False)
    flat = OPS.fwd_plan.encode(args)
    with torch.no_grad():
        out = OPS.fwd_op(*flat)
        bflat = _bwd_flat(args, out)
        grads = [OPS.bwd_op(*bflat) for _ in range(3)]
    _same(grads[0], grads[2])
    assert _planned(bflat, True) == "NativeLinear"


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "fp8_block", "nvfp4"])
def test_main_grad_output(name):
    """fuse_wgrad_accumulation: the backward op returns W's gradient as
    main_grad's update (the op adds nothing itself), as the Python impl."""
    flat, args, layer = _flat_args(name, True, main_grad=True)
    with torch.no_grad():
        out = OPS.fwd_op(*flat)
        bflat = _bwd_flat(args, out)
        grads = []
        for _ in range(3):
            torch.cuda.manual_seed(7)
            grads.append(OPS.bwd_op(*bflat))
    _same(grads[0], grads[2])
    assert grads[2][-1].dtype == torch.float32
    assert torch.count_nonzero(layer.weight.main_grad) == 0
    assert _planned(bflat, True) == "NativeLinear"


def test_delayed_state_not_written():
    """An op may not write its inputs: the delayed-scaling buffers keep their
    values through native calls, the new ones come back as outputs."""
    flat, args, layer = _flat_args("fp8_delayed", False)
    before = [t.clone() for t in (args.amax_history_fwd, args.scale_fwd)]
    with torch.no_grad():
        outs = [OPS.fwd_op(*flat) for _ in range(3)]
    assert torch.equal(args.amax_history_fwd, before[0]) and torch.equal(args.scale_fwd, before[1])
    assert not torch.equal(outs[2][1], before[0])  # the step recorded this call's amaxes


def test_first_call_and_ragged_shapes_stay_python():
    """A configuration is planned at its second call; each call site keeps
    its last PLANS configurations."""
    flats = []
    for tokens in range(16, 16 * (linear_native_ops.PLANS + 3), 16):
        flat, _, _ = _flat_args("fp8_current", False, shape=(tokens, 256))
        with torch.no_grad():
            OPS.fwd_op(*flat)
        assert _planned(flat) is None  # seen once: no plan asked for
        flats.append(flat)
    assert len(OPS.fwd_plan.decoder(flats[0][-1]).native) == linear_native_ops.PLANS
    with torch.no_grad():  # the oldest was dropped: a first call again
        OPS.fwd_op(*flats[0])
    assert _planned(flats[0]) is None
    with torch.no_grad():
        OPS.fwd_op(*flats[0])
    assert _planned(flats[0]) == "NativeLinear"


def test_native_disabled_keeps_python(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)
    flat, _, _ = _flat_args("fp8_current", True, seed=3, shape=(64, 256))
    with torch.no_grad():
        for _ in range(3):
            OPS.fwd_op(*flat)
    assert _planned(flat) is None


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_delayed", "nvfp4"])
def test_compiled_ops_training_equals_eager(name):
    """Three AdamW steps of two layers compiled with aot_eager (the ops stay
    ops, so their native impls run) equal the eager Python path's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        te.Linear(256, 512, bias=True, params_dtype=torch.bfloat16, device="cuda"),
        torch.nn.GELU(),
        te.Linear(512, 256, bias=True, params_dtype=torch.bfloat16, device="cuda"))
    ref = copy.deepcopy(model)
    rec = bench_host.host_recipe(name)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    was, calls = native.ENABLED, []
    real = linear_native_ops.forward, linear_native_ops.backward

    def counting(fn):
        def counted(*call):
            out = fn(*call)
            calls.append(out is not None)
            return out
        return counted

    linear_native_ops.forward, linear_native_ops.backward = map(counting, real)
    try:
        _train(compiled, model, ref, opts, x, rec, was)
    finally:
        linear_native_ops.forward, linear_native_ops.backward = real
    assert any(calls)  # the compiled ops ran natively (bf16: the backward)


def _train(compiled, model, ref, opts, x, rec, was):
    for step in range(3):
        losses = []
        for fn, opt, use_native in ((compiled, opts[0], True), (ref, opts[1], False)):
            native.ENABLED = use_native
            try:
                torch.cuda.manual_seed(step)
                with te.autocast(enabled=rec is not None, recipe=rec):
                    loss = fn(x).float().square().mean()
                loss.backward()
            finally:
                native.ENABLED = was
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
