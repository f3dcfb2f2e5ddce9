"""Fixtures of the native eager path's GPU tests (test_gpu_native*.py)."""

import pytest
import torch


@pytest.fixture(scope="module")
def ext():
    """The native extension (built now if need be); skips where it cannot be."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from transformer_engine_compile.kernels import native
    ext = native.extension(wait=True)
    if ext is None:
        pytest.skip(f"native extension not built: {native._state['failed']}")
    return ext


@pytest.fixture
def calls(monkeypatch):
    """Counts the linear calls the native path ran (a plan that declines is
    not counted)."""
    from transformer_engine_compile.module import linear_native
    n = {"native": 0}
    real = linear_native.NativeLinear.__call__

    def counted(self, layer, x, w, bias):
        out = real(self, layer, x, w, bias)
        n["native"] += out is not None
        return out

    monkeypatch.setattr(linear_native.NativeLinear, "__call__", counted)
    return n
