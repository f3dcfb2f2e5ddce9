"""FSDP2 (``fully_shard``) with te layers on CPU: 2 gloo processes per test.

The training cases live in fsdp_harness.py (shared with the 2-GPU NCCL run
in qa/L1_distributed).  Worker functions are module level so that
``torch.multiprocessing.spawn`` can pickle them.
"""

import pytest
import torch

import transformer_engine_compile as te

import fsdp_harness as F
import tp_harness as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


def cases_worker(group, names, backend):
    for name in names:
        F.run_case(group, name, torch.device("cpu"), backend)


@pytest.mark.parametrize("names", [("fp8_current",), ("fp8_block",), ("bf16", "delayed"),
                                   ("mxfp8", "nvfp4")], ids="-".join)
def test_fsdp_training_equals_single_process(names):
    """Quantized gather == high-precision gather == compiled, bit for bit;
    single process within the format's error; bytes; delayed scales."""
    H.spawn(cases_worker, names, "aot_eager")


# -- meta-device initialisation, distributed checkpointing ----------------------------------
def _delayed_step(model, group):
    rec = F.recipe_of("delayed")
    x = torch.randn(16, F.IN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with te.autocast(recipe=rec, amax_reduction_group=group):
        y = model(x.chunk(2)[torch.distributed.get_rank(group)])
    y.float().pow(2).mean().backward()


def meta_and_dcp_worker(group, path):
    import torch.distributed.checkpoint as dcp

    rec = F.recipe_of("fp8_current")
    # meta-device init: wrap, shard, to_empty, reset_parameters
    model = F.shard(F.build("meta"), rec, True)
    assert isinstance(model[2].weight._local_tensor, te.fsdp.QuantizedAllGatherWeight)
    model.to_empty(device="cpu")
    for layer in model:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    w = model[2].weight.full_tensor().float()
    bound = 1 / F.HID ** 0.5  # torch.nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in))
    assert w.abs().max() <= bound and abs(w.std().item() - bound / 3 ** 0.5) < 0.1 * bound
    # distributed checkpoint: plain tensors in, the same weights and layer state out
    model = F.shard(F.build("cpu"), rec, True)
    plain = F.shard(F.build("cpu"), None, False)  # DelayedScaling state to carry too
    _delayed_step(plain, group)
    state = {"model": model.state_dict(), "plain": plain.state_dict()}
    assert type(state["model"]["2.weight"]._local_tensor) is torch.Tensor
    dcp.save(state, checkpoint_id=path)
    torch.manual_seed(123)
    model2 = F.shard(F.build("cpu"), rec, True)
    plain2 = F.shard(F.build("cpu"), None, False)
    for m in (model2, plain2):
        for p in m.parameters():
            p.data.add_(1.0) if not isinstance(p._local_tensor, te.fsdp.QuantizedAllGatherWeight) \
                else p._local_tensor._inner.add_(1.0)
    state2 = {"model": model2.state_dict(), "plain": plain2.state_dict()}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # plain2 has not run: empty extra state
        dcp.load(state2, checkpoint_id=path)
    dcp.load(te.fsdp.fit_extra_state(state2, path), checkpoint_id=path)
    model2.load_state_dict(state2["model"])
    plain2.load_state_dict(state2["plain"])
    for a, b in ((model, model2), (plain, plain2)):
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), n
    assert isinstance(model2[2].weight._local_tensor, te.fsdp.QuantizedAllGatherWeight)
    for layer, layer2 in zip(plain, plain2):
        if isinstance(layer, te.Linear):
            assert layer.get_extra_state().numel() > 0
            assert torch.equal(layer.get_extra_state(), layer2.get_extra_state())


def test_fsdp_meta_init_and_distributed_checkpoint(tmp_path):
    H.spawn(meta_and_dcp_worker, str(tmp_path / "ckpt"))


# -- the gather format is fixed: other recipes ---------------------------------------------
def other_recipe_worker(group):
    model = F.shard(F.build("cpu"), F.recipe_of("fp8_current"), True)
    x = torch.randn(8, F.IN, dtype=torch.bfloat16)
    with te.autocast(recipe=F.recipe_of("mxfp8")):
        with pytest.raises(RuntimeError, match="gathers it so for the recipe"):
            model(x)
    with torch.no_grad():  # validation without a recipe reads the dequantized weight
        y = model(x)
    reference = F.build("cpu")
    for layer in reference:  # the weights FSDP2 gathers: quantized, then dequantized
        for name in te.fsdp.gemm_weight_names(layer):
            w = getattr(layer, name)
            q = te.quantizer_for(F.recipe_of("fp8_current"), "weight")
            setattr(layer, name, torch.nn.Parameter(q(w.detach()).dequantize()))
    with torch.no_grad():
        assert torch.equal(y, reference(x))


    # the whole weight's amax: all-reduced, kept until the weight changes
    param = model[2].weight
    local = param._local_tensor
    full_amax = param.full_tensor().abs().max().float()
    amax = local._group_amax(group)
    assert torch.equal(amax, full_amax.reshape(1)) and local._group_amax(group) is amax
    local._inner.mul_(2.0)  # an in-place write to the high-precision values
    assert torch.equal(local._group_amax(group), 2 * amax)
    te.fsdp.precompute_scales(model)
    assert torch.equal(local._amax[1], 2 * amax) and local._amax[0] == local._state()
    # the quantized shard is made once per weight update: precompute made it,
    # the gathers hand the same tensors over
    inputs = local._gather_input[2]
    assert local._shard_inputs(group, torch.bfloat16) is inputs
    # precompute cast every FP8-current shard in one call: the bytes (the
    # shard's shape) and scale this weight's own cast makes
    saved, local._gather_input = local._gather_input, None
    own = local._shard_inputs(group, torch.bfloat16)
    assert own[0][0].shape == inputs[0][0].shape == local._inner.shape
    assert torch.equal(own[0][0], inputs[0][0]) and torch.equal(own[1], inputs[1])
    local._gather_input = saved
    # an optimizer step writes through the wrapper (below autograd, where the
    # inner version counter does not move): the amax and the shard follow it
    opt = torch.optim.SGD([param], lr=1.0, foreach=True)
    param.grad = -param.detach().clone()  # w - lr * grad = 2 w
    version = local._inner._version
    opt.step()
    assert local._inner._version == version  # unseen by the version counter...
    assert torch.equal(local._group_amax(group), 4 * amax)  # ...but seen
    fresh = local._shard_inputs(group, torch.bfloat16)
    assert fresh is not inputs and not torch.equal(fresh[1], inputs[1])  # a new scale


def test_fsdp_other_recipe_refused_with_grad_and_dequantized_without():
    H.spawn(other_recipe_worker)


def one_rank_worker(group):
    """A data-parallel group of one (e.g. the dp dim of a (1, tp) mesh):
    FSDP2 gathers nothing, so the weights stay high precision (torch copies
    only an extension's first gather input for one rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    rec = F.recipe_of("fp8_current")
    model = F.build("cpu")
    te.fsdp.fully_shard(model, recipe=rec, mesh=init_device_mesh("cpu", (1,)),
                        quantized_gather=True)
    assert not any(isinstance(p, te.fsdp.QuantizedAllGatherWeight) for p in model.parameters())
    x = torch.randn(8, F.IN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with te.autocast(recipe=rec):
        model(x).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_fsdp_one_rank_gathers_high_precision():
    H.spawn(one_rank_worker, world_size=1)


# -- which weights gather quantized -----------------------------------------------------------
def test_gather_format():
    from transformer_engine_compile import recipe as R

    fmt = te.fsdp.gather_format
    assert fmt(R.Float8CurrentScaling(), (512, 256), 2) == "fp8_current"
    assert fmt(R.Float8CurrentScaling(), (513, 256), 2) is None  # uneven shards
    assert fmt(R.Float8CurrentScaling(), (512, 256), 1) is None  # one rank: no gather
    assert fmt(R.Float8BlockScaling(), (512, 256), 2) == "fp8_block"
    assert fmt(R.Float8BlockScaling(), (384, 256), 2) is None  # 192-row shards: split blocks
    assert fmt(R.Float8BlockScaling(), (512, 200), 2) is None
    for rec in (None, R.DelayedScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling()):
        assert fmt(rec, (512, 256), 2) is None


def test_quantized_all_gather_wraps_gemm_weights_only_and_copies():
    import copy

    from transformer_engine_compile import recipe as R

    model = F.build("cpu")
    te.fsdp.quantized_all_gather(model, R.Float8CurrentScaling(), world_size=2)
    wrapped = {n for n, p in model.named_parameters()
               if isinstance(p, te.fsdp.QuantizedAllGatherWeight)}
    assert wrapped == {"0.weight", "2.weight", "3.fc1_weight", "3.fc2_weight"}
    state = model.state_dict()
    assert all(type(state[n]) is torch.Tensor for n in wrapped)
    twin = copy.deepcopy(model)
    twin[2].weight._inner.add_(1.0)  # the copy's weight is its own
    assert not torch.equal(twin[2].weight._inner, model[2].weight._inner)
    with pytest.raises(TypeError, match="recipe must be"):
        te.fsdp.quantized_all_gather(model, "fp8")


# -- the transposed copy is made once per step, for the backward ----------------------------
def transpose_worker(group):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from transformer_engine_compile.parallel import fsdp_weight
    from transformer_engine_compile import compat

    rec = F.recipe_of("fp8_current")
    x = torch.randn(8, F.IN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    made = []
    original = fsdp_weight._transpose

    def counted(*args, **kwargs):
        made.append("backward" if compat.in_backward_pass() else "forward")
        return original(*args, **kwargs)

    fsdp_weight._transpose = counted
    try:
        for reshard in (True, False):
            model = F.build("cpu")
            mesh = F.world_mesh()
            for layer in model:
                if any(True for _ in layer.parameters()):
                    te.fsdp.fully_shard(layer, recipe=rec, reshard_after_forward=reshard,
                                        mesh=mesh, quantized_gather=True)
            torch_fully_shard(model, mesh=mesh)
            weights = sum(isinstance(p._local_tensor, te.fsdp.QuantizedAllGatherWeight)
                          for p in model.parameters())
            assert weights == 4, weights
            made.clear()
            with te.autocast(recipe=rec):
                y = model(x)
            y.float().pow(2).mean().backward()
            # resharded after the forward: the backward's gather makes the copy,
            # the forward's does not; kept: the forward's gather makes it once
            assert made == ["backward" if reshard else "forward"] * weights, (reshard, made)
    finally:
        fsdp_weight._transpose = original


def test_fsdp_transposed_copy_made_once_where_the_backward_reads_it():
    H.spawn(transpose_worker)


# -- the high-precision gather keeps no quantized weight copy ------------------------------
def saved_weight_worker(group):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rec = F.recipe_of("fp8_current")
    x = torch.randn(8, F.IN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weight_shapes = {(F.HID, F.IN), (F.IN, F.HID), (2 * F.HID, F.IN)}
    grads = []
    for keep_copy in (False, True):
        model = F.build("cpu")
        mesh = F.world_mesh()
        for layer in model:
            if any(True for _ in layer.parameters()):
                te.fsdp.fully_shard(layer, recipe=rec, mesh=mesh, quantized_gather=False)
        torch_fully_shard(model, mesh=mesh)
        layers = [m for m in model.modules() if te.fsdp.gemm_weight_names(m)]
        assert len(layers) == 3 and all(m.save_original_weight for m in layers)
        for m in layers:
            m.save_original_weight = not keep_copy
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with te.autocast(recipe=rec):
                y = model(x)
        shapes = [(t.dtype, tuple(t.shape)) for t in saved]
        fp8_weights = [s for d, s in shapes if d == torch.float8_e4m3fn
                       and (s in weight_shapes or s[::-1] in weight_shapes)]
        originals = [t for t, (d, s) in zip(saved, shapes)
                     if d == torch.bfloat16 and s in weight_shapes]
        if keep_copy:  # the FP8 columnwise copies, held until the backward
            assert len(fp8_weights) == 4 and not originals, (len(fp8_weights), len(originals))
        else:  # the gathered weights themselves, their storage freed by FSDP2 after the forward
            assert not fp8_weights and len(originals) == 4, (len(fp8_weights), len(originals))
            assert all(t.untyped_storage().size() == 0 for t in originals)
        y.float().pow(2).mean().backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    for a, b in zip(*grads):  # the backward's quantization equals the forward's copy
        assert torch.equal(a, b)


def test_fsdp_high_precision_gather_saves_no_quantized_weight_copy():
    """Under ``te.fsdp.fully_shard``'s high-precision gather the layers save
    the gathered weight for the backward (freed by FSDP2 after the forward,
    gathered again for the backward) instead of an FP8 copy of it, with the
    gradients bit for bit those of the kept copy."""
    H.spawn(saved_weight_worker)


# -- choosing the gather ------------------------------------------------------------------
def gather_choice_worker(group):
    import logging
    import os

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformer_engine_compile.fsdp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    rec = F.recipe_of("fp8_block")
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        quantized, plain, auto = F.build("cpu"), F.build("cpu"), F.build("cpu")
        mesh = F.world_mesh()
        te.fsdp.fully_shard(quantized, recipe=rec, mesh=mesh, quantized_gather=True)
        te.fsdp.fully_shard(plain, recipe=rec, mesh=mesh, quantized_gather=False)
        te.fsdp.fully_shard(auto, recipe=rec, mesh=mesh)  # both ranks on this host
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # as torchrun says with one rank per host
        assert te.fsdp.spans_hosts()
        across = F.build("cpu")
        te.fsdp.fully_shard(across, recipe=rec, mesh=mesh)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        logger.removeHandler(handler)
    assert not te.fsdp.spans_hosts()
    from torch.distributed.device_mesh import init_device_mesh
    hsdp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    assert not te.fsdp.spans_hosts(hsdp)  # HSDP: its shard dim
    formats = te.fsdp.gathered_formats(quantized)
    # 128x128 blocks over 2 ranks: the 256-row weights split into whole blocks
    assert formats == {"0.weight": "fp8_block", "2.weight": "fp8_block",
                       "3.fc1_weight": "fp8_block", "3.fc2_weight": "fp8_block"}, formats
    assert te.fsdp.gathered_formats(across) == formats
    assert set(te.fsdp.gathered_formats(plain).values()) == {"high precision"}
    assert set(te.fsdp.gathered_formats(auto).values()) == {"high precision"}
    head = "te.fsdp.fully_shard(Sequential): GEMM weights gathered "
    said = [r.getMessage() for r in records]
    assert said == [head + "fp8_block 4/4 (quantized_gather=True)",
                    head + "high precision 4/4 (quantized_gather=False)",
                    head + "high precision 4/4 (quantized_gather='auto': one host, where the "
                    "high-precision gather is faster; quantized_gather=True halves its bytes)",
                    head + "fp8_block 4/4 (quantized_gather='auto': the shard group spans "
                    "hosts)"], said
    with pytest.raises(TypeError, match="quantized_gather must be True, False or 'auto'"):
        te.fsdp.fully_shard(F.build("cpu"), recipe=rec, mesh=mesh, quantized_gather="yes")


def test_fsdp_gather_choice_reported():
    H.spawn(gather_choice_worker)


def test_wrapped_weight_copies_forget_the_fsdp_unit():
    """The wrappers of one weight share its update counter and FSDP2 unit;
    a deep copy of the layer gets its own state, with no unit (the copy's
    gathers then make the transposed copy themselves)."""
    import copy

    from transformer_engine_compile import recipe

    layer = te.Linear(256, 256, params_dtype=torch.bfloat16)
    te.fsdp.quantized_all_gather(layer, recipe.Float8CurrentScaling(), world_size=2)
    w = layer.weight
    view = w.detach()  # a view FSDP2 would make: the same shared state
    assert view._shared is w._shared and w._shared.unit() is layer
    with torch.no_grad():
        view.mul_(2.0)  # a write through any wrapper counts for all
    assert w._shared.updates == 1
    clone = copy.deepcopy(layer)
    assert clone.weight._shared is not w._shared and clone.weight._shared.unit() is None
    assert clone.weight._shared.updates == 1


def test_gather_inputs_recorded_once_per_stream(monkeypatch):
    """The gather hooks record a CUDA tensor on each stream that reads it
    once (raw stream ids: no stream object per call); CPU tensors never."""
    from transformer_engine_compile.parallel import fsdp_weight

    class Cuda:  # what _record_once reads of a CUDA tensor
        def __init__(self):
            self.streams = []

        def get_device(self):
            return 0

        def record_stream(self, stream):
            self.streams.append(stream)

    current = ["a"]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[0],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: f"stream {current[0]}")
    t, u = Cuda(), Cuda()
    recorded = fsdp_weight._record_once((t, u), ())
    assert recorded == ("a",) and t.streams == u.streams == ["stream a"]
    assert fsdp_weight._record_once((t, u), recorded) is recorded  # again: nothing
    current[0] = "b"  # the backward's gather runs on another stream
    assert fsdp_weight._record_once((t, u), recorded) == ("a", "b")
    assert t.streams == ["stream a", "stream b"]
    cpu = torch.zeros(2)
    assert fsdp_weight._record_once((cpu,), ()) == ()
