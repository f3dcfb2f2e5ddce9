"""The README's main job: ``python -m transformer_engine_compile``."""

import re
import subprocess
import sys


def test_format_tour_prints_every_format_with_sane_numbers():
    out = subprocess.run([sys.executable, "-m", "transformer_engine_compile", "--shape", "256", "512"],
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
