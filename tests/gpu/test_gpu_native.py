"""The native eager path (kernels/native.py, module/linear/native.py): an
eager ``te.Linear`` under fp8_current (with or without a bias) or
fp8_block run by the C++ extension gives the Python path's bits, in the
ways users train.  Skips without CUDA."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if torch.cuda.is_available():
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native


REC = R.Float8CurrentScaling()
BLOCK = R.Float8BlockScaling()
MX = R.MXFP8BlockScaling()


def _two_layers(bias):
    """256 -> 512 -> GELU -> 256, bf16 parameters."""
    return torch.nn.Sequential(
        te.Linear(256, 512, bias=bias, params_dtype=torch.bfloat16, device="cuda"),
        torch.nn.GELU(),
        te.Linear(512, 256, bias=bias, params_dtype=torch.bfloat16, device="cuda"))


def _memo_native(layer):
    """The native plans (or False) of the layer's memo entries, oldest first."""
    return [t.native for t in layer._args_memo[1].values()]


def _python_only(layer):
    """A copy of ``layer`` whose memo never gets a native plan."""
    ref = copy.deepcopy(layer)
    ref.__dict__["_args_memo"] = None
    return ref


class _NoNative:
    def __enter__(self):
        self.was, native.ENABLED = native.ENABLED, False

    def __exit__(self, *exc):
        native.ENABLED = self.was


def _step(layer, x, dy, no_native=False, rec=REC):
    """Output and gradients (x, weight, bias) of one eager step (third call:
    the memo and the plan exist by then)."""
    ctx = _NoNative() if no_native else _Null()
    outs = None
    with ctx:
        for _ in range(3):
            layer.weight.grad = None
            if layer.bias is not None:
                layer.bias.grad = None
            xx = x.detach().requires_grad_(x.requires_grad)
            with te.autocast(recipe=rec):
                y = layer(xx)
            y.backward(dy)
            outs = (y.detach(), None if xx.grad is None else xx.grad,
                    layer.weight.grad, None if layer.bias is None else layer.bias.grad)
    return outs, y


class _Null:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def _equal(a, b):
    return (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("shape,out,x_grad", [((256, 512), 384, True), ((2, 128, 512), 256, True),
                                              ((4, 64, 256), 512, False)], ids=str)
def test_native_equals_python_bit_for_bit(ext, calls, shape, out, x_grad):
    torch.manual_seed(0)
    layer = te.Linear(shape[-1], out, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ref = _python_only(layer)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_(x_grad)
    dy = torch.randn((*shape[:-1], out), device="cuda", dtype=torch.bfloat16)
    got, y = _step(layer, x, dy)
    want, y_ref = _step(ref, x, dy, no_native=True)
    assert calls["native"] == 2  # calls 2 and 3 (the first builds the memo)
    assert y.grad_fn.name() == "TeLinearFp8Backward"
    assert type(y_ref.grad_fn).__name__ != "TeLinearFp8Backward"
    for g, w in zip(got, want):
        assert _equal(g, w)
    assert y._base is None  # no view: in-place ops allowed, as on the Python path


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _skip_block(rec):
    if rec is BLOCK and not _HOPPER:
        pytest.skip("the block-scaled GEMM is cuBLAS's on SM 9.0")


NVFP4 = R.NVFP4BlockScaling()  # RHT for the wgrad operands, stochastic dy, 16x16 W
NVFP4_PLAIN = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                  disable_2d_quantization=True)


@pytest.mark.parametrize("rec", [BLOCK, MX, NVFP4, NVFP4_PLAIN],
                         ids=["fp8_block", "mxfp8", "nvfp4", "nvfp4_plain"])
@pytest.mark.parametrize("shape,out,x_grad,dtype,bias",
                         [((256, 512), 384, True, torch.bfloat16, False),
                          ((2, 128, 256), 256, True, torch.bfloat16, True),
                          ((128, 1024), 512, False, torch.bfloat16, False),
                          ((256, 512), 640, True, torch.float16, True),
                          ((48, 80), 112, True, torch.bfloat16, True)], ids=str)
def test_native_block_mxfp8_nvfp4_equal_python_bit_for_bit(ext, calls, shape, out, x_grad,
                                                            dtype, bias, rec):
    """Float8BlockScaling: x, W and dy quantized by the blockwise kernel (W
    128x128, its scales padded for cuBLAS where K/128 or N/128 is not a
    multiple of 4), the GEMMs cuBLAS's block-scaled ones.  MXFP8: the MXFP8
    kernel, each operand dequantized to bf16, bf16 GEMMs.  NVFP4: the NVFP4
    kernels (dy's stochastic draws in the Python path's order, and none by
    planning, so one seed gives both paths the same bits), each operand
    dequantized to bf16, bf16 GEMMs with an fp32 product, the epilogue
    kernel.  A bias added by the bias kernel (NVFP4: the epilogue) and its
    gradient summed by the column-sum kernels."""
    _skip_block(rec)
    if shape == (48, 80) and rec in (BLOCK, MX):
        pytest.skip("sizes of 16 are NVFP4's blocks, not blockwise FP8's or MXFP8's")
    torch.manual_seed(4)
    layer = te.Linear(shape[-1], out, bias=bias, params_dtype=dtype, device="cuda")
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    ref = _python_only(layer)
    x = (torch.randn(shape, device="cuda", dtype=dtype) * 3).requires_grad_(x_grad)
    dy = torch.randn((*shape[:-1], out), device="cuda", dtype=dtype)
    torch.cuda.manual_seed(11)
    got, y = _step(layer, x, dy, rec=rec)
    torch.cuda.manual_seed(11)
    want, _ = _step(ref, x, dy, no_native=True, rec=rec)
    assert calls["native"] == 2 and y.grad_fn.name() == "TeLinearFp8Backward"
    assert (got[3] is not None) == bias
    for g, w in zip(got, want):
        assert _equal(g, w)
    with torch.no_grad(), te.autocast(recipe=rec):
        outs = [layer(x) for _ in range(3)]  # the first builds the no-grad memo entry
    with torch.no_grad(), te.autocast(recipe=rec), _NoNative():
        assert all(torch.equal(o, ref(x)) for o in outs)
    assert calls["native"] == 4


@pytest.mark.parametrize("rec", [NVFP4, NVFP4_PLAIN], ids=["nvfp4", "nvfp4_plain"])
def test_native_nvfp4_three_kernel_gemms_equal_python(ext, calls, rec, monkeypatch):
    """The products above are small enough for the one-kernel NVFP4 GEMM
    (``cuda_gemm.nvfp4_fused``); with that limit at 0 both paths take the
    three kernels (dequantize, torch's GEMM, epilogue) and still agree."""
    from transformer_engine_compile.quantization import cuda_gemm
    monkeypatch.setattr(cuda_gemm, "NVFP4_FUSED_MAX", 0)
    test_native_block_mxfp8_nvfp4_equal_python_bit_for_bit(
        ext, calls, (2, 128, 256), 256, True, torch.bfloat16, True, rec)


@pytest.mark.parametrize("rec", [REC, BLOCK, MX], ids=["fp8_current", "fp8_block", "mxfp8"])
def test_native_under_torch_autocast_with_fp32_parameters(ext, calls, rec):
    """Mixed precision with fp32 parameters: torch.autocast casts W and the
    bias to bf16 every call; the native node's gradients flow through those
    casts into the fp32 parameters, bit for bit the Python path's."""
    _skip_block(rec)
    torch.manual_seed(5)
    layer = te.Linear(256, 384, bias=True, params_dtype=torch.float32, device="cuda")
    ref = _python_only(layer)
    x = torch.randn(2, 128, 256, device="cuda")
    results = []
    for m, off in ((layer, False), (ref, True)):
        with (_NoNative() if off else _Null()):
            for _ in range(3):
                m.zero_grad(set_to_none=True)
                xx = x.clone().requires_grad_(True)
                with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(recipe=rec):
                    y = m(xx)
                y.float().square().sum().backward()
        results.append((y.grad_fn.name(), y.detach(), xx.grad, m.weight.grad, m.bias.grad))
    assert calls["native"] == 2 and results[0][0] == "TeLinearFp8Backward"
    assert results[0][1].dtype == torch.bfloat16 and results[0][3].dtype == torch.float32
    for got, want in zip(results[0][1:], results[1][1:]):
        assert torch.equal(got, want)


def _delayed_state(m):
    return {n: b.clone() for n, b in m.named_buffers() if "fp8_" in n}


@pytest.mark.parametrize("bias,hist,fmt,x_grad",
                         [(False, 1024, "HYBRID", True), (True, 16, "E4M3", False),
                          (False, 4096, "HYBRID", True)], ids=str)
def test_native_delayed_scaling_equals_python_with_its_state(ext, calls, bias, hist, fmt,
                                                             x_grad):
    """DelayedScaling: the casts with the layer's scales record their amaxes
    and run the step over the layer's histories in place (a history of 4096
    rows: the step is a launch of its own), as the Python path's kernels do:
    outputs, gradients, AdamW steps and the state buffers after every step
    equal the Python path's bit for bit."""
    torch.manual_seed(6)
    rec = R.DelayedScaling(fp8_format=getattr(R.Format, fmt), amax_history_len=hist,
                           amax_compute_algo="max" if hist > 16 else "most_recent", margin=1)
    model = _two_layers(bias)
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16) * 4
    for step in range(5):
        results = []
        for m, opt, off in ((model, opts[0], False), (ref, opts[1], True)):
            xx = x.clone().requires_grad_(x_grad)
            with (_NoNative() if off else _Null()), te.autocast(recipe=rec):
                y = m(xx)
                loss = y.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            results.append((y.grad_fn.name(), loss.item(), xx.grad, _delayed_state(m)))
        assert results[0][1] == results[1][1], step
        assert _equal(results[0][2], results[1][2])
        assert results[0][3].keys() == results[1][3].keys() and results[0][3]
        for name, t in results[0][3].items():
            assert torch.equal(t, results[1][3][name]), (step, name)
    assert results[0][0] == "TeLinearFp8Backward" and results[1][0] != "TeLinearFp8Backward"
    assert calls["native"] == 8  # steps 2-5, two layers
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_native_delayed_scaling_follows_replaced_state(ext, calls):
    """A state reset (new buffers) is seen: the memo and its plan are
    rebuilt, and the new buffers are the ones updated."""
    rec = R.DelayedScaling()
    layer = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=rec):
        for _ in range(3):
            layer(x).sum().backward()
    assert calls["native"] == 2
    fresh = torch.ones_like(layer.fp8_scale_fwd)
    layer.register_buffer("fp8_scale_fwd", fresh, persistent=False)
    with te.autocast(recipe=rec):
        for _ in range(3):
            layer(x).sum().backward()
    assert calls["native"] == 4 and layer.fp8_scale_fwd is fresh
    assert not torch.equal(fresh, torch.ones_like(fresh))  # the steps wrote it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,out,x_grad,bias_grad",
                         [((256, 512), 384, True, True), ((2, 128, 256), 512, False, True),
                          ((128, 256), 256, True, False)], ids=str)
def test_native_bias_equals_python_bit_for_bit(ext, calls, shape, out, x_grad, bias_grad, dtype):
    """The bias is added in the forward GEMM's epilogue and its gradient
    summed by the column-sum kernels, as on the Python path."""
    torch.manual_seed(3)
    layer = te.Linear(shape[-1], out, bias=True, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        layer.bias.normal_()
    layer.bias.requires_grad_(bias_grad)
    ref = _python_only(layer)
    x = torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(x_grad)
    dy = torch.randn((*shape[:-1], out), device="cuda", dtype=dtype)
    got, y = _step(layer, x, dy)
    want, y_ref = _step(ref, x, dy, no_native=True)
    assert calls["native"] == 2 and y.grad_fn.name() == "TeLinearFp8Backward"
    assert (got[3] is not None) == bias_grad
    for g, w in zip(got, want):
        assert _equal(g, w)
    # only the bias trains: the node sums dy and quantizes nothing
    layer.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    if bias_grad:
        x2 = x.detach()
        got2, _ = _step(layer, x2, dy)
        want2, _ = _step(ref, x2, dy, no_native=True)
        assert got2[1] is None and got2[2] is None
        assert torch.equal(got2[3], want2[3]) and torch.equal(got2[0], want2[0])


def test_native_no_grad_and_frozen_weight(ext, calls):
    layer = te.Linear(512, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ref = _python_only(layer)
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=REC):
        outs = [layer(x) for _ in range(3)]
    with torch.no_grad(), te.autocast(recipe=REC), _NoNative():
        want = ref(x)
    assert calls["native"] == 2 and all(torch.equal(o, want) for o in outs)
    layer.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    got, _ = _step(layer, xg, dy)
    want2, _ = _step(ref, xg, dy, no_native=True)
    assert got[2] is None and all(_equal(g, w) for g, w in zip(got, want2))


def test_native_saved_tensors_go_through_hooks(ext, calls):
    layer = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=REC):
        layer(x), layer(x)  # memo, plan
    packed = []

    def pack(t):
        packed.append((str(t.dtype), tuple(t.shape)))
        return t.cpu()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.cuda()):
        with te.autocast(recipe=REC):
            y = layer(x)
    assert y.grad_fn.name() == "TeLinearFp8Backward"
    assert sorted(packed) == sorted([("torch.float8_e4m3fn", (256, 64)), ("torch.float32", (1,)),
                                     ("torch.float8_e4m3fn", (256, 256)),
                                     ("torch.float32", (1,))])
    y.sum().backward()
    ref = _python_only(layer)
    x2 = x.detach().requires_grad_(True)
    with te.autocast(recipe=REC), _NoNative():
        ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, ref.weight.grad)


def test_native_checkpoint_retain_graph_and_double_backward(ext, calls):
    layer = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=REC):
        layer(x), layer(x)
        y = layer(x)
    y.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    y.sum().backward()  # the saved tensors were kept
    assert torch.equal(x.grad, 2 * g1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    x.grad = None
    with te.autocast(recipe=REC):
        y = layer(x)
    dy = torch.ones_like(y, requires_grad=True)  # a tracked incoming gradient
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    assert torch.equal(gx, g1) and gx.requires_grad
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()
    # non-reentrant activation checkpointing (saved-tensor hooks) recomputes natively
    x.grad = None
    with te.autocast(recipe=REC):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    y.sum().backward()
    assert torch.equal(x.grad, g1)


# activation checkpointing of each kind, as ``ckpt(module, x)``
_CHECKPOINTS = {
    "te": lambda f, x: te.checkpoint(f, x),
    "torch": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False),
    "torch_reentrant": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)}


@pytest.mark.parametrize("rec", [REC, MX, "delayed"], ids=["fp8_current", "mxfp8", "delayed"])
@pytest.mark.parametrize("how", ["te", "torch", "torch_reentrant"])
def test_native_inside_activation_checkpointing(ext, calls, how, rec):
    """te.checkpoint and torch's checkpoint (non-reentrant and reentrant)
    run the layers natively in the forward and in the recomputation (which
    repeats its forward's path: the non-reentrant checkpoint checks that it
    saves the same tensors); the reentrant forward runs without grad, its
    recomputation with, and the memo keeps both entries.  Under
    DelayedScaling the recomputation runs on the forward's recorded scales
    and discards its own update.  Gradients and the layers' state equal the
    Python path's."""
    if rec == "delayed":
        rec = R.DelayedScaling(amax_history_len=8, amax_compute_algo="max")
    torch.manual_seed(7)
    model = _two_layers(True)
    ref = copy.deepcopy(model)
    ckpt = _CHECKPOINTS[how]
    x0 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    results, held = [], []
    for m, off in ((model, False), (ref, True)):
        with (_NoNative() if off else _Null()):
            for _ in range(3):
                m.zero_grad(set_to_none=True)
                y = x = None
                x = x0.clone().requires_grad_(True)
                base = torch.cuda.memory_allocated()
                with te.autocast(recipe=rec):
                    y = ckpt(m, x)
                after = torch.cuda.memory_allocated()
                y.float().square().sum().backward()
        held.append(after - base)  # the last step's forward: the output, nothing saved
        results.append((y.detach(), x.grad, *(p.grad for p in m.parameters()),
                        *_delayed_state(m).values()))
    assert held[0] == held[1]
    assert len(results[0]) == 6 + (8 if isinstance(rec, R.DelayedScaling) else 0)
    # two layers, a forward and a recomputation per step: the first step's
    # forwards build their memo entries in Python, and a recomputation takes
    # its forward's path, so steps 2 and 3 run natively.  The non-reentrant
    # checkpoint stops its recomputation inside the last layer's call, as
    # soon as that call has saved the last tensor the forward saved (torch's
    # early stop raises from the saved-tensor hook), so that call is not
    # counted as returning
    assert calls["native"] == (8 if how == "torch_reentrant" else 6)
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_native_serves_alternating_train_and_eval_calls(ext, calls):
    layer = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        with te.autocast(recipe=REC):
            layer(x).sum().backward()
            with torch.no_grad():
                layer(x)
    assert calls["native"] == 4 and len(_memo_native(layer)) == 2


@pytest.mark.parametrize("bias,rec", [(False, REC), (True, REC), (False, BLOCK), (True, MX)],
                         ids=["no_bias", "bias", "block", "mxfp8"])
def test_native_training_with_optimizer_matches_python(ext, calls, bias, rec):
    _skip_block(rec)
    torch.manual_seed(1)
    model = _two_layers(bias)
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    x = torch.randn(4, 32, 256, device="cuda", dtype=torch.bfloat16)
    for step in range(4):
        losses = []
        for m, opt, off in ((model, opts[0], False), (ref, opts[1], True)):
            with (_NoNative() if off else _Null()), te.autocast(recipe=rec):
                loss = m(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert losses[0] == losses[1], step
    assert calls["native"] == 6  # steps 2-4, two layers
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_native_non_contiguous_input_and_inplace_output(ext, calls):
    layer = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ref = _python_only(layer)
    big = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    x = big[:, 128:384]  # not contiguous
    outs = []
    for m, off in ((layer, False), (ref, True)):
        with (_NoNative() if off else _Null()), te.autocast(recipe=REC):
            for _ in range(3):
                xx = x.detach().requires_grad_(True)
                y = m(xx)
                y.mul_(2)  # in place on the output
                y.sum().backward()
        outs.append((y.detach(), xx.grad, m.weight.grad))
    assert calls["native"] == 2
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_native_declines_what_it_does_not_cover(ext, calls):
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # an fp32 bias (the Python path adds it with its own kernel after the GEMM)
    x32 = x.float().detach().requires_grad_(True)
    layer = te.Linear(256, 256, bias=True, params_dtype=torch.float32, device="cuda")
    with te.autocast(recipe=REC):
        for _ in range(3):
            layer(x32).sum().backward()
    assert _memo_native(layer) == [False]
    x128 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def bf16(bias=False, out=256, **kw):
        return te.Linear(256, out, bias=bias, params_dtype=torch.bfloat16, device="cuda", **kw)

    for layer, rec, inp in ((bf16(True, save_original_input=True), REC, x),
                            (bf16(out=200), REC, x),  # N not a multiple of 16
                            (bf16(), BLOCK, x),  # 64 rows: not a multiple of 128
                            # 40 rows: NVFP4's columnwise copies pad them to 48
                            (bf16(), NVFP4, x128[:40].detach().requires_grad_())):
        with te.autocast(recipe=rec):
            for _ in range(3):
                layer(inp).sum().backward()
        assert _memo_native(layer) == [False]
    assert calls["native"] == 0


@pytest.mark.parametrize("rec,rec2", [(REC, REC), (BLOCK, BLOCK), (MX, MX), (NVFP4, REC)],
                         ids=["fp8_current", "fp8_block", "mxfp8", "nvfp4_then_fp8_current"])
def test_native_node_takes_a_quantized_gradient_through_the_python_path(ext, calls, rec, rec2):
    """fc2's fp8_grad hands fc1's native node a quantized dy (a tensor
    subclass): the node runs the Python path's backward on its saved copies
    (NVFP4's with their amaxes), which uses that dy as it is where fc2
    quantized it in fc1's format, else dequantizes it first (fc2 under
    current scaling after an NVFP4 fc1), as the Python path does."""
    _skip_block(rec)
    torch.manual_seed(2)
    fc1 = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    fc2 = te.Linear(512, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ref1, ref2 = _python_only(fc1), _python_only(fc2)
    x0 = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for (a, b), off in (((fc1, fc2), False), ((ref1, ref2), True)):
        torch.cuda.manual_seed(5)  # NVFP4's stochastic rounding of dy
        with (_NoNative() if off else _Null()):
            for _ in range(3):
                x = x0.clone().requires_grad_(True)
                a.weight.grad = b.weight.grad = None
                with te.autocast(recipe=rec):
                    h = a(x)
                with te.autocast(recipe=rec2):
                    y = b(h, fp8_grad=True)
                y.float().pow(2).sum().backward()
        results.append((h.grad_fn.name(), y.detach(), x.grad, a.weight.grad, b.weight.grad))
    assert results[0][0] == "TeLinearFp8Backward" and results[1][0] != "TeLinearFp8Backward"
    for got, want in zip(results[0][1:], results[1][1:]):
        assert torch.equal(got, want)


def test_empty_many_allocates_like_torch_empty(ext):
    """The op impls' batched allocation (native_alloc.cpp): each spec its own
    contiguous tensor of that shape and dtype on the input's device, no two
    sharing storage; bad specs raise; the Python helper uses it on CUDA and
    torch.empty elsewhere."""
    from transformer_engine_compile.kernels import native
    like = torch.empty(3, device="cuda", dtype=torch.bfloat16)
    specs = (((256, 128), torch.float8_e4m3fn), ((1,), torch.float32), ((0, 4), torch.uint8),
             ((2, 3, 5), torch.bfloat16), ((), torch.int32))
    out = ext.empty_many(like, *specs)
    assert isinstance(out, tuple) and len(out) == len(specs)
    for t, (shape, dtype) in zip(out, specs):
        assert (t.shape, t.dtype, t.device, t.is_contiguous(), t.requires_grad) == (
            torch.Size(shape), dtype, like.device, True, False)
    ptrs = [t.untyped_storage().data_ptr() for t in out if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    assert all(p % 16 == 0 for p in ptrs)  # the launch keys assume aligned outputs
    assert ext.empty_many(like) == ()
    for bad in ((((2, 2), "float32"),), (([2, 2], torch.float32),), (((2, -1), torch.float32),),
                ((2, torch.float32),)):
        with pytest.raises((TypeError, RuntimeError)):
            ext.empty_many(like, *bad)
    calls = []
    real = ext.empty_many
    try:
        ext.empty_many = lambda *a: calls.append(a) or real(*a)
        got = native.empty_many(like, ((4, 4), torch.uint8))
        assert len(calls) == 1 and got[0].shape == (4, 4) and got[0].is_cuda
        (cpu,) = native.empty_many(torch.empty(1), ((4, 4), torch.uint8))
        assert len(calls) == 1 and cpu.device.type == "cpu"
    finally:
        ext.empty_many = real


def test_native_node_as_the_engine_threads_first_cuda_work():
    """The autograd engine's device thread has no current CUDA context until
    CUDA work makes one current; a native node whose driver launches are
    that first work makes the device's primary context current itself (the
    process crashed before).  A fresh process, so nothing ran there yet."""
    script = textwrap.dedent("""
        import torch
        import transformer_engine_compile as te
        from transformer_engine_compile import recipe as R
        from transformer_engine_compile.kernels import native
        assert native.extension(wait=True) is not None
        layer = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=R.Float8CurrentScaling()):
            layer(x)  # the Python path (its graph never runs backward)
            y = layer(x)  # native: its node is the engine's first work
        assert y.grad_fn.name() == "TeLinearFp8Backward", y.grad_fn.name()
        y.float().sum().backward()
        assert torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("rec", [REC, BLOCK], ids=["fp8_current", "fp8_block"])
def test_native_layers_reading_one_input_quantize_it_once(ext, calls, monkeypatch, rec):
    """q, k and v on one input, natively: the first call's x copies serve
    the other two (native_linear.cpp's shared_x), which quantize W alone.
    Outputs and gradients equal those of native calls that each quantize
    x, and of the Python path, bit for bit; the forward keeps one x's
    copies instead of three."""
    from transformer_engine_compile.dynamo import shared_inputs
    _skip_block(rec)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(te.Linear(512, 256, bias=False, params_dtype=torch.bfloat16,
                                           device="cuda") for _ in range(3))
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dys = [torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def step(model, share, no_native=False):
        monkeypatch.setattr(shared_inputs, "EAGER", share)
        with _NoNative() if no_native else _Null():
            for _ in range(3):  # the third call: memo and plans made
                model.zero_grad(set_to_none=True)
                h = x.clone().requires_grad_()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                with te.autocast(recipe=rec):
                    ys = [layer(h) for layer in model]
                held = torch.cuda.memory_allocated() - before
                names = [y.grad_fn.name() for y in ys]
                torch.autograd.backward(ys, dys)
        return [*(y.detach() for y in ys), h.grad, *(l.weight.grad for l in model)], names, held

    unshared_layers, python_layers = copy.deepcopy(layers), _python_only(layers)  # no plans yet
    shared, names, held = step(layers, True)
    assert calls["native"] == 6 and names == ["TeLinearFp8Backward"] * 3
    apart, _, held_apart = step(unshared_layers, False)
    python, names_py, _ = step(python_layers, True, no_native=True)
    assert "TeLinearFp8Backward" not in names_py
    for a, b, c in zip(shared, apart, python):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert held_apart - held >= 256 * 512  # at least one x-sized FP8 copy fewer
