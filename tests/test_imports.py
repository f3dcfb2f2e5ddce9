"""The package's import contracts (``.importlinter``, checked with
import-linter): no new import cycle between sibling modules or packages,
and no library module importing a benchmark or a demo."""

import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint(config: str, cwd: str) -> int:
    from importlinter.cli import lint_imports

    old = os.getcwd()
    os.chdir(cwd)
    try:
        return lint_imports(config_filename=config, no_cache=True)
    finally:
        os.chdir(old)


def test_package_keeps_its_import_contracts():
    pytest.importorskip("importlinter")
    assert _lint(os.path.join(ROOT, ".importlinter"), ROOT) == 0


def test_a_new_cycle_breaks_the_contract(tmp_path, monkeypatch):
    """The same contract type on a two-module package whose modules import
    each other: broken (so the check above is one that can fail)."""
    pytest.importorskip("importlinter")
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (tmp_path / "contracts.ini").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = cyclic_pkg

        [importlinter:contract:acyclic]
        name = no cycles
        type = acyclic_siblings
        ancestors =
            cyclic_pkg
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _lint(str(tmp_path / "contracts.ini"), str(tmp_path)) != 0


@pytest.mark.parametrize("old, new", [
    ("bench", "benchmarks.compare"), ("bench_llama", "benchmarks.llama"),
    ("bench_host", "benchmarks.host"), ("bench_norm", "benchmarks.norm"),
    ("bench_fsdp", "benchmarks.fsdp"), ("parallel_demo", "demos.parallel"), ("tour", "demos.tour")])
def test_old_module_paths_are_the_moved_modules(old, new):
    """The benchmarks and demos moved into their subpackages; their old
    paths import the moved modules themselves (one release of grace)."""
    import importlib

    assert (importlib.import_module(f"transformer_engine_compile.{old}")
            is importlib.import_module(f"transformer_engine_compile.{new}"))


def test_old_demo_path_still_runs():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "transformer_engine_compile.tour", "--shape", "128",
                          "256"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "B/elem" in out.stdout
