"""The run-time-compiled kernel mechanism (kernels/runner.py) with a
stand-in kernel family on CPU: one build per configuration value, the fake
never builds, compiled fullgraph without recompiling for equal
configurations, opcheck-clean, copies of a model share runners, no build
while a CUDA graph is captured."""

import copy

import pytest
import torch

from transformer_engine_compile.kernels import runner as K

pytestmark = pytest.mark.skipif(K.RUN_KERNEL is None, reason="no opaque objects in this torch")


class StandIn(K.RunnerKind):
    """``y = scale * x @ w^T``, "compiled" by closing over the scale."""

    name = "standin_scaled_mm"
    builds = []

    def build(self, config):
        StandIn.builds.append(config)
        scale = config.as_dict()["scale"]
        return lambda inputs: [scale * (inputs[0] @ inputs[1].t())]

    def fake(self, config, inputs):
        x, w = inputs
        return [x.new_empty(x.shape[0], w.shape[0])]


class Missing(K.RunnerKind):
    name = "standin_missing"

    def unavailable(self):
        return "nvidia-cutlass-dsl is not installed"


K.RUNNERS.register(StandIn())
K.RUNNERS.register(Missing())


def _config(scale=2.0, tile=(128, 128)):
    return K.KernelConfig.make("standin_scaled_mm", scale=scale, tile=tile)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randn(4, 16, generator=g)


def test_one_build_per_configuration_value():
    x, w = _inputs()
    before = len(StandIn.builds)
    cfg = _config(scale=3.0)
    (y,) = K.run_kernel(cfg, [x, w])
    torch.testing.assert_close(y, 3.0 * x @ w.t())
    K.run_kernel(_config(scale=3.0), [x, w])  # an equal configuration: the same runner
    assert len(StandIn.builds) == before + 1
    K.run_kernel(_config(scale=3.0, tile=(64, 128)), [x, w])
    assert len(StandIn.builds) == before + 2


def test_the_fake_never_builds():
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = len(StandIn.builds)
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(_inputs()[0]), mode.from_tensor(_inputs()[1])
        (y,) = K.run_kernel(_config(scale=5.0), [x, w])
    assert y.shape == (8, 4) and len(StandIn.builds) == before


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_recompiles_only_for_another_configuration(backend):
    torch._dynamo.reset()
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward

    @torch.compile(fullgraph=True, backend=counting)
    def f(x, w, cfg):
        return K.run_kernel(cfg, [x + 1, w])[0].relu()

    x, w = _inputs()
    for cfg in (_config(scale=7.0), _config(scale=7.0)):  # equal values, two objects
        torch.testing.assert_close(f(x, w, cfg), (7.0 * (x + 1) @ w.t()).relu())
    assert len(compiles) == 1
    f(x, w, _config(scale=0.5))
    assert len(compiles) == 2


def test_opcheck():
    x, w = _inputs()
    torch.library.opcheck(K.RUN_KERNEL, ([x, w], _config(scale=1.5)))


def test_copies_of_a_model_share_runners():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(_inputs()[1])
            self.config = _config(scale=9.0)

        def forward(self, x):
            return K.run_kernel(self.config, [x, self.weight])[0]

    layer = Layer()
    x = _inputs()[0]
    y = layer(x)
    before = len(StandIn.builds)
    clone = copy.deepcopy(layer)
    assert clone.config == layer.config and clone.config is not layer.config
    torch.testing.assert_close(clone(x), y)
    assert len(StandIn.builds) == before


def test_no_build_while_a_cuda_graph_is_captured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run the step once before capturing"):
        K.RUNNERS.runner_for(_config(scale=11.0))


def test_unavailable_family_and_bad_values_say_why():
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl is not installed"):
        K.run_kernel(K.KernelConfig.make("standin_missing"), list(_inputs()))
    with pytest.raises(KeyError, match="no kernel family 'nope'"):
        K.run_kernel(K.KernelConfig.make("nope"), list(_inputs()))
    with pytest.raises(TypeError, match="is not a plain value"):
        K.KernelConfig.make("standin_scaled_mm", dtype=torch.float8_e4m3fn)
    cfg = _config()
    code, globals_ = cfg.__fx_repr__()
    assert eval(code, globals_) == cfg  # the FX graph cache rebuilds it by value
