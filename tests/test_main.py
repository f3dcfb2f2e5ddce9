"""The README's main job (``python -m transformer_engine_compile``, the
training demo) and the format tour (``python -m transformer_engine_compile.tour``)."""

import re
import subprocess
import sys

import pytest


def test_format_tour_prints_every_format_with_sane_numbers():
    out = subprocess.run([sys.executable, "-m", "transformer_engine_compile.tour", "--shape", "256", "512"],
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
    # closely, not bit for bit; the layers themselves are bit-exact (tests/test_linear.py)
    assert float(_field(out, r"max \|eager - compiled\| loss: (\S+)")) < 1e-4


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_training_demo_aot_eager_matches_eager_exactly(recipe):
    out = _demo("--recipe", recipe, "--backend", "aot_eager", "--steps", "6", "--hidden", "128",
                "--tokens", "128", "--layers", "2")
    assert float(_field(out, r"max \|eager - compiled\| loss: (\S+)")) == 0
    losses = re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert len(losses) == 3 and float(losses[-1][0]) < float(losses[0][0])  # it learns
