"""Normalisation kernels and ``te.LayerNormLinear``'s ops: host time per op
call and GPU time of the norm kernels (CUDA only).

* Host time: the ``te_compile::layernorm_linear_fwd`` / ``_bwd`` ops called
  with their flat arguments, as a compiled graph's runtime calls them, next
  to ``te.Linear``'s ops, the method of ``benchmarks.host`` (tiny inputs, N
  back-to-back calls, wall time over N, no profiler).
* GPU time (``triton.testing.do_bench``, median) at 8192 x 4096 bf16: the
  Triton forward / backward against the reference (torch ops in fp32) and
  torch's own bf16 ``layer_norm`` / ``rms_norm``; FP8 current scaling of the
  norm's output with its own amax pass against the norm kernel's amax;
  delayed scaling's norm then cast against the norm writing FP8 itself.

    python -m transformer_engine_compile.benchmarks.norm
"""

from __future__ import annotations

import torch

from .. import recipe as R
from .host import _busy_gpu, _per_call_us


def _op_calls(layer, rec, x, dy):
    from ..autocast import autocast

    ops = layer._OPS
    with autocast(enabled=rec is not None, recipe=rec):
        args = layer._make_args(x, None, False, False)
    flat = ops.fwd_plan.encode(args)
    with torch.no_grad():
        result = ops.forward(args)
    grads = {"grad_output": dy}
    if "grad_ln_out" in ops.bwd_plan.cls.__dataclass_fields__:
        grads["grad_ln_out"] = None
    bwd_args = ops.make_bwd_args(dict(result.saved), ops.setup_context(args), grads)
    bflat = ops.bwd_plan.encode(bwd_args)

    def fwd():
        with torch.no_grad():
            ops.fwd_op(*flat)

    def bwd():
        with torch.no_grad():
            ops.bwd_op(*bflat)

    return fwd, bwd


def host_times(n=300, size=256, tokens=256, rounds=3, log=print) -> list:
    """Per case, the smallest of ``rounds`` interleaved measurements (each
    the median of 5 x ``n`` calls; the spread between rounds is printed)."""
    from ..module.layernorm import linear_ops as LO
    from ..module.layernorm.linear import LayerNormLinear
    from ..module.linear.layer import Linear

    dev = torch.device("cuda")
    dt = torch.bfloat16
    x = torch.randn(tokens, size, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(tokens, size, device=dev, dtype=dt)
    # what a label's "no ..." turns off: the norm's amax handed to the cast,
    # and under delayed scaling the norm writing FP8 itself
    turned_off = {"no amax fusion": "_amax_fused_quantizer", "no FP8 norm": "_fp8_writing_quantizer"}
    cases = [("Linear", "bf16", Linear, {}), ("LayerNormLinear", "bf16", LayerNormLinear, {}),
             ("LayerNormLinear RMSNorm", "bf16", LayerNormLinear, {"normalization": "RMSNorm"}),
             ("Linear", "fp8_current", Linear, {}),
             ("LayerNormLinear", "fp8_current", LayerNormLinear, {}),
             ("LayerNormLinear RMSNorm", "fp8_current", LayerNormLinear,
              {"normalization": "RMSNorm"}),
             ("LayerNormLinear no amax fusion", "fp8_current", LayerNormLinear, {}),
             ("Linear", "fp8_delayed", Linear, {}),
             ("LayerNormLinear", "fp8_delayed", LayerNormLinear, {}),
             ("LayerNormLinear no FP8 norm", "fp8_delayed", LayerNormLinear, {})]
    calls = []
    for label, rname, cls, kw in cases:
        torch.manual_seed(0)
        layer = cls(size, size, bias=False, params_dtype=dt, device=dev, **kw)
        rec = R.DelayedScaling() if rname == "fp8_delayed" else R.by_name(rname)
        calls.append((label, rname, _op_calls(layer, rec, x, dy)))

    def measured(label, fn):
        off = [name for tag, name in turned_off.items() if tag in label]
        real = {name: getattr(LO, name) for name in off}
        for name in off:
            setattr(LO, name, lambda args: None)
        try:
            _busy_gpu(dev, 0.2)
            return _per_call_us(fn, dev, n)
        finally:
            for name, fn_ in real.items():
                setattr(LO, name, fn_)

    samples = {(label, rname): {"fwd": [], "bwd": []} for label, rname, _ in calls}
    mm = []
    for _ in range(rounds):
        _busy_gpu(dev, 0.2)
        mm.append(_per_call_us(lambda: torch.mm(x.detach(), x.detach()), dev, n))
        for label, rname, (fwd, bwd) in calls:
            samples[(label, rname)]["fwd"].append(measured(label, fwd))
            samples[(label, rname)]["bwd"].append(measured(label, bwd))
    log(f"baseline torch.mm {min(mm):.1f} us (rounds: {', '.join(f'{v:.1f}' for v in mm)})")
    rows = []
    for (label, rname), ss in samples.items():
        row = {"layer": label, "recipe": rname, "fwd_us": min(ss["fwd"]),
               "bwd_us": min(ss["bwd"])}
        rows.append(row)
        log(f"{label:>32} {rname:>12} fwd op {row['fwd_us']:7.1f} us  bwd op "
            f"{row['bwd_us']:7.1f} us   (rounds fwd {', '.join(f'{v:.0f}' for v in ss['fwd'])}"
            f"; bwd {', '.join(f'{v:.0f}' for v in ss['bwd'])})")
    return rows


def gpu_times(m=8192, k=4096, log=print) -> dict:
    import triton.testing

    from ..kernels import reference as ref
    from ..kernels import triton_norm as tn
    from ..kernels import triton_quant as tq

    dev = "cuda"
    dt = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(k, device=dev, dtype=dt) * 0.2 + 1
    b = torch.randn(k, device=dev, dtype=dt) * 0.2
    dy = torch.randn(m, k, device=dev, dtype=dt)
    F = torch.nn.functional
    out = {}

    def t(name, fn, nbytes):
        us = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        out[name] = us
        log(f"{name:>48} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s")

    io = m * k * 2
    fwd_ps, bwd_ps = tn.FWD_AMAX_PROGRAMS_PER_SM, tn.BWD_PROGRAMS_PER_SM
    for rms in (False, True):
        nm = "RMSNorm" if rms else "LayerNorm"
        bb = None if rms else b
        y, mean, rstd = ref.norm_forward(x, w, bb, 1e-5, rms)
        t(f"{nm} fwd triton", lambda: tn.norm_forward(x, w, bb, 1e-5, rms), 2 * io)
        t(f"{nm} fwd triton + amax", lambda: tn.norm_forward(x, w, bb, 1e-5, rms, True), 2 * io)
        t(f"{nm} fwd reference (torch, fp32 math)",
          lambda: ref.norm_forward(x, w, bb, 1e-5, rms), 2 * io)
        if rms:
            t(f"{nm} fwd torch F.rms_norm bf16", lambda: F.rms_norm(x, (k,), w, 1e-5), 2 * io)
        else:
            t(f"{nm} fwd torch F.layer_norm bf16", lambda: F.layer_norm(x, (k,), w, b, 1e-5),
              2 * io)
        t(f"{nm} bwd triton (dx, dgamma{'' if rms else ', dbeta'})",
          lambda: tn.norm_backward(dy, x, mean, rstd, w, rms, True, True, True), 3 * io)
        t(f"{nm} bwd reference (torch, fp32 math)",
          lambda: ref.norm_backward(dy, x, mean, rstd, w, rms, True, True, True), 3 * io)
    _, mean, rstd = ref.norm_forward(x, w, b, 1e-5, False)
    for per_sm in (1, 2, 4):  # the backward's grid
        tn.BWD_PROGRAMS_PER_SM = per_sm
        t(f"LayerNorm bwd triton, {per_sm} programs/SM",
          lambda: tn.norm_backward(dy, x, mean, rstd, w, False, True, True, True), 3 * io)
    for per_sm in (2, 4, 8):  # the grid of the amax-returning forward
        tn.FWD_AMAX_PROGRAMS_PER_SM = per_sm
        t(f"LayerNorm fwd + amax, {per_sm} programs/SM",
          lambda: tn.norm_forward(x, w, b, 1e-5, False, True), 2 * io)
    tn.FWD_AMAX_PROGRAMS_PER_SM, tn.BWD_PROGRAMS_PER_SM = fwd_ps, bwd_ps
    y, _, _, parts = tn.norm_forward(x, w, b, 1e-5, False, True)
    t("fp8 current quantize(y): own amax pass + cast",
      lambda: tq.quantize_fp8_current(y, "e4m3", False, 0.0, True, True), io + io)
    t("fp8 current quantize(y): norm's amax, cast only",
      lambda: tq.quantize_fp8_current(y, "e4m3", False, 0.0, True, True, parts), io + io)

    def separate():
        yy = tn.norm_forward(x, w, b, 1e-5, False)[0]
        tq.quantize_fp8_current(yy, "e4m3", False, 0.0, True, True)

    def fused():
        yy, _, _, p = tn.norm_forward(x, w, b, 1e-5, False, True)
        tq.quantize_fp8_current(yy, "e4m3", False, 0.0, True, True, p)

    t("LayerNorm + fp8 quantize, separate amax", separate, 2 * io + io)
    t("LayerNorm + fp8 quantize, norm's amax", fused, 2 * io + io)
    # delayed scaling (scale known in advance), both FP8 copies as a layer with
    # a trainable weight needs them: norm then cast, against the norm casting
    scale, amax = torch.full((1,), 0.5, device=dev), torch.zeros(1, device=dev)

    def delayed_separate():
        yy = tn.norm_forward(x, w, b, 1e-5, False)[0]
        tq.quantize_fp8_tensorwise(yy, scale, "e4m3", True, True, amax)

    t("LayerNorm + fp8 delayed quantize, separate", delayed_separate, 2 * io + io)
    t("LayerNorm writing fp8 (delayed) + byte transpose",
      lambda: tn.norm_forward_fp8(x, w, b, 1e-5, False, scale, "e4m3", True, amax, False),
      io + io)
    t("LayerNorm writing fp8 (delayed), rowwise only",
      lambda: tn.norm_forward_fp8(x, w, b, 1e-5, False, scale, "e4m3", False, amax, False),
      io)
    return out


def main():
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = host_times()
    times = gpu_times()
    return rows, times


if __name__ == "__main__":
    main()
