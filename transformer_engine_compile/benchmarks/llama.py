"""A Llama-style decoder for whole-training-step benchmarks.

RMSNorm, rotary embeddings, SDPA attention with grouped KV heads and a
SwiGLU MLP; every projection (q, k, v, o, gate, up, down) comes from a
``linear`` factory, so the same model runs on ``torch.nn.Linear``,
``te.Linear`` or torchao's ``Float8Linear``.  The model reads hidden states
(no embedding or LM head: both run in bf16 whatever the recipe, so they
would only dilute the comparison) and the loss is the mean squared error
against a fixed target, computed in fp32.

One training step, as a user's loop runs it: forward under the recipe,
loss, backward, fused AdamW step, ``loss.item()`` (the loop logs it, so the
host waits for the GPU every step).  Parameters are bf16.

The ``hf-*`` configs run a real model instead: Hugging Face's
``LlamaForCausalLM`` (where ``transformers`` is installed) at the same
sizes with a 32000-token vocabulary, SDPA attention, token ids in, its own
cross-entropy loss out (the labels are the tokens).  ``te`` candidates are
the model after ``te.convert`` (every ``torch.nn.Linear``, the LM head
included), torchao's after ``convert_to_float8_training``: what a user
converting a model gets.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    batch: int
    seq: int
    # > 0: Hugging Face's LlamaForCausalLM with this vocabulary (hf_model)
    vocab: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


LLAMA_CONFIGS = {
    "llama-a": LlamaConfig(layers=4, hidden=2048, ffn=5632, heads=16, kv_heads=8, batch=4,
                           seq=1024),
    "llama-b": LlamaConfig(layers=2, hidden=4096, ffn=14336, heads=32, kv_heads=8, batch=4,
                           seq=2048),
}
TINY_LLAMA = {"llama-tiny": LlamaConfig(layers=2, hidden=256, ffn=256, heads=4, kv_heads=2,
                                        batch=2, seq=64)}
HF_CONFIGS = {
    "hf-llama-a": dataclasses.replace(LLAMA_CONFIGS["llama-a"], vocab=32000),
    "hf-llama-b": dataclasses.replace(LLAMA_CONFIGS["llama-b"], vocab=32000),
}
TINY_HF = {"hf-llama-tiny": dataclasses.replace(TINY_LLAMA["llama-tiny"], vocab=512)}
ALL_LLAMA = {**LLAMA_CONFIGS, **TINY_LLAMA, **HF_CONFIGS, **TINY_HF}


def hf_available() -> bool:
    """Whether Hugging Face ``transformers`` imports (the ``hf-*`` configs)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, device, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=torch.bfloat16))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _rope(x, cos, sin):
    """Rotary embedding on (b, heads, s, d), halves rotated (Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, linear, device):
        super().__init__()
        hd = cfg.hidden // cfg.heads
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, hd
        self.attn_norm = RMSNorm(cfg.hidden, device)
        self.q = linear(cfg.hidden, cfg.heads * hd, device)
        self.k = linear(cfg.hidden, cfg.kv_heads * hd, device)
        self.v = linear(cfg.hidden, cfg.kv_heads * hd, device)
        self.o = linear(cfg.heads * hd, cfg.hidden, device)
        self.mlp_norm = RMSNorm(cfg.hidden, device)
        self.gate = linear(cfg.hidden, cfg.ffn, device)
        self.up = linear(cfg.hidden, cfg.ffn, device)
        self.down = linear(cfg.ffn, cfg.hidden, device)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.attn_norm(x).reshape(b * s, d)
        a = _attention(self, self.q(h), self.k(h), self.v(h), b, s, cos, sin)
        x = x + self.o(a).view(b, s, d)
        h = self.mlp_norm(x).reshape(b * s, d)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)).view(b, s, d)


def _attention(block, q, k, v, b, s, cos, sin):
    """Causal SDPA with rotary q, k and grouped KV heads; (b * s, heads * hd)."""
    def heads(t, n):
        return t.reshape(b, s, n, block.head_dim).transpose(1, 2)

    q = _rope(heads(q, block.heads), cos, sin)
    k = _rope(heads(k, block.kv_heads), cos, sin)
    v = heads(v, block.kv_heads)
    rep = block.heads // block.kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(b * s, -1)


class PackedBlock(torch.nn.Module):
    """The block with packed projections (q, k, v in one GEMM; gate and up
    in one, SwiGLU as Transformer Engine defines it: ``silu(first half) *
    second half``), on te modules.  ``fused``: ``te.LayerNormLinear`` (norm
    + QKV) and ``te.LayerNormMLP`` (norm + SwiGLU MLP), else the same model
    from separate norms and ``te.Linear``s (the fused modules' comparison);
    ``split``: those ``te.Linear``s hold q/k/v and gate/up as parameters of
    their own (``parameters_split``), as a model loaded from separately
    stored weights would."""

    def __init__(self, cfg: LlamaConfig, device, fused: bool, split: bool = False):
        super().__init__()
        from .. import module as M
        hd = cfg.hidden // cfg.heads
        self.heads, self.kv_heads, self.head_dim, self.fused = cfg.heads, cfg.kv_heads, hd, fused
        self.split = (cfg.heads * hd, cfg.kv_heads * hd, cfg.kv_heads * hd)
        kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
        if fused:
            self.qkv = M.LayerNormLinear(cfg.hidden, sum(self.split), normalization="RMSNorm",
                                         **kw)
            self.mlp = M.LayerNormMLP(cfg.hidden, cfg.ffn, normalization="RMSNorm",
                                      activation="swiglu", **kw)
        else:
            self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden, device), RMSNorm(cfg.hidden, device)
            parts = ({"query": self.split[0], "key": self.split[1], "value": self.split[2]},
                     ("gate", "up")) if split else (None, None)
            self.qkv = M.Linear(cfg.hidden, sum(self.split), parameters_split=parts[0], **kw)
            self.fc1 = M.Linear(cfg.hidden, 2 * cfg.ffn, parameters_split=parts[1], **kw)
            self.fc2 = M.Linear(cfg.ffn, cfg.hidden, **kw)
        self.o = M.Linear(cfg.heads * hd, cfg.hidden, **kw)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = x.reshape(b * s, d)
        qkv = self.qkv(h) if self.fused else self.qkv(self.attn_norm(h))
        q, k, v = qkv.split(self.split, dim=-1)
        x = x + self.o(_attention(self, q, k, v, b, s, cos, sin)).view(b, s, d)
        h = x.reshape(b * s, d)
        if self.fused:
            return x + self.mlp(h).view(b, s, d)
        gate, up = self.fc1(self.mlp_norm(h)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up).view(b, s, d)


def rope_tables(cfg: LlamaConfig, device) -> tuple:
    """(cos, sin), bf16 (seq, head dim): the rotary embedding's tables."""
    hd = cfg.hidden // cfg.heads
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=device).float() / hd)
    ang = torch.outer(torch.arange(cfg.seq, device=device).float(), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)


class Llama(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, linear, device, block=None):
        super().__init__()
        self.cfg = cfg
        make = block or (lambda: Block(cfg, linear, device))
        self.blocks = torch.nn.ModuleList(make() for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, device)
        cos, sin = rope_tables(cfg, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.norm(x)


def decoder_blocks(model) -> list:
    """The decoder layers of a benchmark model (:class:`Llama`'s ``blocks``,
    or the Hugging Face model's ``model.layers`` inside :class:`CausalLMLoss`):
    the units data parallelism shards one by one."""
    if isinstance(model, CausalLMLoss):
        return list(model.model.model.layers)
    return list(model.blocks)


def torch_linear(k, n, device):
    return torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)


def te_linear(k, n, device):
    from ..module.linear.layer import Linear
    return Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)


class CausalLMLoss(torch.nn.Module):
    """A causal LM whose forward is its training loss: the model's own
    cross-entropy of next-token predictions, ``forward(tokens, labels)``."""

    returns_loss = True  # make_step: no loss of its own

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        return self.model(tokens, labels=labels).loss


def hf_model(cfg: LlamaConfig, kind: str, device, float8_config=None) -> CausalLMLoss:
    """Hugging Face's ``LlamaForCausalLM`` at ``cfg``'s sizes, bf16: as is
    ("torch"), after ``te.convert`` ("te") or torchao's
    ``convert_to_float8_training`` ("torchao")."""
    import transformers
    if kind not in ("torch", "te", "torchao"):
        raise ValueError(f"no {kind!r} variant of the Hugging Face model")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq,
        attn_implementation="sdpa",
        # training keeps no KV cache: with one, each decoder layer writes its
        # own slot (its layer_idx), so a compiled layer recompiles per layer
        # and every call checks the guards of the layers before it
        use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg)
    model = model.to(torch.bfloat16)
    if kind == "te":
        from ..convert import convert
        convert(model)
    elif kind == "torchao":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, config=float8_config)
    return CausalLMLoss(model)


def build(cfg, kind, device, float8_config=None):
    """The model for a candidate kind: "torch", "te", "torchao", or the
    packed-projection models "te-fused" / "te-unfused" / "te-split"
    (:class:`PackedBlock`);
    for an ``hf-*`` config (``cfg.vocab``) :func:`hf_model`'s.
    "te-unshared" is "te"'s model (its step turns eager input sharing off).
    ``float8_config``: torchao's ``Float8LinearConfig`` (its default when None)."""
    if kind == "te-unshared":
        kind = "te"
    if cfg.vocab:
        return hf_model(cfg, kind, device, float8_config)
    torch.manual_seed(0)
    if kind == "te":
        return Llama(cfg, te_linear, device)
    if kind in ("te-fused", "te-unfused", "te-split"):
        return Llama(cfg, None, device,
                     block=lambda: PackedBlock(cfg, device, fused=kind == "te-fused",
                                               split=kind == "te-split"))
    model = Llama(cfg, torch_linear, device)
    if kind == "torchao":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, config=float8_config)
    return model


def make_step(model, rec, mode, lr=1e-4, amax_reduction_group=None, after_step=None,
              backend="inductor", share_inputs=True):
    """``step(x, target) -> loss float``: forward, loss, backward, fused AdamW
    (:func:`param_groups`).  ``share_inputs=False``: eager layers that read
    one input quantize it each (``dynamo/shared_inputs.py``'s ``EAGER``,
    set for this step's calls).
    ``amax_reduction_group`` goes to ``te.autocast`` (DelayedScaling under
    data parallelism); ``after_step()`` runs after the optimizer step (e.g.
    torchao's ``precompute_float8_dynamic_scale_for_fsdp``); ``backend``:
    ``torch.compile``'s, for the compiled modes."""
    from ..autocast import autocast
    from ..dynamo import shared_inputs

    def loss_fn(x, target):
        with autocast(enabled=rec is not None, recipe=rec,
                      amax_reduction_group=amax_reduction_group):
            if getattr(model, "returns_loss", False):  # CausalLMLoss: tokens, labels
                return model(x, target)
            y = model(x)
        return F.mse_loss(y.float(), target)

    f = loss_fn if mode == "eager" else torch.compile(
        loss_fn, fullgraph=True, backend=backend, mode=None if mode == "default" else mode)
    # fused on every device (torch's CPU build has the kernel too), so the CPU
    # tests run the optimizer path the GPU runs
    opt = torch.optim.AdamW(param_groups(model), lr=lr, fused=True)

    def step(x, target, timings=None):
        # read by the eager calls and by native plans made in this step
        with shared_inputs.eager_sharing(share_inputs):
            t0 = time.perf_counter()
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            loss = f(x, target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step()
            t1 = time.perf_counter()
            value = loss.item()
        if timings is not None:
            timings.append((t1 - t0, time.perf_counter() - t0))
        return value

    return step


def param_groups(model) -> list:
    """The optimizer's parameter groups: DTensor parameters (torch's tensor
    parallelism, FSDP2) apart from plain ones, since fused AdamW takes one
    kind per group."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return [{"params": list(model.parameters())}]
    groups: dict = {}
    for p in model.parameters():
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": params} for params in groups.values()]


def time_steps(step, x, target, warmup=3, steps=10):
    """(median ms per step, median host ms per step): the host part ends
    where ``loss.item()`` starts waiting for the GPU."""
    for _ in range(warmup):
        step(x, target)
    timings = []
    for _ in range(steps):
        step(x, target, timings)
    return (statistics.median(t for _, t in timings) * 1e3,
            statistics.median(h for h, _ in timings) * 1e3)


def inputs(cfg, device, seed=1):
    """(x, target): hidden states and a target for the MSE loss; for an
    ``hf-*`` config token ids, which are also the labels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if cfg.vocab:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device, generator=gen)
        return tokens, tokens
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, device=device, dtype=torch.bfloat16,
                    generator=gen)
    target = torch.randn(cfg.batch, cfg.seq, cfg.hidden, device=device, generator=gen)
    return x, target


def candidates(recipes, with_torchao, fused=False, unshared=False):
    """(label, model kind, recipe) in table order; ``fused`` adds the
    packed-projection model built from separate norms + te.Linear
    ("unfused"; "split": the same with ``parameters_split``) and from
    te.LayerNormLinear + te.LayerNormMLP ("fused"); ``unshared`` the te
    model whose eager layers quantize a shared input each ("unshared")."""
    out = [("torch bf16", "torch", None)]
    if with_torchao:
        out.append(("torchao fp8 tensorwise", "torchao", None))
    out.append(("te bf16", "te", None))
    out += [(f"te {name}", "te", rec) for name, rec in recipes.items()]
    if unshared:
        out += [(f"te {name} unshared", "te-unshared", rec) for name, rec in recipes.items()]
    if fused:
        for name, rec in {"bf16": None, **recipes}.items():
            out += [(f"te {name} {kind}", f"te-{kind}", rec)
                    for kind in ("unfused", "split", "fused")]
    return out


def error_text(e: BaseException) -> str:
    """A failed candidate's whole error on one line, with its causes: under
    ``torch.compile`` the layer's own error (e.g. a ValueError naming the
    shape a recipe refuses) is the cause of Dynamo's "Observed exception",
    whose text alone says nothing about it.  Where the cause's text does not
    carry the error's message either (torch 2.11: "raised exception
    ExceptionVariable(<class 'ValueError'>)"), Dynamo's "Developer debug
    context" line of the wrapper does, and is kept."""
    chain = [e]
    while chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    inner = " ".join(str(chain[-1]).split())
    # the wrappers by their first line (Dynamo's explanations and hints follow)
    # and any debug context the innermost error lacks; the innermost error whole
    parts = [_wrapper_text(x, inner) for x in chain[:-1]]
    parts.append(f"{type(chain[-1]).__name__}: {inner}")
    return " <- caused by ".join(parts)


_DEBUG_CONTEXT = "Developer debug context:"


def _wrapper_text(x: BaseException, inner: str) -> str:
    lines = [line.strip() for line in str(x).strip().splitlines()]
    text = f"{type(x).__name__}: {lines[0] if lines else ''}"
    context = next((line[len(_DEBUG_CONTEXT):].strip() for line in lines
                    if line.startswith(_DEBUG_CONTEXT)), "")
    context = " ".join(context.split())
    return f"{text} ({context})" if context and context not in inner else text


def peak_gib(step, x, target, device):
    """Peak GiB allocated over one ``step(x, target)`` (NaN off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(x, target)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def run(configs, recipes, modes, device, with_torchao, only=None, steps=10, log=print,
        fused=False, rounds=1, unshared=False, profile=False):
    """One row per (config, candidate, mode); a failing candidate gets an
    ``error`` entry and the others still run.  ``rounds > 1``: interleaved
    (:func:`run_interleaved`).  ``profile``: after its timing, one traced
    step per candidate (:func:`profile_row`)."""
    if rounds > 1:
        return run_interleaved(configs, recipes, modes, device, with_torchao, only, steps, log,
                               fused, rounds, unshared, profile)
    import gc

    rows = []
    for cfg, x, target, kind, rec, row in _entries(configs, recipes, modes, device,
                                                   with_torchao, only, fused, unshared):
        try:
            model = build(cfg, kind, device)
            step = make_step(model, rec, row["mode"], share_inputs=kind != "te-unshared")
            t0 = time.perf_counter()
            step(x, target)
            row["first_step_s"] = time.perf_counter() - t0  # compile included
            row["ms"], row["host_ms"] = time_steps(step, x, target, steps=steps)
            row["tokens_per_s"] = cfg.tokens / row["ms"] * 1e3
            row["peak_gib"] = peak_gib(step, x, target, device)
            row["loss"] = step(x, target)
            if profile:
                profile_row(row, step, x, target, log)
        except Exception as e:  # one failing candidate must not hide the others
            row["error"] = error_text(e)
        rows.append(row)
        log(format_row(row, rows))
        model = step = None
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _entries(configs, recipes, modes, device, with_torchao, only, fused, unshared=False):
    """(config, x, target, model kind, recipe, row) for each timed
    (config, candidate, mode), in table order."""
    for cname, cfg in configs.items():
        x, target = inputs(cfg, device)
        # the Hugging Face model has no packed-projection variant
        for label, kind, rec in candidates(recipes, with_torchao, fused and not cfg.vocab,
                                           unshared):
            if only and not any(label == o for o in only):
                continue
            for mode in modes:
                yield cfg, x, target, kind, rec, {"config": cname, "candidate": label,
                                                  "mode": mode}


def keep_compiled_entries() -> None:
    """Raise Dynamo's per-code-object cache limits: candidates built side by
    side share one step function's code object, and past the limit Dynamo
    would quietly run the later ones eagerly."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 512)


def profile_row(row, step, x, target, log=print) -> None:
    """One traced step of a candidate (``step_profile.trace_step``) into
    ``row["profile"]``: the GPU span, the compute stream's busy and idle
    time (idle: the GPU waited, for the host in a single-GPU step), its
    kernel count and time per kernel class, the top kernels; logged as a
    table."""
    from . import step_profile

    s = step_profile.trace_step(step, x, target)
    row["profile"] = {k: s[k] for k in ("step", "compute", "compute_idle", "kernel_count",
                                        "classes", "kernels") if k in s}
    log(step_profile.format_summary(f"{row['config']}, {row['candidate']}, {row['mode']}", s))


def run_interleaved(configs, recipes, modes, device, with_torchao, only=None, steps=10,
                    log=print, fused=False, rounds=5, unshared=False, profile=False):
    """:func:`run`'s rows, timed in ``rounds`` rounds that take turns.

    The host's speed drifts over minutes (the H200 machines' host time per
    step moved by 1.5x between runs of the same candidate), and a host-bound
    step follows it, so candidates timed one after the other can differ by
    more than what they are compared for.  Here every candidate is built and
    compiled first (all stay resident), then each round times ``steps``
    steps of each in turn; the medians are over all rounds.  Peak memory is
    each candidate's own: measured at its first step, less what the
    candidates built before it held."""
    import gc

    keep_compiled_entries()
    rows, live = [], []
    for cfg, x, target, kind, rec, row in _entries(configs, recipes, modes, device,
                                                   with_torchao, only, fused, unshared):
        row["rounds"] = rounds
        rows.append(row)
        try:
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            step = make_step(build(cfg, kind, device), rec, row["mode"],
                             share_inputs=kind != "te-unshared")
            t0 = time.perf_counter()
            step(x, target)
            row["first_step_s"] = time.perf_counter() - t0  # compile included
            row["peak_gib"] = peak_gib(step, x, target, device) - base / 2 ** 30
            live.append((row, step, x, target))
        except Exception as e:  # one failing candidate must not hide the others
            row["error"] = error_text(e)
            log(format_row(row, rows))
    time_in_rounds(live, rounds, steps)
    for row, step, x, target in live:
        if "error" not in row:
            row["tokens_per_s"] = configs[row["config"]].tokens / row["ms"] * 1e3
            row["loss"] = step(x, target)
            if profile:
                profile_row(row, step, x, target, log)
    for row in rows:
        if "ms" in row or "error" in row:
            log(format_row(row, rows))
    live.clear()
    gc.collect()
    return rows


def time_in_rounds(live, rounds: int, steps: int) -> None:
    """``live``: ``(row, step, x, target)`` per built candidate.  Each round
    times ``steps`` steps of every candidate in turn (after two warm-up
    steps: the others ran in between); then each row's ``ms`` and
    ``host_ms`` are its medians over all rounds.  A candidate that raises
    gets the row's ``error`` and no more steps."""
    timings = {id(row): [] for row, *_ in live}
    for _ in range(rounds):
        for row, step, x, target in live:
            if "error" in row:  # failed in an earlier round: no more of its steps
                continue
            try:
                for _ in range(2):
                    step(x, target)
                for _ in range(steps):
                    step(x, target, timings[id(row)])
            except Exception as e:
                row["error"] = error_text(e)
    for row, *_ in live:
        if "error" not in row:
            t = timings[id(row)]
            row["ms"] = statistics.median(a for _, a in t) * 1e3
            row["host_ms"] = statistics.median(h for h, _ in t) * 1e3


def _ratio(rows, row, candidate, mode):
    for r in rows:
        if (r["config"], r["candidate"], r["mode"]) == (row["config"], candidate, mode) \
                and "ms" in r and "ms" in row:
            return r["ms"] / row["ms"]
    return float("nan")


HEADER = (f"{'config':>10} {'candidate':>23} {'mode':>15} {'ms/step':>9} {'tokens/s':>10} "
          f"{'x bf16':>7} {'x bf16 eager':>12} {'host ms':>8} {'peak GiB':>8} {'1st step s':>10}")


def format_row(row, rows):
    if "error" in row:
        return f"{row['config']:>10} {row['candidate']:>23} {row['mode']:>15}  ERROR {row['error']}"
    return (f"{row['config']:>10} {row['candidate']:>23} {row['mode']:>15} {row['ms']:9.2f} "
            f"{row['tokens_per_s']:10.0f} {_ratio(rows, row, 'torch bf16', 'default'):7.2f} "
            f"{_ratio(rows, row, 'torch bf16', 'eager'):12.2f} {row['host_ms']:8.2f} "
            f"{row['peak_gib']:8.2f} {row['first_step_s']:10.1f}")
