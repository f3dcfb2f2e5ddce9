"""benchmarks.first_step on CPU (aot_eager): each candidate's first compiled
step in a fresh process with empty compile caches, with torch's phases."""

import json
import math
import subprocess
import sys

from transformer_engine_compile.benchmarks import first_step


def test_first_step_fresh_processes_and_phases(tmp_path):
    """As the docs run it (``python -m``): a row per candidate, each from its
    own process, with the phases the table prints."""
    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, "-m", "transformer_engine_compile.benchmarks.first_step",
                        "--configs", "hf-llama-tiny", "--recipes", "fp8_current", "--device", "cpu",
                        "--backend", "aot_eager", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "fp8_current"]
    for r in rows:
        assert "error" not in r, r
        run, = r["runs"]
        assert r["first_step_s"] > 0 and math.isfinite(run["loss"])
        assert run["phases"]["bytecode_tracing"] > 0
        assert set(r["phases"]) == {p for p, _ in first_step.PHASES}
        # each process compiled its own model: nothing came from the other's caches
        assert run["phases"]["OutputGraph.call_user_compiler"] > 0
    assert "| hf-llama-tiny | torch bf16 |" in p.stdout
    assert "| hf-llama-tiny | te fp8_current |" in p.stdout


def test_a_failing_candidate_reports_its_error():
    row = first_step.measure("no-such-config", "bf16", "cpu", "aot_eager")
    assert "no-such-config" in row["error"]
