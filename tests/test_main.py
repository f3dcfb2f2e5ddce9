"""The README's main job (``python -m transformer_engine_compile``, the
training demo) and the format tour (``python -m transformer_engine_compile.demos.tour``)."""

import re
import subprocess
import sys

import pytest


def test_format_tour_prints_every_format_with_sane_numbers():
    out = subprocess.run([sys.executable, "-m", "transformer_engine_compile.demos.tour", "--shape", "256", "512"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(.+?)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows[m.group(1).strip()] = tuple(float(g) for g in m.groups()[1:])
    assert len(rows) == 8, out
    for name, (rel, _, row_b, both_b) in rows.items():
        assert 0 < rel < (25 if "NVFP4" in name else 6), name
        assert row_b < both_b <= 2 * row_b + 0.2
        assert row_b < (0.6 if "NVFP4" in name else 1.04)
    assert "torch.compile support: yes" in out


def _demo(*args):
    return subprocess.run([sys.executable, "-m", "transformer_engine_compile", *args],
                          capture_output=True, text=True, check=True, timeout=600).stdout


def _field(out, pattern):
    m = re.search(pattern, out)
    assert m, out
    return m.group(1)


def test_training_demo_default_compiles_fullgraph_without_fallbacks():
    out = _demo("--steps", "4", "--hidden", "128", "--tokens", "128", "--layers", "2")
    assert "recipe Float8CurrentScaling, device cpu" in out and "backend inductor" in out
    assert _field(out, r"graphs: (\d+)") == "1"
    assert _field(out, r"graph breaks: (\d+)") == "0"
    assert _field(out, r"fallbacks: (\S+)") == "none"
    # inductor fuses the ops around the layers (GELU, loss), so losses agree
    # closely, not bit for bit; the layer output is compared exactly next to it
    assert float(_field(out, r"max \|eager - compiled\| loss over the steps: (\S+)")) < 1e-4
    assert "eager vs compiled (inductor): bit for bit equal" in out
    assert re.search(r"time per step \(median of steps 2\.\.4\)", out)
    assert "on a CPU these times mean little" in out


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_training_demo_aot_eager_matches_eager_exactly(recipe):
    out = _demo("--recipe", recipe, "--backend", "aot_eager", "--steps", "6", "--hidden", "128",
                "--tokens", "128", "--layers", "2")
    assert float(_field(out, r"max \|eager - compiled\| loss over the steps: (\S+)")) == 0
    assert "(bit for bit)" in out
    losses = re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert len(losses) == 3 and float(losses[-1][0]) < float(losses[0][0])  # it learns


def test_demo_command_line_rough_edges():
    """--help names the program and explains every flag; --steps 0 and 1 work
    (compile time reported on its own); --device cuda without CUDA is one line."""
    help_text = _demo("--help")
    assert help_text.startswith("usage: python -m transformer_engine_compile")
    for flag in ("--recipe", "--mode", "--backend", "--device", "--steps", "--layers",
                 "--hidden", "--tokens"):
        assert re.search(rf"^  {flag}\b.*\n?.*\S", help_text, re.M), flag
    assert help_text.count("default") >= 8  # every flag's help names its default
    assert "nothing to train" in _demo("--steps", "0")
    out = _demo("--steps", "1", "--backend", "aot_eager", "--hidden", "128", "--tokens", "128",
                "--layers", "1")
    assert "compiling with aot_eager" in out and "first compiled step (compiles)" in out
    assert "needs --steps 2 or more" in out
    import torch
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "transformer_engine_compile", "--device", "cuda"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stdout.count("\n") <= 1
        assert r.stderr.strip().count("\n") == 0 and "sees no CUDA device" in r.stderr
