"""benchmarks.first_step on CPU (aot_eager): each candidate's first compiled
step in a fresh process with empty compile caches, with torch's phases."""

import math

from transformer_engine_compile.benchmarks import first_step


def test_first_step_fresh_processes_and_phases(capsys):
    rows = first_step.run(["hf-llama-tiny"], ["fp8_current"], "cpu", backend="aot_eager",
                          rounds=1)
    assert [r["recipe"] for r in rows] == ["bf16", "fp8_current"]
    for r in rows:
        assert "error" not in r, r
        run, = r["runs"]
        assert r["first_step_s"] > 0 and math.isfinite(run["loss"])
        assert run["phases"]["bytecode_tracing"] > 0
        assert set(r["phases"]) == {p for p, _ in first_step.PHASES}
    # each process compiled its own model: nothing came from the other's caches
    assert all(r["runs"][0]["phases"]["OutputGraph.call_user_compiler"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "| hf-llama-tiny | torch bf16 |" in out and "| hf-llama-tiny | te fp8_current |" in out


def test_a_failing_candidate_reports_its_error():
    row = first_step.measure("no-such-config", "bf16", "cpu", "aot_eager")
    assert "no-such-config" in row["error"]
