"""Mixture-of-experts blocks: the router, top-k, the permutation, gate/up +
SwiGLU + down as grouped GEMMs and the unpermutation (torchtitan's
pattern), forward + backward per step, te.GroupedExperts per recipe against
the same block on ``torch._grouped_mm`` in bf16, side by side in one
process, compiled.

    python -m transformer_engine_compile.benchmarks.moe [--configs mixtral qwen3] \\
        [--recipes fp8_current fp8_current_e4m3] [--steps 20] [--json out.json] [--profile] \\
        [--mode reduce-overhead] [--microbatches 4] [--tokens 32768]

Configs: ``mixtral`` (hidden 4096, ffn 14336, 8 experts, top-2, 16k
tokens), ``qwen3`` (hidden 2048, expert ffn 768, 128 experts, top-8, 16k
tokens), ``deepseek`` (DeepSeek-V3's experts: hidden 7168, expert ffn
2048, 256 experts, top-8, 8k tokens), ``tiny`` (the CPU smoke run: its times mean nothing).  The
``hf-*`` configs time whole training steps of a Hugging Face MoE model
(``transformers``' Mixtral or Qwen3-MoE, 2 decoder layers of those sizes,
2 x 4096 tokens) as is, its experts on ``torch._grouped_mm``, against
the model after ``te.convert``.  Each row also gives the host time of a
step (until its launches return).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from .. import recipe as R


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int


CONFIGS = {
    "mixtral": MoEConfig(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=16384),
    "qwen3": MoEConfig(hidden=2048, ffn=768, experts=128, top_k=8, tokens=16384),
    "deepseek": MoEConfig(hidden=7168, ffn=2048, experts=256, top_k=8, tokens=8192),
    "tiny": MoEConfig(hidden=128, ffn=64, experts=8, top_k=2, tokens=64),
}


def _torch_grouped_mm(a, b_t, offs):
    return torch._grouped_mm(a, b_t, offs=offs)


def torchao_fp8_rowwise():
    """torchao's FP8 rowwise grouped GEMM (its MoE training prototype, which
    pads the token groups itself), or None where it does not import."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError:
        return None
    return lambda a, b_t, offs: _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, offs, pad_token_groups_for_grouped_mm=False)


class TorchExperts(torch.nn.Module):
    """The baseline: the same experts on ``torch._grouped_mm`` (torch's own
    autograd), or on another grouped GEMM with its signature, routed by
    te.GroupedExperts' own ``permute`` / ``unpermute``."""

    def __init__(self, experts, hidden, ffn, dtype, device, grouped_mm=_torch_grouped_mm,
                 padded=False):
        super().__init__()
        self.num_experts = experts
        self.grouped_mm = grouped_mm
        # torchtitan's permutation for FP8 grouped GEMMs: each expert's rows
        # padded to a multiple of 16 (at least 16) with zero rows
        self.padded = padded
        self.gate_up_proj = torch.nn.Parameter(
            torch.randn(experts, 2 * ffn, hidden, dtype=dtype, device=device) * hidden ** -0.5)
        self.down_proj = torch.nn.Parameter(
            torch.randn(experts, hidden, ffn, dtype=dtype, device=device) * ffn ** -0.5)

    def forward(self, x, index, weights):
        from ..module.grouped.experts import permute, unpermute

        rows, perm, counts = permute(x, index, self.num_experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        if self.padded:
            from ..module.grouped.compute import group_ids
            from ..module.grouped.padding import padded_rows_of, scatter_rows

            dest, offs, size = padded_rows_of(offs, group_ids(offs, rows.shape[0]), 16)
            rows = scatter_rows(rows, dest, size)
        h = self.grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs)
        gate, up = h.chunk(2, dim=-1)
        y = self.grouped_mm(torch.nn.functional.silu(gate) * up,
                            self.down_proj.transpose(-2, -1), offs)
        return unpermute(y[dest] if self.padded else y, perm, weights)


class Block(torch.nn.Module):
    """Router (softmax, top-k, renormalised) then the experts, residual."""

    def __init__(self, cfg: MoEConfig, experts: torch.nn.Module, dtype, device):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = torch.nn.Linear(cfg.hidden, cfg.experts, bias=False, dtype=dtype,
                                      device=device)
        self.experts = experts

    def forward(self, x, is_first_microbatch=None):
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if is_first_microbatch is None:
            return x + self.experts(x, index, weights)
        return x + self.experts(x, index, weights, is_first_microbatch)


def build(cfg: MoEConfig, kind: str, device) -> Block:
    """``kind``: "torch" (TorchExperts), "torchao" (TorchExperts on torchao's
    FP8 rowwise grouped GEMM) or "te" (te.GroupedExperts), bf16 parameters,
    the same weights (seed 0)."""
    from ..module.grouped.experts import GroupedExperts

    dtype = torch.bfloat16
    torch.manual_seed(0)
    base = TorchExperts(cfg.experts, cfg.hidden, cfg.ffn, dtype, device)
    if kind == "torchao":
        base.grouped_mm, base.padded = torchao_fp8_rowwise(), True
        if base.grouped_mm is None:
            raise ImportError("torchao's MoE training prototype does not import")
    if kind in ("torch", "torchao"):
        experts = base
    else:
        experts = GroupedExperts(cfg.experts, cfg.hidden, cfg.ffn, params_dtype=dtype,
                                 device=device)
        experts.gate_up_proj, experts.down_proj = base.gate_up_proj, base.down_proj
    torch.manual_seed(1)
    return Block(cfg, experts, dtype, device)


def profile_once(run) -> dict:
    """One more step of ``run`` under torch.profiler, summarised as the other
    benchmarks print it (``step_profile.summarize``: the kernels by time)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from .step_profile import summarize

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CPU]
                     + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            run()
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        return summarize(path, top=20)


def time_block(block, rec, x, steps: int, compiled: bool, profiled: bool = False,
               mode: str = "default", microbatches: int = 1, cache: bool = False) -> dict:
    """Median ms of forward + backward (synchronised per step); with
    ``profiled``, the kernels of one more step under ``"profile"``;
    ``mode``: ``torch.compile``'s (``"reduce-overhead"``: CUDA graphs).
    In default mode each step adds its gradients into ``.grad`` (a
    gradient-accumulation micro-step); reduce-overhead clears them first.
    ``microbatches``: forward + backward that many times per step (default
    mode), with ``cache`` passing ``is_first_microbatch`` (True for the
    first, False after: the experts' FP8 weights quantized once a step)."""
    from ..autocast import autocast

    def step(first=None):
        with autocast(enabled=rec is not None, recipe=rec):  # recipe=None alone: the default
            y = block(x) if first is None else block(x, first)
        y.float().pow(2).mean().backward()

    compiled_step = torch.compile(step, mode=None if mode == "default" else mode) \
        if compiled else step

    def run():
        if compiled and mode == "reduce-overhead":
            # the last replay's gradients would be read (accumulated into)
            # after the next replay overwrote them
            x.grad = None
            block.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
        for i in range(microbatches):
            compiled_step((i == 0) if cache else None)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(3):
        run()
    sync()
    times, host = [], []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        host.append(time.perf_counter() - start)  # the launches, before waiting on the GPU
        sync()
        times.append(time.perf_counter() - start)
    result = {"ms": 1e3 * statistics.median(times), "host_ms": 1e3 * statistics.median(host)}
    if profiled:
        result["profile"] = profile_once(run)
    return result


RECIPES = ("fp8_current", "fp8_current_e4m3", "fp8_current_e4m3_fast", "fp8_delayed",
           "fp8_delayed_e4m3", "fp8_block", "fp8_block_dequantized", "mxfp8", "nvfp4")


def recipe(name: str):
    """A recipe by its short name; ``*_e4m3`` has E4M3 gradients too (the
    grouped FP8 kernel on Hopper takes E4M3 only, so the default HYBRID
    runs its backward GEMMs in bf16); ``*_fast`` accumulates fast in dgrad
    and wgrad too; ``fp8_block_dequantized`` is ``fp8_block`` on its fallback
    path (bf16 GEMMs of the dequantized operands) instead of the CuTeDSL
    blockwise grouped GEMM (``run`` turns the kernel off for it)."""
    if name == "fp8_block_dequantized":
        return R.Float8BlockScaling()
    if name == "fp8_current_e4m3":
        return R.Float8CurrentScaling(fp8_format=R.Format.E4M3)
    if name == "fp8_current_e4m3_fast":
        fast = R.MMParams(use_split_accumulator=False)
        return R.Float8CurrentScaling(fp8_format=R.Format.E4M3, fp8_gemm_dgrad=fast,
                                      fp8_gemm_wgrad=fast)
    if name == "fp8_delayed_e4m3":
        return R.DelayedScaling(fp8_format=R.Format.E4M3)
    return R.DelayedScaling() if name == "fp8_delayed" else R.by_name(name)


def config_with_tokens(name: str, tokens=None) -> MoEConfig:
    """``CONFIGS[name]``, with ``tokens`` per step instead of its own where
    given (the router splits them among the experts)."""
    cfg = CONFIGS[name]
    if tokens is None:
        return cfg
    if tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {tokens}")
    return dataclasses.replace(cfg, tokens=tokens)


def token_count(text: str) -> int:
    """``--tokens``' argparse type: a positive int."""
    tokens = int(text)
    if tokens <= 0:
        raise argparse.ArgumentTypeError(f"--tokens must be positive, got {tokens}")
    return tokens


def run(configs, recipes, device, steps, compiled, log=print, profiled=False,
        mode="default", microbatches=1, tokens=None) -> list:
    """Each config's block per candidate, side by side.  With more than one
    microbatch per step each recipe also runs with its FP8 weights cached
    across them (``cached``).  ``tokens``: per step, instead of each
    config's own."""
    if microbatches > 1 and compiled and mode != "default":
        raise ValueError("microbatches accumulate gradients across calls: default mode "
                         "or eager only")
    rows = []
    for name in configs:
        cfg = config_with_tokens(name, tokens)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(cfg.tokens, cfg.hidden, generator=g).to(device, torch.bfloat16)
        candidates = [("torch bf16", "torch", None), ("te bf16", "te", None)]
        for r in recipes:
            candidates.append((f"te {r}", "te", recipe(r)))
            if microbatches > 1:
                candidates.append((f"te {r} cached", "te", recipe(r)))
        if device.type == "cuda" and torchao_fp8_rowwise() is not None:
            candidates.append(("torchao fp8 rowwise", "torchao", None))
        for label, kind, rec in candidates:
            row = {"config": name, "candidate": label, "microbatches": microbatches,
                   "tokens": cfg.tokens}
            try:
                with _kernel_off("_dequantized" in label):
                    row.update(time_block(build(cfg, kind, device), rec, x.requires_grad_(),
                                          steps, compiled, profiled, mode, microbatches,
                                          cache=label.endswith(" cached")))
                base = next((r for r in rows + [row] if r["config"] == name
                             and r["candidate"] == "torch bf16" and "ms" in r), None)
                row["x_bf16"] = None if base is None else base["ms"] / row["ms"]
            except Exception as e:  # one failing candidate must not hide the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            log(format_row(row))
            if "profile" in row:
                from .step_profile import format_summary
                log(format_summary(f"{name} {label}", row["profile"]))
            torch._dynamo.reset()
    return rows


@contextlib.contextmanager
def _kernel_off(off: bool):
    """The CuTeDSL blockwise grouped GEMM turned off (``TE_COMPILE_CUTEDSL=0``)
    while ``off``."""
    from ..module.grouped.blockwise_gemm import DISABLE_VAR

    old = os.environ.get(DISABLE_VAR)
    if off:
        os.environ[DISABLE_VAR] = "0"
    try:
        yield
    finally:
        if off and old is None:
            del os.environ[DISABLE_VAR]
        elif off:
            os.environ[DISABLE_VAR] = old


def format_row(row) -> str:
    config = row["config"]
    if row.get("tokens") not in (None, getattr(CONFIGS.get(config), "tokens", None)):
        config = f"{config}@{row['tokens']}"
    head = f"{config:>12} {row['candidate']:>20}"
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    ratio = "" if row.get("x_bf16") is None else f"{row['x_bf16']:7.2f}x"
    return f"{head} {row['ms']:9.2f} ms {ratio}   host {row['host_ms']:6.2f} ms"


# -- whole training steps of a Hugging Face MoE model after te.convert ------------------
@dataclasses.dataclass(frozen=True)
class HFMoEConfig:
    family: str  # "mixtral" or "qwen3_moe"
    layers: int
    hidden: int
    ffn: int     # each expert's
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


HF_CONFIGS = {
    "hf-mixtral": HFMoEConfig("mixtral", layers=2, hidden=4096, ffn=14336, experts=8, top_k=2,
                              heads=32, kv_heads=8, vocab=32000, batch=2, seq=4096),
    "hf-qwen3-moe": HFMoEConfig("qwen3_moe", layers=2, hidden=2048, ffn=768, experts=128,
                                top_k=8, heads=32, kv_heads=4, vocab=32000, batch=2, seq=4096),
    "hf-tiny": HFMoEConfig("qwen3_moe", layers=1, hidden=64, ffn=32, experts=4, top_k=2,
                           heads=4, kv_heads=2, vocab=256, batch=2, seq=16),
}


def hf_moe_model(cfg: HFMoEConfig, kind: str, device) -> tuple:
    """``(model, experts implementation)``: Hugging Face's Mixtral or
    Qwen3-MoE causal LM at ``cfg``'s sizes, bf16, as is ("torch": its
    experts on ``torch._grouped_mm`` where ``transformers`` has that
    implementation) or after ``te.convert`` ("te": te.GroupedExperts and
    te.Linear projections)."""
    import transformers

    from ..convert import convert

    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                  num_experts_per_tok=cfg.top_k, max_position_embeddings=cfg.seq,
                  attn_implementation="sdpa", use_cache=False)
    if cfg.family == "mixtral":
        hf_cfg = transformers.MixtralConfig(intermediate_size=cfg.ffn,
                                            num_local_experts=cfg.experts, **common)
        cls = transformers.MixtralForCausalLM
    else:
        hf_cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=cfg.ffn,
                                             num_experts=cfg.experts, **common)
        cls = transformers.Qwen3MoeForCausalLM
    impl = "eager"
    if kind == "torch" and hasattr(hf_cfg, "_experts_implementation"):
        hf_cfg._experts_implementation, impl = "grouped_mm", "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(hf_cfg).to(torch.bfloat16)
    if kind == "te":
        convert(model)
        impl = "te.GroupedExperts"
    return model, impl


def run_hf(configs, recipes, device, steps, compiled=True, log=print, mode="default") -> list:
    """Whole training steps (fused AdamW, loss read every step, compiled
    fullgraph) of the Hugging Face model as is, in bf16, and after
    ``te.convert`` under each recipe, side by side; ``loss``: the loss of
    one more step (the same data every step: the runs fit it alike)."""
    from .llama import CausalLMLoss, make_step, time_steps

    rows = []
    for name in configs:
        cfg = HF_CONFIGS[name]
        gen = torch.Generator(device=device).manual_seed(1)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device, generator=gen)
        candidates = [("torch bf16", "torch", None), ("te bf16", "te", None)]
        candidates += [(f"te {r}", "te", recipe(r)) for r in recipes]
        for label, kind, rec in candidates:
            row = {"config": name, "candidate": label}
            try:
                model, impl = hf_moe_model(cfg, kind, device)
                step = make_step(CausalLMLoss(model), rec, mode if compiled else "eager")
                ms, host_ms = time_steps(step, tokens, tokens, steps=steps)
                row.update(ms=ms, host_ms=host_ms, experts=impl, loss=step(tokens, tokens))
                base = next((r for r in rows + [row] if r["config"] == name
                             and r["candidate"] == "torch bf16" and "ms" in r), None)
                row["x_bf16"] = None if base is None else base["ms"] / row["ms"]
                del model, step
            except Exception as e:  # one failing candidate must not hide the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            log(format_row(row) + (f"   experts: {row['experts']}" if "experts" in row else ""))
            torch._dynamo.reset()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS) + sorted(HF_CONFIGS),
                        default=None, help="default: mixtral qwen3 on a GPU, tiny on a CPU; "
                        "hf-*: whole training steps of a Hugging Face MoE model")
    parser.add_argument("--recipes", nargs="+", default=["fp8_current", "fp8_current_e4m3"],
                        choices=RECIPES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                        help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="forward + backward this many times per step (gradient "
                             "accumulation, default mode); each recipe also runs with its "
                             "FP8 weights cached across them (is_first_microbatch)")
    parser.add_argument("--tokens", type=token_count, default=None,
                        help="tokens per step for the block configs instead of each "
                             "config's own (e.g. 32768 for deepseek: 1024 per expert)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="after timing, one step of each row under torch.profiler: "
                             "its kernels by time")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    configs = args.configs or (["mixtral", "qwen3"] if device.type == "cuda" else ["tiny"])
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {'eager' if args.eager else 'compiled ' + args.mode}, "
          "forward + backward per step")
    blocks = [c for c in configs if c in CONFIGS]
    rows = run(blocks, args.recipes, device, args.steps, not args.eager, profiled=args.profile,
               mode=args.mode, microbatches=args.microbatches, tokens=args.tokens)
    rows += run_hf([c for c in configs if c in HF_CONFIGS], args.recipes, device, args.steps,
                   not args.eager, mode=args.mode)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device),
                       "microbatches": args.microbatches,
                       "mode": "eager" if args.eager else args.mode, "rows": rows}, f,
                      indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
