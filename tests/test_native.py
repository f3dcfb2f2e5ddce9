"""The native eager path's CPU-side logic (kernels/native.py,
module/linear/native.py): launch descriptions from a compiled kernel's
signature, and the Python path kept where no plan applies.  The C++ side
runs in tests/gpu/test_gpu_native.py."""

from types import SimpleNamespace

import pytest
import torch

import transformer_engine_compile as te
from transformer_engine_compile import recipe as R
from transformer_engine_compile.kernels import native


class _Ext:
    """Stands in for the built module: the driver's parameter layout and
    the launch description it would be given."""

    def __init__(self, layout):
        self.layout = layout

    def param_info(self, function):
        return self.layout

    def make_launch(self, function, grid, threads, shared, scratch, kinds, ints, floats):
        return dict(function=function, grid=grid, threads=threads, shared=shared,
                    scratch=scratch, kinds=kinds, ints=ints, floats=floats)


def _launcher(signature, **metadata):
    md = dict(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
              launch_pdl=False, num_ctas=1, num_warps=8, shared=16384)
    md.update(metadata)
    compiled = SimpleNamespace(function=77, src=SimpleNamespace(signature=signature),
                               metadata=SimpleNamespace(**md))
    return SimpleNamespace(handles={(0, "k"): SimpleNamespace(compiled=compiled)})


_SIG = {"a_ptr": "*bf16", "M": "i32", "one": "constexpr", "big": "i64", "lo": "i32",
        "hi": "i32", "out": "*fp8e4nv", "scale": "fp32", "BM": "constexpr"}


def _args(a, out):
    return (a, 256, 1, 2 ** 40, 5, 6, out, 0.5, 64)


def test_launch_spec_packs_the_signature():
    a, out = torch.zeros(4), torch.zeros(4)
    layout = [(0, 8), (8, 4), (16, 8), (24, 4), (28, 4), (32, 8), (40, 4), (48, 8), (56, 8)]
    spec = native.launch_spec(_Ext(layout), _launcher(_SIG), 0, (12,), "k", _args(a, out),
                              [a, torch.zeros(1), out])
    assert spec["kinds"] == [0, 1, 2, 4, 5, 0, 3]  # constexprs skipped; lo/hi per call
    assert spec["ints"] == [0, 256, 2 ** 40, 0, 0, 2, 0]  # tensors by identity: slots 0, 2
    assert spec["floats"][-1] == 0.5
    assert spec["grid"] == [12, 1, 1] and spec["threads"] == 256 and spec["scratch"] == 2


def test_launch_spec_refuses_what_it_cannot_launch():
    a, out = torch.zeros(4), torch.zeros(4)
    good = [(0, 8), (8, 4), (16, 8), (24, 4), (28, 4), (32, 8), (40, 4), (48, 8), (56, 8)]
    args = _args(a, out)
    assert native.launch_spec(_Ext(good), _launcher(_SIG), 0, (1,), "k", args, [a, out]) is not None
    # a layout the packing disagrees with (an i32 where it packs an i64)
    bad = good[:2] + [(16, 4)] + good[3:]
    assert native.launch_spec(_Ext(bad), _launcher(_SIG), 0, (1,), "k", args, [a, out]) is None
    # scratch memory, cluster launches, a tensor not among the slots, no compiled kernel
    for md in ({"global_scratch_size": 64}, {"num_ctas": 2}, {"launch_pdl": True}):
        assert native.launch_spec(_Ext(good), _launcher(_SIG, **md), 0, (1,), "k", args,
                                  [a, out]) is None
    assert native.launch_spec(_Ext(good), _launcher(_SIG), 0, (1,), "k", args, [a]) is None
    assert native.launch_spec(_Ext(good), _launcher(_SIG), 0, (1,), "other", args, [a, out]) is None
    odd = dict(_SIG, M="fp16")
    assert native.launch_spec(_Ext(good), _launcher(odd), 0, (1,), "k", args, [a, out]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_no_extension_without_cuda():
    assert native.extension() is None
    assert native._state["thread"] is None  # nothing was built


@pytest.mark.parametrize("rec", [R.Float8CurrentScaling(), None], ids=["fp8_current", "bf16"])
def test_cpu_layer_records_no_plan_and_keeps_its_results(rec):
    torch.manual_seed(0)
    layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32)
    x = torch.randn(16, 64, requires_grad=True)
    outs = []
    for _ in range(3):
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = layer(x)
        outs.append(y.detach())
    assert all(torch.equal(o, outs[0]) for o in outs)
    if rec is not None:  # bias-free bf16 runs F.linear: no memo at all
        (template,) = layer._args_memo[1].values()
        assert template.native is False  # asked once, at the second call


def test_switching_the_native_path_off_stops_existing_plans(monkeypatch):
    """``native.ENABLED = False`` (as ``TE_COMPILE_NATIVE=0`` at import) also
    stops the plans memo entries already hold: the Python path runs again,
    and on again runs the plan (a stand-in here: no CUDA)."""
    torch.manual_seed(0)
    layer = te.Linear(64, 32, bias=False, params_dtype=torch.float32)
    x = torch.randn(16, 64)
    rec = R.Float8CurrentScaling()
    with te.autocast(recipe=rec):
        want = layer(x)
        (template,) = layer._args_memo[1].values()
        marker = torch.full((16, 32), 7.0)
        template.native = lambda lay, *tensors: {"out": marker}
        assert layer(x) is marker
        monkeypatch.setattr(native, "ENABLED", False)
        assert torch.equal(layer(x), want)
        monkeypatch.setattr(native, "ENABLED", True)
        assert layer(x) is marker


def test_fused_planners_say_the_extension_is_still_building(monkeypatch):
    """While the extension builds in the background, ``plan_for`` answers
    ``...`` (ask again later); the fused modules' planners pass that on
    instead of reading a plan from it (a fresh machine's first
    te.LayerNormLinear / te.LayerNormMLP calls used to fail so)."""
    from transformer_engine_compile.module.layernorm import linear_native as lln
    from transformer_engine_compile.module.layernorm import mlp_native as lmn
    asked = []

    def still_building(args, given_x=False, plain=False):
        asked.append(plain)
        return ...

    for mod in (lln, lmn):
        monkeypatch.setattr(mod, "norm_eligible", lambda args: True)
        monkeypatch.setattr(mod, "plan_for", still_building)
    monkeypatch.setattr(lmn.kernels, "has_fast", lambda *names: True)
    monkeypatch.setattr(native, "ENABLED", True)
    assert lln.plan_for_layernorm_linear(SimpleNamespace(amax_history_fwd=None)) is ...
    mlp_args = SimpleNamespace(inp=torch.zeros(2, 2),
                               gemm=lambda prefix, x: SimpleNamespace(amax_history_fwd=None))
    assert lmn.plan_for_layernorm_mlp(mlp_args) is ...
    # their first GEMM asks for a plan without a recipe too (bf16: the plain plan)
    assert asked == [True, True]


def test_empty_many_off_cuda_is_torch_empty():
    """The op impls' batched allocation keeps ``torch.empty`` where the C++
    call does not apply (CPU tensors; the C++ side: tests/gpu/test_gpu_native.py)."""
    like = torch.zeros(2, dtype=torch.float16)
    a, b = native.empty_many(like, ((3, 4), torch.uint8), ((1,), torch.float32))
    assert (a.shape, a.dtype, a.device) == ((3, 4), torch.uint8, like.device)
    assert (b.shape, b.dtype) == ((1,), torch.float32)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert native.empty_many(like) == ()


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """torch's loader waits forever while its lock file exists; one left by a
    process killed mid-build (older than any build) goes, a live build's stays."""
    import os
    import time
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    assert not native._clear_stale_lock()  # no lock: nothing to do
    lock.write_text("")
    assert not native._clear_stale_lock() and lock.exists()  # a build under way
    old = time.time() - native._STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert native._clear_stale_lock() and not lock.exists()


def test_exit_waits_for_a_running_build(monkeypatch, capsys):
    """The build thread is a daemon: at exit a running build is let finish
    (so it leaves no lock file), and a finished or absent one costs nothing."""
    import threading
    release, done = threading.Event(), []
    thread = threading.Thread(target=lambda: (release.wait(5), done.append(1)), daemon=True)
    monkeypatch.setitem(native._state, "thread", thread)
    thread.start()
    threading.Timer(0.2, release.set).start()
    native._finish_build_at_exit()
    assert done == [1] and not thread.is_alive()
    assert "finishing the native extension's build" in capsys.readouterr().err
    native._finish_build_at_exit()  # finished: returns at once, says nothing
    assert capsys.readouterr().err == ""
